if Code.ensure_loaded?(Nx) do
  defmodule Emily.NxCompiler do
    @moduledoc false
    # Shared by the compiler suites: jit through Emily.Compiler, and the native path's
    # fallback telemetry.
    import ExUnit.Assertions

    def ejit(fun, opts \\ []), do: Nx.Defn.jit(fun, [compiler: Emily.Compiler] ++ opts)

    # `fun.()` and the metadata of the `[:emily, :compiler, :evaluator_fallback]` events
    # it emitted (in this process: the handler sees every process's events, and other
    # tests run alongside).
    def with_fallbacks(fun) do
      ref = make_ref()
      name = inspect(ref)

      :telemetry.attach(
        name,
        [:emily, :compiler, :evaluator_fallback],
        &__MODULE__.forward/4,
        {self(), ref}
      )

      try do
        result = fun.()
        {result, collect(ref, [])}
      after
        :telemetry.detach(name)
      end
    end

    # `fun` on the native path, without and with mx::compile: the two results, after
    # asserting the graph was lowered, or declined for a debug flag compiled in.
    def native_results(fun, args) do
      for compile <- [false, true] do
        {out, fallbacks} =
          with_fallbacks(fn -> apply(ejit(fun, native: true, compile: compile), args) end)

        assert debug_fallbacks?(fallbacks), "native path fell back: #{inspect(fallbacks)}"
        out
      end
    end

    # Whether every fallback is the native path declining what a compiled-in debug flag
    # checks on the host (Emily.Debug): conditionals and host steps under
    # :debug_detect_nan_inf, indexing under :debug_bounds_check.
    def debug_fallbacks?(fallbacks) do
      Enum.all?(fallbacks, fn
        %{reason: {_, :debug_detect_nan_inf}} -> Emily.Debug.detect_nan_inf?()
        %{reason: {:debug_bounds_check, _}} -> Emily.Debug.bounds_check?()
        _ -> false
      end)
    end

    def forward(_event, _measurements, meta, {pid, ref}) when pid == self(),
      do: send(pid, {ref, meta})

    def forward(_event, _measurements, _meta, _config), do: :ok

    defp collect(ref, acc) do
      receive do
        {^ref, meta} -> collect(ref, [meta | acc])
      after
        0 -> Enum.reverse(acc)
      end
    end
  end
end
