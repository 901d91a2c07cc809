if Code.ensure_loaded?(Nx) do
  defmodule Emily.Compiler.Native.Plan do
    @moduledoc false
    # The programs a graph lowers to (Emily.Compiler.Native) and what runs between them
    # on the host: a `while` whose condition reads an input (or too long to unroll), a
    # `cond` whose branches a program cannot both compute, the calls into Elixir
    # (`io_call`, `runtime_call`), and the linear algebra Emily.Backend computes. Most
    # graphs are one program.
    #
    # A plan is `{:program, program, extras}` (extras: the Emily tensors passed after
    # the inputs, the captured tensors, then the folded constants), or, around a host
    # step, the plan of what the step reads, the step, and the plan of the graph with
    # the step's results as more inputs (`{:loop, ...}`, `{:cond, ...}`, `{:call,
    # ...}`). The plan of the graph computes again what it shares with the plans before
    # the step, other than the step's results (a value used both before and after a
    # loop, say).

    alias Nx.Defn.{Composite, Expr, Tree}
    alias Nx.Tensor, as: T
    alias Emily.Compiler.Native.Hooks

    import Emily.Compiler.Native, only: [lowering: 3, flat: 1, vectorized?: 1]

    @hooks Hooks.ops()

    @doc false
    # Runs `plan` on `inputs` (the parameters' arrays) on `stream`: its outputs.
    def run({:program, program, extras}, inputs, stream),
      do: Emily.Program.eval(program, inputs ++ extras, stream: stream)

    def run({:pass, program, extras, layout}, inputs, stream) do
      inputs = inputs ++ extras
      placed(layout, List.to_tuple(inputs), Emily.Program.eval(program, inputs, stream: stream))
    end

    def run({:loop, initial, condition, step, rest}, inputs, stream) do
      state = run(initial, inputs, stream)
      [pred] = run(condition, state, stream)
      run(rest, inputs ++ repeat(pred, condition, step, state, false, stream), stream)
    end

    def run({:cond, predicates, branches, rest}, inputs, stream) do
      values = run(predicates, inputs, stream)
      i = Enum.find_index(values, &(hd(Emily.to_list(&1)) != 0)) || length(values)
      run(rest, inputs ++ run(Enum.at(branches, i), inputs, stream), stream)
    end

    def run({:call, data, call, rest}, inputs, stream) do
      results = call.(run(data, inputs, stream), stream)
      run(rest, inputs ++ results, stream)
    end

    # A pass that is one program with no host step has no effects, so the next pass is
    # queued before this one's condition is read (as mlx-lm queues a token's step before
    # it reads the last token): the device computes pass n + 1 while the host waits for
    # and reads condition n, and the host builds pass n + 2 while the device computes.
    # The pass queued after the last one is dropped unread; it costs one pass's time
    # and the memory of one more state.
    #
    # `dead` are the state's leaves that the pass computes anew and that nothing after
    # the loop reads (a generation loop's key/value cache). Once a pass's graph is built,
    # the state it read holds them only for that graph: they are released (`owned`: the
    # state is a pass's own outputs, not the initial state, which may hold the caller's
    # tensors), so that MLX updates them in place (the cache's `put_slice` without a copy
    # of the cache). The state the loop ends with takes them from the pass dropped unread.
    defp repeat(
           pred,
           _condition,
           {:queued, {:pass, program, extras, layout}, dead} = step,
           state,
           owned,
           stream
         ) do
      inputs = state ++ extras
      computed = Emily.Program.run(program, inputs, stream: stream)
      read = List.to_tuple(inputs)
      if owned, do: Enum.each(dead, &Emily.release(elem(read, &1)))
      Emily.async_eval(computed)
      next = placed(layout, read, computed)

      cond do
        Emily.to_list(pred) != [0] ->
          {state, [pred]} = Enum.split(next, -1)
          repeat(pred, nil, step, state, true, stream)

        owned ->
          Enum.reduce(dead, state, &List.replace_at(&2, &1, Enum.at(next, &1)))

        true ->
          state
      end
    end

    defp repeat(pred, condition, step, state, owned, stream) do
      if Emily.to_list(pred) == [0] do
        state
      else
        {state, pred} = advance(step, condition, state, stream)
        repeat(pred, condition, step, state, owned, stream)
      end
    end

    # A pass's outputs in order: its computed ones, and the inputs it passes through.
    defp placed([], _inputs, []), do: []

    defp placed([{:input, i} | rest], inputs, outs),
      do: [elem(inputs, i) | placed(rest, inputs, outs)]

    defp placed([:computed | rest], inputs, [out | outs]), do: [out | placed(rest, inputs, outs)]

    # One pass: the next state, and the condition's value on it.
    defp advance({:fused, plan}, _condition, state, stream) do
      {state, [pred]} = Enum.split(run(plan, state, stream), -1)
      {state, pred}
    end

    defp advance({:body, plan}, condition, state, stream) do
      state = run(plan, state, stream)
      [pred] = run(condition, state, stream)
      {state, pred}
    end

    @doc false
    # The plan of `result` (traced from `vars`), and the lowering of its last program
    # (template and checks). `hosted` are the host steps whose results are inputs
    # already, in order, after the parameters: `{node, number of results}`.
    def plan(vars, result, opts, hosted) do
      lowered = lowering(vars, result, Keyword.put(opts, :hosted, hosted))
      {{:program, program(lowered, opts), lowered.extras}, lowered}
    catch
      {:host, node} ->
        if Emily.Debug.detect_nan_inf?(),
          do: throw({:unsupported, {node.data.op, :debug_detect_nan_inf}})

        # (The host calls Elixir with tensors made from templates: not vectorized ones.)
        if node.data.op not in [:while, :cond] and vectorized?(host_args(node)),
          do: throw({:unsupported, {node.data.op, :vectorized}})

        host(node, %{vars: vars, result: result, opts: opts, hosted: hosted})
    end

    # The arguments of a host step, a token's hooks' values among them.
    defp host_args(%T{data: %Expr{op: :token, args: [%{hooks: hooks}]}}),
      do: Enum.map(hooks, & &1.expr)

    defp host_args(%T{data: %Expr{args: args}}), do: args

    # A `while` whose condition reads an input: `{:loop, initial, condition, step,
    # rest}`, the plans of its initial state, of its condition (over its state), of a
    # pass, and of the rest. The condition's program runs once on the initial state;
    # then each pass is one program, the body and the condition on the state it makes
    # (`{:fused, plan}`), or, where the body has host steps of its own, the body's plan
    # and then the condition's (`{:body, plan}`); the host reads the condition's value.
    defp host(%T{data: %Expr{op: :while, args: [initial, arg, condition, body]}} = loop, at) do
      {initial_plan, _} = plan(at.vars, initial, at.opts, at.hosted)
      {condition_plan, _} = plan([arg], condition, at.opts, [])
      step = step(arg, condition, body, at.opts)
      hosted = at.hosted ++ [{loop, length(flat(initial))}]
      {rest, lowered} = plan(at.vars, at.result, at.opts, hosted)

      {{:loop, initial_plan, condition_plan, dead(step, read_leaves(at.result, loop)), rest},
       lowered}
    end

    # A `cond` whose branches a program cannot compute both of (Native.Control):
    # `{:cond, predicates, branches, rest}`, the plans of its predicates, of each
    # branch (the last one's when no predicate holds) and of the rest.
    defp host(%T{data: %Expr{op: :cond, args: [clauses, last]}} = node, at) do
      {predicates, branches} = Enum.unzip(clauses)
      {predicates, _} = plan(at.vars, List.to_tuple(predicates), at.opts, at.hosted)
      branches = for b <- branches ++ [last], do: elem(plan(at.vars, b, at.opts, at.hosted), 0)
      hosted = at.hosted ++ [{node, length(flat(last))}]
      {rest, lowered} = plan(at.vars, at.result, at.opts, hosted)
      {{:cond, predicates, branches, rest}, lowered}
    end

    # A hook (`hook`, `io_call`, `print_value`, Nx.Serving's streaming, a token's hooks:
    # Emily.Compiler.Native.Hooks): its callbacks (the `:hooks` given for their names,
    # else their own), in order, each with what it watches as Nx tensors; the rest reads
    # the hook's data, or, for a token, the values it is attached to, handed over.
    defp host(%T{data: %Expr{op: op, args: args}} = node, at) when op in @hooks do
      {:step, watched} = Hooks.step(node, at.opts[:hooks] || %{})

      {passed, hosted} =
        case op do
          :token -> attached(at.result, node)
          _ -> {hd(args), [{node, count(hd(args))}]}
        end

      # (Templates, not the graph, in the call: see runtime_call below.)
      specs =
        for {container, callback} <- watched,
            do: {Composite.traverse(container, &Nx.to_template/1), count(container), callback}

      call = fn refs, stream ->
        Enum.reduce(specs, refs, fn {template, n, callback}, refs ->
          {these, refs} = Enum.split(refs, n)
          if callback, do: callback.(tensors(template, these, stream))
          refs
        end)
      end

      data = {List.to_tuple(Enum.map(watched, &elem(&1, 0))), passed}
      call(data, call, hosted, at)
    end

    # A `runtime_call`: its function called with the data as Nx tensors; its results
    # (on the stream's device) are the rest's inputs.
    defp host(%T{data: %Expr{op: :runtime_call, args: [data, fun, template, opts]}} = node, at) do
      # (Templates, not the graph: a plan is kept in a table, which copies it flattened.)
      inputs = Composite.traverse(data, &Nx.to_template/1)

      call = fn refs, stream ->
        out = fun.(tensors(inputs, refs, stream), opts)

        if not Nx.compatible?(template, out),
          do: raise("expected the runtime_call function to match the given output template")

        Enum.map(Composite.flatten_list([out]), &ref(&1, stream))
      end

      call(data, call, [{node, count(template)}], at)
    end

    # Linear algebra the programs do not hold (Emily.Compiler.Native.Control): computed
    # by Emily.Backend, as on the evaluator path, on the run's stream.
    defp host(%T{data: %Expr{op: :block, args: [struct, in_args, default, fun]}} = node, at) do
      {inputs, options} = Enum.split_while(in_args, &(not is_list(&1)))
      templates = Enum.map(inputs, &Nx.to_template/1)

      out =
        case node.type do
          {:tuple, _} -> Composite.traverse(default, &Nx.to_template/1)
          _ -> Nx.to_template(node)
        end

      call = fn refs, stream ->
        args = Tuple.to_list(tensors(List.to_tuple(templates), refs, stream)) ++ options
        eagerly(stream, fn -> Emily.Backend.block(struct, out, args, fun) end)
      end

      call(List.to_tuple(inputs), call, [{node, count(out)}], at)
    end

    defp host(%T{data: %Expr{op: :triangular_solve, args: [a, b, opts]}} = node, at) do
      templates = {Nx.to_template(a), Nx.to_template(b)}
      out = Nx.to_template(node)

      call = fn refs, stream ->
        {a, b} = tensors(templates, refs, stream)
        eagerly(stream, fn -> Emily.Backend.triangular_solve(out, a, b, opts) end)
      end

      call({a, b}, call, [{node, 1}], at)
    end

    # `fun`'s results' arrays, `fun` run with Emily.Backend (on `stream`) as the default
    # backend, as the evaluator path runs an op.
    defp eagerly(stream, fun) do
      backend = {Emily.Backend, device: Emily.Stream.device(stream)}
      out = Emily.Stream.with_stream(stream, fn -> Nx.with_default_backend(backend, fun) end)
      Enum.map(Composite.flatten_list([out]), &ref(&1, stream))
    end

    # A pass of a loop that runs on the host (see host/2).
    defp step(arg, condition, body, opts) do
      then = {flat(arg), condition}

      lowered =
        lowering([arg], body, opts |> Keyword.put(:hosted, []) |> Keyword.put(:then, then))

      plan = pass(lowered, opts)
      if Keyword.get(opts, :overlap, true), do: {:queued, plan}, else: {:fused, plan}
    catch
      {:host, _} -> {:body, elem(plan([arg], body, opts, []), 0)}
    end

    # A pass's program, `{:pass, program, extras, layout}`, returning only the outputs it
    # computes: the state a loop's body hands on unchanged (Bumblebee's generation loop
    # carries the model's parameters through every pass) is its inputs, which the host
    # puts back in their places (`layout`, per output `:computed` or `{:input, i}`)
    # rather than the program making a handle for each of them on every pass.
    defp pass(lowered, opts) do
      n = lowered.inputs
      # (A program has an output: one that computes none returns what it passes on.)
      computes? = Enum.any?(lowered.outputs, &(&1 >= n))
      passed? = &(computes? and &1 < n)
      layout = Enum.map(lowered.outputs, &if(passed?.(&1), do: {:input, &1}, else: :computed))
      computed = Enum.reject(lowered.outputs, passed?)
      {:pass, program(%{lowered | outputs: computed}, opts), lowered.extras, layout}
    end

    # A queued pass with the leaves of the state it computes that the rest does not read
    # (see repeat/6).
    defp dead({:queued, {:pass, _, _, layout} = pass}, read) do
      state = Enum.drop(layout, -1)

      dead =
        for {:computed, i} <- Enum.with_index(state),
            read != :all and not MapSet.member?(read, i),
            do: i

      {:queued, pass, dead}
    end

    defp dead(step, _read), do: step

    # The positions of `loop`'s state leaves that `result` reads, or `:all` where it
    # reads the state whole.
    defp read_leaves(result, %T{data: %Expr{id: loop}}) do
      {_, {read, _}} = Composite.traverse(result, {MapSet.new(), %{}}, &read_in(&1, &2, loop))
      read
    end

    defp read_in(%T{data: %Expr{id: id, op: op, args: args}} = t, {read, seen} = acc, loop) do
      cond do
        read == :all or Map.has_key?(seen, id) ->
          {t, acc}

        id == loop ->
          {t, {:all, seen}}

        op == :elem and match?([%T{data: %Expr{id: ^loop}}, _], args) ->
          {t, {MapSet.put(read, List.last(args)), Map.put(seen, id, true)}}

        true ->
          {_, acc} =
            Tree.apply_args(t, :all, {read, Map.put(seen, id, true)}, &read_in(&1, &2, loop))

          {t, acc}
      end
    end

    defp read_in(other, acc, _loop), do: {other, acc}

    # `{:call, data, call, rest}`: the plan of the data, the call, the plan of the rest,
    # which has the call's results as inputs (`hosted`: see Native.lowering/3).
    defp call(data, call, hosted, at) do
      {data, _} = plan(at.vars, data, at.opts, at.hosted)
      {rest, lowered} = plan(at.vars, at.result, at.opts, at.hosted ++ hosted)
      {{:call, data, call, rest}, lowered}
    end

    defp count(container), do: length(Composite.flatten_list([container]))

    # The values `token` is attached to in `result` (Nx 0.12's `:attach_token` nodes, one
    # per leaf of each value it was attached to), each once, found without entering loop
    # bodies, blocks' defaults or functions: `{values, hosted}`, the token's step
    # handing them over to the rest (and the token itself, with no results of its own).
    defp attached(result, %T{data: %Expr{id: token}} = node) do
      {_, {values, _}} =
        Composite.traverse(result, {[], %{}}, &attached_in(&1, &2, token))

      values = values |> Enum.reverse() |> Enum.uniq_by(& &1.data.id)
      {List.to_tuple(values), [{node, 0} | Enum.map(values, &{:value, &1})]}
    end

    defp attached_in(%T{data: %Expr{id: id, op: op, args: args}} = t, {values, seen}, token) do
      cond do
        Map.has_key?(seen, id) ->
          {t, {values, seen}}

        op == :attach_token and match?([%T{data: %Expr{id: ^token}}, _], args) ->
          {t, {[List.last(args) | values], Map.put(seen, id, true)}}

        true ->
          {_, acc} =
            Tree.apply_args(
              t,
              :scope,
              {values, Map.put(seen, id, true)},
              &attached_in(&1, &2, token)
            )

          {t, acc}
      end
    end

    defp attached_in(other, acc, _token), do: {other, acc}

    defp program(lowered, opts) do
      Emily.Program.new(lowered.instrs,
        inputs: lowered.inputs,
        outputs: lowered.outputs,
        compile: Keyword.get(opts, :compile, false)
      )
    end

    # `template`'s leaves as Emily tensors of `refs` on `stream`.
    defp tensors(template, refs, stream) do
      {container, []} =
        Composite.traverse(template, refs, fn
          %T{} = t, [ref | rest] -> {%{t | data: %Emily.Backend{ref: ref, stream: stream}}, rest}
          other, refs -> {other, refs}
        end)

      container
    end

    defp ref(%T{data: %Emily.Backend{ref: ref}}, _stream), do: ref

    defp ref(%T{} = t, stream),
      do: Nx.backend_copy(t, {Emily.Backend, device: Emily.Stream.device(stream)}).data.ref
  end
end
