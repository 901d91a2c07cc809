if Code.ensure_loaded?(Nx) do
  defmodule Emily.Compiler.Native.Hooks do
    @moduledoc false
    # Hooks (`hook`, `io_call`, `print_value`, tokens, Nx.Serving's streaming) as each Nx
    # release writes them, in one form for the lowering (Emily.Compiler.Native.Control)
    # and the plan (Emily.Compiler.Native.Plan):
    #
    #   * Nx 0.12: a `:token` node holding an `Nx.Defn.Token` (its hooks, `%{expr, name,
    #     callback}`, last declared first), and an `:attach_token` node per leaf of the
    #     value the token was attached to (`[token, expr]`, worth `expr`);
    #   * Nx 0.13: a `:hook` node, `[data, spec, template, ref]`, worth `data`, the spec
    #     `{:named, name, fun | nil}`, `{:fn, fun}` or, for a token's hook, `{:token_hook,
    #     watched, spec}` (the callback gets `watched`, the node is still worth `data`);
    #   * later Nx: an `:io_call` node, laid out as `:hook`.
    #
    # Each is either inert (no callback, given in `:hooks` or its own, and none in what
    # it would compute: it is worth its data, nothing runs on the host, as the evaluator
    # skips it) or a step: the callbacks to call on the host, each with the container it
    # watches, in the order Nx.Defn.Evaluator calls them.

    alias Nx.Defn.{Composite, Expr, Tree}
    alias Nx.Tensor, as: T

    @ops [:io_call, :hook, :token]

    @doc false
    def ops, do: @ops

    @doc false
    # `:inert`, or `{:step, [{watched, callback | nil}]}` (a `nil` callback: the watched
    # value is computed for the hooks inside it).
    def step(%T{data: %Expr{op: :token, args: [%{hooks: hooks}]}}, given) do
      hooks
      |> Enum.reverse()
      |> Enum.flat_map(fn %{expr: expr, name: name, callback: callback} ->
        callback = given[name] || callback

        cond do
          callback -> [{expr, callback}]
          fires?(expr, given) -> [{expr, nil}]
          true -> []
        end
      end)
      |> case do
        [] -> :inert
        watched -> {:step, watched}
      end
    end

    def step(%T{data: %Expr{op: op, args: [data, spec | _]}}, given) when op in @ops do
      case spec do
        {:token_hook, watched, spec} ->
          callback = callback(spec, given)

          cond do
            callback -> {:step, [{watched, callback}]}
            fires?(watched, given) -> {:step, [{watched, nil}]}
            true -> :inert
          end

        spec ->
          if callback = callback(spec, given), do: {:step, [{data, callback}]}, else: :inert
      end
    end

    defp callback({:fn, fun}, _given), do: fun
    defp callback({:named, name, fun}, given), do: given[name] || fun

    # Whether a hook in `container` would call something (each node visited once).
    defp fires?(container, given) do
      Composite.reduce(container, %{}, &visit(&1, &2, given))
      false
    catch
      :fires -> true
    end

    defp visit(%T{data: %Expr{id: id, op: op}} = t, seen, given) do
      cond do
        Map.has_key?(seen, id) ->
          seen

        op in @ops and step(t, given) != :inert ->
          throw(:fires)

        true ->
          {_, seen} =
            Tree.apply_args(t, :all, Map.put(seen, id, true), &{&1, visit(&1, &2, given)})

          seen
      end
    end

    defp visit(_other, seen, _given), do: seen
  end
end
