defmodule Emily.Telemetry do
  @moduledoc """
  The `:telemetry` events Emily emits.

  `:telemetry` is an optional dependency. Whether it is there is decided once, when Emily
  is compiled: without it every emit point compiles to nothing (the metadata is not
  even built), so there is no cost to pay for observability you do not use.

  Spans follow `:telemetry.span/3`: `:start` carries `system_time` and `monotonic_time`,
  `:stop` carries `duration` and `monotonic_time` (native time units), `:exception`
  carries `duration` and adds `kind`, `reason` and `stacktrace` to the metadata. Every
  span's events also carry `telemetry_span_context`.

  ## Events

    * `[:emily, :eval, :start | :stop | :exception]` — `Emily.eval/1`, from the call to
      the last worker's reply. Metadata: `count` (the number of tensors).

    * `[:emily, :to_binary, :start | :stop | :exception]` — a read
      (`Emily.to_binary/1`, `Emily.to_list/1`, and `Nx.to_binary/1` and the like on
      `Emily.Backend`) that waits for its tensor's evaluation, from the start of the
      wait until the bytes are in the caller's hands. A read of an evaluated tensor
      (a compiled function's outputs, a tensor read before) takes a microsecond and
      emits nothing. Metadata: `tensor` (the tensor). `:stop` adds the measurement
      `bytes` (the size of the binary).

    * `[:emily, :fallback, :start | :stop | :exception]` — an op that `Emily.Backend`
      runs on `Nx.BinaryBackend` because MLX has no path for it (`Emily.Fallback`, whose
      `config :emily, :fallback` setting can also make it warn or raise). Metadata: `op`
      (the callback's name, an atom), `shapes` and `types` (those of its tensor inputs,
      in order, e.g. `[{3}, {}]` and `[{:s, 32}, {:s, 32}]`).

    * `[:emily, :compiler, :evaluator_fallback]` — a single event: a function that
      `Emily.Compiler`'s native path could not lower runs on the evaluator path.
      Metadata: `reason`.

    * `[:emily, :compiler, :fusion]` — a single event: one lowered program's fused
      kernels (`Emily.Compiler`, "Fusion"). Measurements: `count`. Metadata: `rewrites`
      (as `Emily.Compiler.fusions/3` lists them).

    * `[:emily, :memory, :collect]` — a single event: a process's garbage was collected
      because the results `Emily.Backend` and `Emily.Compiler` handed it passed the
      budget (`Emily.Memory`, "Results the BEAM has not collected yet"). Measurements:
      `bytes` (the results counted since the last collection). Metadata: empty.

    * `[:emily, :memory, :stats]` — a single event, emitted by `Emily.Memory.stats/0`.
      Measurements: `active`, `peak`, `cache`, `memory_limit`, `cache_limit` (bytes, as
      documented there). Metadata: empty.
  """

  @enabled Code.ensure_loaded?(:telemetry)

  @doc "Whether `:telemetry` was there when Emily was compiled (events are emitted)."
  @spec enabled?() :: boolean
  def enabled?, do: @enabled

  @doc false
  # Runs `body` in a `[:emily, event]` span. `metadata` is only evaluated when telemetry
  # is enabled. `stop` (optional) maps the result to `{extra_measurements, metadata}`.
  defmacro span(event, metadata, stop \\ nil, do: body) do
    if @enabled do
      # Fresh variables, so that spans nested in `body` cannot rebind them.
      meta = Macro.unique_var(:meta, __MODULE__)
      result = Macro.unique_var(:result, __MODULE__)

      finish =
        if stop == nil do
          quote do: {unquote(result), unquote(meta)}
        else
          quote do
            {measurements, extra} = unquote(stop).(unquote(result))
            {unquote(result), measurements, Map.merge(unquote(meta), extra)}
          end
        end

      quote do
        unquote(meta) = unquote(metadata)

        :telemetry.span([:emily, unquote(event)], unquote(meta), fn ->
          unquote(result) = unquote(body)
          unquote(finish)
        end)
      end
    else
      body
    end
  end

  @doc false
  # Emits a single `[:emily | event]` event; nothing is evaluated when telemetry is off.
  defmacro execute(event, measurements, metadata) do
    if @enabled do
      quote do
        :telemetry.execute(
          [:emily | unquote(event)],
          unquote(measurements),
          unquote(metadata)
        )
      end
    else
      :ok
    end
  end

  # Metadata and measurement builders, one per event (kept apart so they can be tested
  # without :telemetry).

  @doc false
  def eval_metadata(tensors) when is_list(tensors), do: %{count: length(tensors)}

  @doc false
  def to_binary_metadata(tensor), do: %{tensor: tensor}

  @doc false
  def to_binary_stop(binary) when is_binary(binary), do: {%{bytes: byte_size(binary)}, %{}}

  @doc false
  def fallback_metadata(op, inputs) when is_atom(op) and is_list(inputs) do
    {shapes, types} = Enum.unzip(inputs)
    %{op: op, shapes: shapes, types: types}
  end

  @doc false
  def memory_measurements(%{} = stats),
    do: Map.take(stats, [:active, :peak, :cache, :memory_limit, :cache_limit])
end
