if Code.ensure_loaded?(Nx) do
  defmodule Emily.Compiler.Native.Control do
    @moduledoc false
    # The structure of an `Nx.Defn.Expr` graph, lowered to straight-line instructions
    # (see Emily.Compiler.Native): `while` loops unrolled, `cond` decided or selected,
    # blocks without a kernel lowered as their default, the elements of their tuple
    # results, and what must run on the host handed to Emily.Compiler.Native.Plan.

    alias Nx.Defn.{Composite, Expr}
    alias Nx.Tensor, as: T
    alias Emily.Compiler.Native.Hooks

    import Emily.Compiler.Native,
      only: [lower_node: 2, emit: 3, operand: 3, constant_value: 2, flat: 1]

    # The most passes of a `while` the lowering unrolls, and the most instructions its
    # passes may emit: a longer loop runs on the host (as one whose condition reads an
    # input), one program call per pass, rather than making a program whose lowering
    # and size grow with its passes.
    @max_passes 1024
    @max_unrolled 4096

    # The MLX ops that raise on some values (LAPACK's: a singular or indefinite matrix).
    @lapack [:inv, :tri_inv, :pinv, :cholesky, :cholesky_inv, :lu, :lu_factor, :solve] ++
              [:solve_triangular, :qr, :svd, :svdvals, :eigh, :eigvalsh, :eig, :eigvals] ++
              [:det, :slogdet]

    # What calls an Elixir function on the host: runtime calls, and hooks (each Nx
    # release's nodes for them: Emily.Compiler.Native.Hooks) unless inert.
    @hooks Hooks.ops()
    @calls [:runtime_call | @hooks]

    # Linear algebra that Emily.Compiler.Native.Ops does not lower runs on the host, as
    # Emily.Backend computes it (LAPACK, on a CPU stream), between the programs before
    # and after it: Nx's own algorithms, unrolled, would make programs of thousands of
    # instructions, and loops that read their input.
    @linalg [
      Nx.Block.LinAlg.Cholesky,
      Nx.Block.LinAlg.Solve,
      Nx.Block.LinAlg.QR,
      Nx.Block.LinAlg.Eigh,
      Nx.Block.LinAlg.SVD,
      Nx.Block.LinAlg.LU,
      Nx.Block.LinAlg.Determinant
    ]

    # The ops lowered to a list of slots: loops, conditionals, and what runs on the host
    # (Emily.Compiler.Native.Plan): hooks, runtime calls, and the linear algebra above,
    # outside unrolled loops, conditionals and blocks.
    defguardp listed(op) when op in [:while, :cond, :triangular_solve] or op in @calls

    @doc false
    # Such an op's one result, or an element of its tuple.
    def lower_op(op, _args, t, st) when listed(op), do: only(t, st)
    def lower_op(:block, [%struct{} | _], t, st) when struct in @linalg, do: only(t, st)

    def lower_op(:elem, [%T{data: %Expr{op: op}} = node, i], _t, st) when listed(op),
      do: nth(node, i, st)

    # A value a token is attached to (Nx 0.12): the token's hooks run first, on the host
    # unless inert; the plan hands the value over with the step's results (Native.Plan).
    def lower_op(:attach_token, [token, expr], _t, st) do
      {[], st} = slots(token, st)
      lower_node(expr, st)
    end

    def lower_op(:elem, [%T{data: %Expr{op: :block, args: [%struct{} | _]}} = node, i], _t, st)
        when struct in @linalg,
        do: nth(node, i, st)

    # A block without a kernel (see Emily.Compiler.Native.Ops): its default
    # implementation (Nx's own, built of other ops), as Emily.Backend runs it.
    def lower_op(:block, [_block, _in_args, %T{}, _fun], t, st) do
      {default, st} = block_default(t, st)
      nested(st, &lower_node(default, &1))
    end

    # An element of a block's tuple result: that element of its default.
    def lower_op(:elem, [%T{data: %Expr{op: :block}} = block, i], _t, st) do
      {default, st} = block_default(block, st)
      nested(st, &lower_node(elem(default, i), &1))
    end

    # An element of a tuple wrapped in metadata (a custom gradient, say): that element.
    def lower_op(:elem, [%T{data: %Expr{op: :metadata, args: [tuple, _meta]}}, i], _t, st)
        when is_tuple(tuple),
        do: lower_node(elem(tuple, i), st)

    # Otherwise a tuple's element comes from an op not lowered.
    def lower_op(:elem, [%T{data: %Expr{op: op}} | _], _t, _st),
      do: throw({:unsupported, {:op, op}})

    def lower_op(op, _args, _t, _st), do: throw({:unsupported, {:op, op}})

    @doc false
    # A block Emily.Compiler.Native.Ops sends to the host (Emily.Compiler.Native.Plan
    # runs it through Emily.Backend, as the linear algebra above).
    def host_block(%T{data: %Expr{op: :block}} = t, st), do: only(t, st)

    defp only(t, st) do
      {[slot], st} = slots(t, st)
      {slot, st}
    end

    defp nth(node, i, st) do
      {slots, st} = slots(node, st)
      {Enum.at(slots, i), st}
    end

    defp slots(%T{data: %Expr{op: :while}} = loop, st), do: unrolled(loop, st)
    defp slots(%T{data: %Expr{op: :cond}} = c, st), do: cond_results(c, st)
    defp slots(%T{data: %Expr{op: op}} = t, st) when op in @hooks, do: hook(t, st)
    defp slots(t, st), do: on_host(t, st)

    # An inert hook is worth its data (a token, nothing); any other runs on the host.
    defp hook(%T{data: %Expr{op: op, args: args}} = t, st) do
      case Hooks.step(t, st.hooks) do
        :inert when op == :token -> {[], st}
        :inert -> Enum.map_reduce(Composite.flatten_list([hd(args)]), st, &lower_node/2)
        {:step, _} -> on_host(t, st)
      end
    end

    # A `while` whose condition reads no input (a loop over a range or a tensor's
    # elements, Nx.Random's rounds) runs a number of times known here: it is unrolled,
    # its condition computed before each pass, now, from the constants it is made of.
    # The final state's slots, once per node (and per pass of an enclosing loop).
    defp unrolled(%T{data: %Expr{id: id, args: [initial, arg, condition, body]}} = loop, st) do
      case st.results do
        %{^id => slots} ->
          {slots, st}

        _ ->
          {state, st} = Enum.map_reduce(flat(initial), st, &lower_node/2)
          {state, st} = unroll(loop, flat(arg), condition, flat(body), state, st, {0, st.next})
          {state, %{st | results: Map.put(st.results, id, state)}}
      end
    end

    defp unroll(loop, params, condition, body, state, st, {passes, start}) do
      # What is lowered for one pass (its nodes, inner loops) holds for that pass only.
      outer = Map.take(st, [:memo, :results, :nested])
      bound = Enum.zip(params, state) |> Map.new(fn {p, slot} -> {p.data.id, slot} end)
      st = %{st | memo: Map.merge(st.memo, bound), nested: st.nested + 1}
      {pred, st} = lower_node(condition, st)

      if not MapSet.member?(st.const, pred), do: dynamic_while(loop, outer.nested)

      {value, st} = constant_value(pred, st)

      cond do
        Emily.to_list(value) == [0] ->
          {state, Map.merge(st, outer)}

        passes == @max_passes or st.next - start > @max_unrolled ->
          too_long(loop, outer.nested)

        true ->
          {state, st} = Enum.map_reduce(body, st, &lower_node/2)
          unroll(loop, params, condition, body, state, Map.merge(st, outer), {passes + 1, start})
      end
    end

    # A loop whose condition reads an input runs on the host (Emily.Compiler.Native.Plan),
    # where it is outside unrolled loops, conditionals and blocks; inside, its initial
    # state could read what only they bind, or a branch not taken could run it.
    defp dynamic_while(loop, 0), do: throw({:host, loop})

    defp dynamic_while(_loop, _nested),
      do: throw({:unsupported, {:while, :condition_reads_input}})

    defp too_long(loop, 0), do: throw({:host, loop})

    defp too_long(_loop, _nested),
      do: throw({:unsupported, {:while, {:unrolls_beyond, @max_passes, @max_unrolled}}})

    # The slots of what runs on the host (hooks, runtime calls, linear algebra): its
    # results, inputs of the program once the plan has the step (Native.Plan).
    defp on_host(%T{data: %Expr{id: id}} = t, st) do
      case st.results do
        %{^id => slots} -> {slots, st}
        _ -> host(t, st)
      end
    end

    # Otherwise the step is thrown for the plan to make: outside unrolled loops,
    # conditionals and blocks, or where Nx computes it outside every conditional (and so
    # before them, once); inside them, what is run on the host cannot be lowered.
    defp host(%T{} = t, %{nested: 0}), do: throw({:host, t})

    defp host(%T{data: %Expr{id: id}} = t, %{root: root}) when is_map_key(root, id),
      do: throw({:host, t})

    defp host(%T{data: %Expr{op: :block, args: [%struct{} | _]}}, _st),
      do: throw({:unsupported, {:block, struct}})

    defp host(%T{data: %Expr{op: op}}, _st), do: throw({:unsupported, {:op, op}})

    # A `cond`'s results, in the program (`chosen/3`); or, where its branches cannot all
    # be computed there, outside loops, conditionals and blocks, on the host (Native.Plan
    # reads the predicates, then runs the branch they choose).
    defp cond_results(%T{data: %Expr{id: id, args: [clauses, last]}} = t, st) do
      case st.results do
        %{^id => slots} ->
          {slots, st}

        _ when st.nested == 0 ->
          try do
            chosen(clauses, last, st)
          catch
            {:unsupported, _} -> throw({:host, t})
          end

        _ ->
          chosen(clauses, last, st)
      end
    end

    # A `cond`'s results: a clause whose predicate is computed from constants alone is
    # decided now; otherwise its branch and what follows are both computed and the
    # results selected (`where`). Branches hold no side effects (a hook in a branch is
    # not lowered), and MLX's ops other than LAPACK's do not fail on values, so computing
    # a branch not taken changes nothing but the time. Not lowered: such a `cond` whose
    # branches newly compute linear algebra, which raises on the values a branch guards
    # against (Nx.LinAlg.invert solves only when the determinant is not zero), and,
    # under :debug_detect_nan_inf, whose checks would see an untaken branch, any (both
    # then run on the host where they can: see cond_results/2).
    defp chosen([], last, st), do: Enum.map_reduce(flat(last), st, &lower_node/2)

    defp chosen([{pred, branch} | rest], last, st) do
      {p, st} = lower_node(pred, st)

      if MapSet.member?(st.const, p) do
        {value, st} = constant_value(p, st)

        if Emily.to_list(value) == [0],
          do: chosen(rest, last, st),
          else: Enum.map_reduce(flat(branch), st, &lower_node/2)
      else
        if Emily.Debug.detect_nan_inf?(),
          do: throw({:unsupported, {:cond, :debug_detect_nan_inf}})

        {p, st} = operand(pred, :bool, st)
        start = st.next

        {{taken, other}, st} =
          nested(st, fn st ->
            {taken, st} = Enum.map_reduce(flat(branch), st, &lower_node/2)
            {other, st} = chosen(rest, last, st)
            {{taken, other}, st}
          end)

        for slot <- start..(st.next - 1)//1,
            {op, _} = Map.fetch!(st.instr_at, slot),
            op in @lapack,
            do: throw({:unsupported, {:cond, {:branch_computes, op}}})

        Enum.zip(taken, other)
        |> Enum.map_reduce(st, fn {a, b}, st -> emit(st, :where, [p, a, b]) end)
      end
    end

    # `fun.(st)` one level inside a loop, a conditional or a block (see dynamic_while/2).
    defp nested(st, fun) do
      {result, inner} = fun.(%{st | nested: st.nested + 1})
      {result, %{inner | nested: st.nested}}
    end

    # The default Nx traced for the block node `block`, its parameters (found by
    # Emily.Compiler.Native's collect/2) bound to the slots of the block's tensor
    # arguments.
    defp block_default(%T{data: %Expr{id: id, args: [_block, in_args, default, _fun]}}, st) do
      inputs = Enum.take_while(in_args, &(not is_list(&1)))
      {slots, st} = Enum.map_reduce(inputs, st, &lower_node/2)
      slots = List.to_tuple(slots)

      # (A block the graph's walk did not reach cannot be bound: not lowered.)
      params = Map.get(st.defaults, id) || throw({:unsupported, {:op, :block}})
      bound = Map.new(params, fn {param, pos} -> {param, elem(slots, pos)} end)

      {default, %{st | memo: Map.merge(st.memo, bound)}}
    end
  end
end
