if Code.ensure_loaded?(Nx) do
  defmodule Emily.Compiler do
    @moduledoc """
    A `defn` compiler (`Nx.Defn.Compiler`) that runs numerical definitions on MLX.

        Nx.Defn.jit(&MyModule.predict/2, compiler: Emily.Compiler).(params, input)
        Nx.Defn.default_options(compiler: Emily.Compiler)

    ## Paths

    The **evaluator path** walks the `Nx.Defn.Expr` graph with `Nx.Defn.Evaluator`,
    with `Emily.Backend` as the default backend: every node becomes one lazy MLX op on
    the stream, `while` and `cond` predicates are read on the host, and `Nx.block/4`
    reaches `Emily.Backend.block/4`. Inputs that are not Emily tensors are copied in.

    A **native path** (the graph lowered once into a native MLX program and replayed in
    one call per run) is planned. Until it exists, `native: true` is accepted and runs
    the evaluator path, emitting `[:emily, :compiler, :evaluator_fallback]` telemetry
    with `%{reason: :no_native_program}`.

    ## Options

      * `:device` - `:cpu` or `:gpu`: where constants and copied-in inputs go (default
        `Emily.default_device/0`).
      * `:stream` - an `Emily.Stream` to run on (else the calling process's stream).
      * `:max_concurrency` - the number of partitions (each with its own stream) for
        `Nx.Serving` with `partitions: true`; default 1.
      * `:hooks` - named `io_call` callbacks, as `Nx.Defn.Evaluator` takes them (this is
        how `Nx.Serving` streams and how `print_value` hooks are overridden).
      * `:native` - see above.

    Other options are accepted and passed through (libraries such as Axon pass their
    own).
    """

    @behaviour Nx.Defn.Compiler

    @telemetry? Code.ensure_loaded?(:telemetry)

    @impl true
    def __jit__(key, vars, fun, args_list, opts) do
      __compile__(key, vars, fun, opts).(args_list)
    end

    @impl true
    def __compile__(key, vars, fun, opts) do
      # The native path plugs in here: lower `fun.(vars)` once to a native MLX program
      # and return a runner that replays it per argument list, sending the graphs it
      # cannot lower to the evaluator below with this same telemetry event.
      if opts[:native] do
        evaluator_fallback(:no_native_program)
      end

      evaluator(key, vars, fun, opts)
    end

    defp evaluator(key, vars, fun, opts) do
      backend = __to_backend__(opts)
      stream = opts[:stream]
      evaluator_opts = Keyword.drop(opts, [:device, :stream, :native])

      compiled =
        in_context(stream, backend, fn ->
          Nx.Defn.Evaluator.__compile__(key, vars, fun, evaluator_opts)
        end)

      fn args_list ->
        in_context(stream, backend, fn ->
          target = Emily.Stream.selected()

          Enum.flat_map(args_list, fn args ->
            compiled.([Enum.map(args, &to_emily(&1, backend, target))])
          end)
        end)
      end
    end

    @impl true
    def __partitions_options__(opts) do
      device = opts[:device] || Emily.default_device()

      for _ <- 1..Keyword.get(opts, :max_concurrency, 1)//1 do
        Keyword.put(opts, :stream, Emily.Stream.new(device))
      end
    end

    @impl true
    def __to_backend__(opts) do
      device =
        cond do
          device = opts[:device] -> device
          stream = opts[:stream] -> Emily.Stream.device(stream)
          true -> nil
        end

      if device, do: {Emily.Backend, device: device}, else: {Emily.Backend, []}
    end

    defp in_context(nil, backend, fun), do: Nx.with_default_backend(backend, fun)

    defp in_context(stream, backend, fun) do
      Emily.Stream.with_stream(stream, fn -> Nx.with_default_backend(backend, fun) end)
    end

    # Parameters arrive as thunks; ones on other backends are copied in so the graph's
    # ops dispatch to Emily.Backend, and ones lazy on another stream are evaluated there
    # once, not at each use.
    defp to_emily(thunk, backend, target) do
      fn ->
        case thunk.() do
          %Nx.Tensor{data: %Emily.Backend{}} = t when target == nil -> t
          %Nx.Tensor{data: %Emily.Backend{}} = t -> Emily.Backend.for_stream(t, target)
          %Nx.Tensor{data: %Nx.Defn.Expr{}} = t -> t
          %Nx.Tensor{} = t -> Nx.backend_copy(t, backend)
          other -> other
        end
      end
    end

    defp evaluator_fallback(reason) do
      if @telemetry? do
        :telemetry.execute([:emily, :compiler, :evaluator_fallback], %{}, %{reason: reason})
      end

      :ok
    end
  end
end
