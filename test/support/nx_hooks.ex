if Code.ensure_loaded?(Nx) do
  defmodule Emily.NxHooks do
    @moduledoc false
    # Hooks as the Nx release at hand spells them, so that the suites compile against
    # each: `io_call/2` where it exists (later Nx), `hook/2` otherwise (Nx 0.12 and
    # 0.13, whose `io_call` is undefined). Called from defn as `Emily.NxHooks.named/2`.
    import Nx.Defn

    Code.ensure_loaded!(Nx.Defn.Kernel)

    if function_exported?(Nx.Defn.Kernel, :io_call, 2) do
      deftransform(named(data, name), do: Nx.Defn.Kernel.io_call(data, name))
    else
      deftransform(named(data, name), do: Nx.Defn.Kernel.hook(data, name))
    end

    @doc false
    # Whether this Nx has defn tokens (`create_token/0`, `hook_token/3`, `attach_token/2`):
    # Nx 0.12 and 0.13 (which deprecates them), not later.
    def tokens?, do: function_exported?(Nx.Defn.Kernel, :create_token, 0)

    if function_exported?(Nx.Defn.Kernel, :create_token, 0) do
      # Called from defn through these transforms, which name the function at run time,
      # so that compiling the suite on 0.13 warns of nothing.
      deftransform(create_token(), do: kernel(:create_token, []))
      deftransform(hook_token(token, expr, name), do: kernel(:hook_token, [token, expr, name]))
      deftransform(attach_token(token, expr), do: kernel(:attach_token, [token, expr]))

      defp kernel(fun, args), do: apply(Nx.Defn.Kernel, fun, args)
    end
  end
end
