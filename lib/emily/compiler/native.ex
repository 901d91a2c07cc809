if Code.ensure_loaded?(Nx) do
  defmodule Emily.Compiler.Native do
    @moduledoc false
    # The native path of Emily.Compiler: an `Nx.Defn.Expr` graph lowered once into one
    # `Emily.Program` (instructions over the op table), replayed per run in one native
    # call (or a few, around what runs on the host: Emily.Compiler.Native.Plan).
    # `lower/3` throws `{:unsupported, reason}` on anything outside what it knows; the
    # compiler then runs the whole graph on the evaluator path.
    #
    # Each node is lowered with the same casts Emily.Backend applies eagerly (operands
    # cast to the node's type, comparisons in the merged type then cast to u8), so both
    # paths compute the same MLX ops.
    #
    # Each distinct instruction is emitted once (`emit/3`): nodes the Nx graph does not
    # share but that compute the same thing (the same cast of a slot wanted by several
    # ops, `x - mean` written twice, broadcasts of one constant) reuse the first slot.
    #
    # This module holds the walk (`lower_node/2`, the lowering state, emitting, folding
    # constants); Native.Ops lowers each op, Native.Control loops, conditionals, blocks'
    # defaults and the calls into Elixir, Native.Plan splits a graph around what runs on
    # the host.

    alias Nx.Defn.{Composite, Expr, Tree}
    alias Nx.Tensor, as: T
    alias Emily.Backend.Storage
    alias Emily.Compiler.Native.{Fusion, Ops, Plan, Siblings}

    @doc false
    # Lowers `fun.(vars)`. Returns `{plan, output, checks, read}`: the plan (Native.Plan)
    # runs with `Native.Plan.run/3`, output is the result container of templates, checks
    # the `{op, template}` of each result whose count of non-finite values the plan
    # returns after the outputs (under :debug_detect_nan_inf; see `check_finite!/2`),
    # read what to pass for each parameter (see `read_params/3`). Throws
    # `{:unsupported, reason}`.
    def lower(vars, fun, opts) do
      # Tracing is the user's code: its errors are theirs. An error while lowering what
      # it traced is a graph the lowering does not know: the graph falls back, with the
      # error as its reason.
      result = fun.(vars)
      # So is a bad `:fuse`: it raises here, not as a graph to fall back on.
      _ = Fusion.enabled(opts)

      {plan, lowered} =
        try do
          Plan.plan(vars, result, opts, [])
        rescue
          e -> throw({:unsupported, {:lowering_failed, e.__struct__, Exception.message(e)}})
        end

      {plan, lowered.template, lowered.checks, read_params(vars, result, opts[:device])}
    end

    # For each parameter, `:read` if the graph reads it, else `{:unread, ref}`: an array
    # to pass in its place. A parameter the graph does not read is not asked for at run
    # time: its value may be lazy (an `Nx.LazyContainer`'s field), costly or raise, and
    # the evaluator does not ask for it either. A graph reads a parameter through a
    # `:parameter` node of its position (not necessarily the node `vars` holds: a graph
    # traced before, as Nx.Defn.Graph's stages, has its own), in the function's scope,
    # blocks' defaults included (their other parameters would read the function's too).
    defp read_params(vars, result, device) do
      read = read_positions(Composite.flatten_list([result]), %{}, MapSet.new())
      positions = Enum.to_list(0..(length(Composite.flatten_list(vars)) - 1)//1)

      if Enum.all?(positions, &MapSet.member?(read, &1)) do
        Enum.map(positions, fn _ -> :read end)
      else
        filler = Nx.tensor(0, type: :u8, backend: {Emily.Backend, device: device}).data.ref
        Enum.map(positions, &if(MapSet.member?(read, &1), do: :read, else: {:unread, filler}))
      end
    end

    defp read_positions([], _seen, read), do: read

    defp read_positions([%T{data: %Expr{id: id, op: op, args: args}} = t | rest], seen, read) do
      cond do
        is_map_key(seen, id) ->
          read_positions(rest, seen, read)

        op == :parameter ->
          read_positions(rest, Map.put(seen, id, true), MapSet.put(read, hd(args)))

        true ->
          default = if op == :block, do: flat(Enum.at(args, 2)), else: []
          read_positions(children(t, :scope) ++ default ++ rest, Map.put(seen, id, true), read)
      end
    end

    defp read_positions([_ | rest], seen, read), do: read_positions(rest, seen, read)

    @doc false
    # Raises Emily.Error, as Emily.Backend's check would, if a count the program returned
    # for a checked result is not zero. `counts` are the program's outputs after the
    # result's.
    def check_finite!(counts, checks) do
      Enum.zip_with(counts, checks, fn count, {op, %T{shape: shape, type: type}} ->
        case Emily.to_list(count) do
          [0] -> :ok
          [n] -> Emily.Debug.nonfinite!(op, n, type, shape)
        end
      end)

      :ok
    end

    @doc false
    # What the native path lowers `fun` to for `args` (tensors or templates), without
    # running it: the `instructions/3` tuple, for tests and bench/defn.exs.
    def instructions_of(fun, args, opts \\ [device: :cpu]) do
      apply(Nx.Defn.jit(fun, compiler: __MODULE__.Lowering, lowering: opts), args)
    catch
      {:lowered, lowered} -> lowered
    end

    @doc false
    # The rewrites (Native.Fusion) the native path's lowering of `fun` for `args` makes,
    # in order, without running it; none where the graph falls back to the evaluator.
    def fusions(fun, args, opts) do
      opts = Keyword.put_new_lazy(opts, :device, &Emily.default_device/0)
      apply(Nx.Defn.jit(fun, compiler: __MODULE__.Lowering, lowering: {:fusions, opts}), args)
    catch
      {:fusions, fused} -> fused
    end

    defmodule Lowering do
      @moduledoc false
      # A defn compiler that only lowers, and throws the result out of the jit call.
      @behaviour Nx.Defn.Compiler

      @impl true
      def __jit__(_key, vars, fun, _args, opts) do
        case opts[:lowering] do
          {:fusions, lowering} ->
            {result, fused} =
              Emily.Compiler.Native.Fusion.collect(fn ->
                try do
                  Emily.Compiler.Native.lower(vars, fun, lowering)
                catch
                  {:unsupported, reason} -> {:unsupported, reason}
                end
              end)

            throw({:fusions, if(match?({:unsupported, _}, result), do: [], else: fused)})

          lowering ->
            throw({:lowered, Emily.Compiler.Native.instructions(vars, fun, lowering)})
        end
      end

      @impl true
      def __compile__(_key, _vars, _fun, _opts), do: raise("the lowering compiler only jits")
      @impl true
      def __partitions_options__(opts), do: [opts]
      @impl true
      def __to_backend__(_opts), do: {Nx.BinaryBackend, []}
    end

    @doc false
    # The lowering itself, before `Emily.Program.new/2`: `{instructions, inputs,
    # outputs, extras, template}` (bench/defn.exs hands it to its Python twin).
    def instructions(vars, fun, opts) do
      l = lowering(vars, fun.(vars), opts)
      {l.instrs, l.inputs, l.outputs, l.extras, l.template}
    end

    @doc false
    # `result` (traced from `vars`) lowered into one program's instructions. Its inputs:
    # the parameters, the results of `opts[:hosted]` (see Native.Plan), the captured
    # tensors, then the folded constants.
    def lowering(vars, result, opts) do
      device = Keyword.fetch!(opts, :device)
      flat_vars = Composite.flatten_list(vars)
      outputs = Composite.flatten_list([result])

      if Enum.any?(outputs, &(not match?(%T{data: %Expr{}}, &1))),
        do: throw({:unsupported, :output})

      # A host step's results: a node's (`{node, size}`: its slots), or a value it hands
      # over (`{:value, node}`: the node's one slot, as if lowered already).
      {hosted, params} =
        opts
        |> Keyword.get(:hosted, [])
        |> Enum.map_reduce(length(flat_vars), fn
          {:value, %T{data: %Expr{id: id}}}, n ->
            {{:value, id, n}, n + 1}

          {%T{data: %Expr{id: id}}, size}, n ->
            {{id, Enum.to_list(n..(n + size - 1)//1)}, n + size}
        end)

      {values, hosted} = Enum.split_with(hosted, &match?({:value, _, _}, &1))

      # `opts[:then]`: `{params, condition}`, the condition also lowered over the
      # outputs as the params (a loop's next pass), its value one more output.
      then = opts[:then]
      walked = if then, do: outputs ++ [elem(then, 1)], else: outputs

      known = MapSet.new(flat_vars, & &1.data.id)
      {_seen, tensors, defaults, _known} = collect(walked, {%{}, [], %{}, known})
      tensors = Enum.reverse(tensors)
      extra_slots = tensors |> Enum.with_index(params) |> Map.new(fn {t, i} -> {t.data.id, i} end)
      extras = Enum.map(tensors, &to_device(Nx.devectorize(hd(&1.data.args)), device))

      st = %{
        next: params + length(extras),
        instrs: [],
        memo: Enum.into(values, extra_slots, fn {:value, id, slot} -> {id, slot} end),
        emitted: %{},
        device: device,
        checks: [],
        defaults: defaults,
        results: Map.new(hosted),
        hooks: opts[:hooks] || %{},
        fuse: Fusion.enabled(opts),
        fused: [],
        dots: %{},
        nested: 0,
        instr_at: %{},
        const: MapSet.new(),
        values: %{},
        rope_tables: %{},
        # The nodes Nx computes outside any conditional (Nx.Defn.Tree.scope_ids/1): a
        # host step among them runs before the conditionals that read it.
        root: Nx.Defn.Tree.scope_ids(List.to_tuple(walked))
      }

      {slots, st} = Enum.map_reduce(outputs, st, &lower_node/2)
      {slots, st} = lower_then(then, slots, extra_slots, st)

      {template, []} =
        Composite.traverse(result, outputs, fn _, [t | rest] -> {Nx.to_template(t), rest} end)

      checks = Enum.reverse(st.checks)

      lowered = %{
        instrs: Enum.reverse(st.instrs),
        inputs: params + length(extras),
        outputs: slots ++ Enum.map(checks, &elem(&1, 0)),
        extras: Enum.map(extras, & &1.data.ref),
        template: template,
        checks: Enum.map(checks, fn {_slot, op, t} -> {op, t} end),
        device: device,
        dots: st.dots
      }

      {lowered, grouped} =
        lowered |> fold_constants(st) |> prune() |> Siblings.group(MapSet.member?(st.fuse, :dots))

      Fusion.report(Enum.reverse(st.fused) ++ grouped)
      Map.delete(lowered, :dots)
    end

    # The program without the instructions that no output reads, directly or through
    # others: a rewritten subgraph's or a collapsed view's leftovers. MLX would not
    # evaluate them, but each run would still build them.
    defp prune(%{instrs: instrs, inputs: n, outputs: outputs} = lowered) do
      indexed = Enum.with_index(instrs, n)

      needed =
        indexed
        |> Enum.reverse()
        |> Enum.reduce(MapSet.new(outputs), fn {instr, slot}, needed ->
          if MapSet.member?(needed, slot),
            do: MapSet.union(needed, MapSet.new(Emily.Program.input_slots(instr))),
            else: needed
        end)

      case Enum.split_with(indexed, fn {_, slot} -> MapSet.member?(needed, slot) end) do
        {_, []} ->
          lowered

        {kept, _} ->
          renumbered(lowered, kept, n, %{})
      end
    end

    # `lowered` with only the instructions `kept` (`{instr, slot}`, in order), whose
    # slots are numbered on from `first`; `index` holds the new numbers of other slots
    # (the folded values). An input keeps its number.
    defp renumbered(lowered, kept, first, index) do
      n = lowered.inputs
      index = kept |> Enum.with_index(first) |> Enum.into(index, fn {{_, s}, new} -> {s, new} end)
      renumber = fn slot -> if slot < n, do: slot, else: Map.fetch!(index, slot) end

      %{
        lowered
        | instrs: Enum.map(kept, fn {instr, _} -> Emily.Program.map_slots(instr, renumber) end),
          outputs: Enum.map(lowered.outputs, renumber),
          dots: for({s, v} <- lowered.dots, new = index[s], into: %{}, do: {new, v})
      }
    end

    # The condition over the outputs: a walk of its own, from only the captured tensors
    # and the outputs bound to the params (a node the outputs share with it holds
    # another value there).
    defp lower_then(nil, slots, _memo, st), do: {slots, st}

    defp lower_then({params, condition}, slots, memo, st) do
      bound = Enum.zip(params, slots) |> Map.new(fn {p, slot} -> {p.data.id, slot} end)
      outer = Map.take(st, [:memo, :results])
      {pred, st} = lower_node(condition, %{st | memo: Map.merge(memo, bound), results: %{}})
      {slots ++ [pred], Map.merge(st, outer)}
    end

    # Instructions that read no input, directly or through others (constants, iotas and
    # what is computed from them alone: `st.const`, kept by `emit/3`), give the same
    # values on every run. They run once, here (`constant_values/2`, which also computes
    # loop conditions and start indices, and keeps what it computed), and the program
    # reads each value it needs as one more input (an evaluated array, as Python MLX's
    # scalar operands are): left in, each would cost every run a step of MLX's
    # evaluation, a hand-off to the stream's thread. A value over @max_folded bytes is
    # not kept (the compiled function would hold it): the instruction stays in the
    # program, reading the folded values it needs. The lowering emits one slot per
    # instruction. If MLX rejects the constant part, nothing is folded, so that the
    # error comes from the run, naming its instruction.
    @max_folded 1_048_576

    defp fold_constants(lowered, st, kept \\ MapSet.new()) do
      %{instrs: instrs, inputs: n, outputs: outputs} = lowered
      const = MapSet.difference(st.const, kept)
      {folded, live} = instrs |> Enum.with_index(n) |> Enum.split_with(&(elem(&1, 1) in const))

      needed =
        live
        |> Enum.flat_map(fn {instr, _slot} -> Emily.Program.input_slots(instr) end)
        |> Enum.concat(outputs)
        |> Enum.filter(&(&1 in const))
        |> Enum.uniq()

      with [_ | _] <- folded,
           {:ok, values, st} <- folded_values(needed, st) do
        case for {slot, v} <- Enum.zip(needed, values), Emily.nbytes(v) > @max_folded, do: slot do
          [] -> refold(lowered, live, needed, values)
          big -> fold_constants(lowered, st, MapSet.union(kept, MapSet.new(big)))
        end
      else
        _ -> lowered
      end
    end

    defp folded_values(needed, st) do
      {values, st} = constant_values(needed, st)
      {:ok, values, st}
    catch
      {:unsupported, {:folding, _}} -> :error
    end

    # The program without the folded instructions: inputs, then the folded values it
    # reads, then its own instructions' slots.
    defp refold(lowered, live, needed, values) do
      n = lowered.inputs
      folded = needed |> Enum.with_index(n) |> Map.new()

      %{
        renumbered(lowered, live, n + length(needed), folded)
        | inputs: n + length(needed),
          extras: lowered.extras ++ values
      }
    end

    defp to_device(%T{data: %Emily.Backend{}} = t, _device), do: t
    defp to_device(%T{} = t, device), do: Nx.backend_copy(t, {Emily.Backend, device: device})

    # One walk of the graph, loop bodies and blocks' defaults included: its `:tensor`
    # nodes (captured tensors), last seen first, and the parameters of each block's
    # default, `%{param_id => position}` by the block's id (see block_params/4). `known`
    # holds the parameters found so far: the function's, loops' and blocks'.
    defp collect([], acc), do: acc

    defp collect([%T{data: %Expr{id: id, op: op, args: args}} = t | rest], acc) do
      {seen, tensors, defaults, known} = acc

      acc =
        cond do
          Map.has_key?(seen, id) ->
            acc

          op == :tensor ->
            {Map.put(seen, id, true), [t | tensors], defaults, known}

          op == :block ->
            [_block, in_args, default, _fun] = args
            params = block_params(flat(default), known, %{}, %{})
            known = Enum.into(Map.keys(params), known)
            acc = {Map.put(seen, id, true), tensors, Map.put(defaults, id, params), known}
            collect(Enum.filter(in_args, &match?(%T{}, &1)) ++ flat(default), acc)

          op == :cond ->
            [clauses, last] = args
            nodes = Enum.flat_map(clauses, fn {pred, branch} -> [pred | flat(branch)] end)
            collect(nodes ++ flat(last), {Map.put(seen, id, true), tensors, defaults, known})

          op == :while ->
            [initial, arg, condition, body] = args
            known = Enum.into(flat(arg), known, & &1.data.id)
            nodes = flat(initial) ++ [condition | flat(body)]
            collect(nodes, {Map.put(seen, id, true), tensors, defaults, known})

          true ->
            collect(children(t, :all), {Map.put(seen, id, true), tensors, defaults, known})
        end

      collect(rest, acc)
    end

    defp collect([_ | rest], acc), do: collect(rest, acc)

    # The parameters of a block's default (`nodes`): Nx.Defn.Expr.block/4 made one per
    # tensor argument, by position. They are its `:parameter` nodes that are not known
    # already (the function's, an enclosing loop's or block's), found without entering
    # an inner loop's body or an inner block's default, whose parameters are their own.
    defp block_params([], _known, _seen, params), do: params

    defp block_params(
           [%T{data: %Expr{id: id, op: op, args: args}} = t | rest],
           known,
           seen,
           params
         ) do
      cond do
        Map.has_key?(seen, id) ->
          block_params(rest, known, seen, params)

        op == :parameter ->
          params = if id in known, do: params, else: Map.put(params, id, hd(args))
          block_params(rest, known, Map.put(seen, id, true), params)

        true ->
          block_params(children(t, :scope) ++ rest, known, Map.put(seen, id, true), params)
      end
    end

    defp block_params([_ | rest], known, seen, params),
      do: block_params(rest, known, seen, params)

    # The nodes a node reads, as Nx.Defn.Tree walks them for the Nx release at hand
    # (each release has its own hook nodes): with `:scope`, not those of a loop's body,
    # a block's default or a function, which have parameters of their own.
    defp children(t, type) do
      {_, nodes} = Tree.apply_args(t, type, [], fn node, acc -> {node, [node | acc]} end)
      nodes |> Enum.filter(&match?(%T{data: %Expr{}}, &1)) |> Enum.reverse()
    end

    # The tensors among a node's arguments, those in tuples and maps (a container's
    # leaves: an io_call's data, metadata around a tuple) included.
    defp args_tensors(args) do
      Enum.flat_map(args, fn
        %T{} = t -> [t]
        list when is_list(list) -> Enum.filter(list, &match?(%T{}, &1))
        tuple when is_tuple(tuple) -> args_tensors(Tuple.to_list(tuple))
        map when is_map(map) and not is_struct(map) -> args_tensors(Map.values(map))
        _ -> []
      end)
    end

    def lower_node(%T{data: %Expr{id: id}} = t, st) do
      case st.memo do
        %{^id => slot} ->
          {slot, st}

        _ ->
          check_type(t.type, st.device)

          {slot, st} =
            with true <- MapSet.size(st.fuse) > 0,
                 {slot, st} <- Fusion.rewrite(t, st) do
              {slot, st}
            else
              _ ->
                {args, t} = devectorized(t)
                Ops.lower_op(t.data.op, args, t, st)
            end

          {slot, %{st | memo: Map.put(st.memo, id, slot)}}
      end
    end

    # A graph of vectorized tensors computes on their devectorized shapes (Nx's front
    # end made its ops so): a node, and the tensors among its arguments, as such.
    defp devectorized(%T{vectorized_axes: [], data: %Expr{args: args}} = t) do
      if vectorized?(args),
        do: {Enum.map(args, &devectorize_arg/1), t},
        else: {args, t}
    end

    defp devectorized(%T{} = t) do
      t = Nx.devectorize(t)
      {Enum.map(t.data.args, &devectorize_arg/1), t}
    end

    defp devectorize_arg(%T{} = t), do: Nx.devectorize(t)
    defp devectorize_arg(list) when is_list(list), do: Enum.map(list, &devectorize_arg/1)

    defp devectorize_arg(tuple) when is_tuple(tuple),
      do: tuple |> Tuple.to_list() |> Enum.map(&devectorize_arg/1) |> List.to_tuple()

    defp devectorize_arg(other), do: other

    @doc false
    # Whether a node's arguments hold a vectorized tensor.
    def vectorized?(args), do: Enum.any?(args_tensors(args), &(&1.vectorized_axes != []))

    defp check_type(type, device) do
      cond do
        not Storage.native?(type) -> throw({:unsupported, {:type, type}})
        type == {:f, 64} and device == :gpu -> throw({:unsupported, {:type, type}})
        true -> :ok
      end
    end

    # Under :debug_detect_nan_inf, the results Emily.Backend checks (matmul, norms,
    # attention) are checked here too: the program also returns each one's count of
    # non-finite values (read and reported by the compiler after the run). Each checked
    # slot is counted once, however often the graph uses it.
    @doc false
    def checked(st, op, slot, %T{type: {kind, _}} = t) do
      if kind in [:f, :bf, :c] and Emily.Debug.checks_finite?(op) do
        {count, st} = emit(st, :debug_count_nonfinite, [slot])

        if Enum.any?(st.checks, &(elem(&1, 0) == count)),
          do: st,
          else: %{st | checks: [{count, op, Nx.to_template(t)} | st.checks]}
      else
        st
      end
    end

    @doc false
    # The axes an op's `axes` option names, all of `x`'s where it names none.
    def axes(%T{shape: shape}, nil), do: all_axes(shape)
    def axes(_x, axes), do: axes

    @doc false
    # The slot and lowering state of an Emily.Backend.Compose composition's result.
    def composed({slot, {_builder, st}}), do: {slot, st}

    @doc false
    def all_axes(shape), do: Enum.to_list(0..(tuple_size(shape) - 1)//1)

    @doc false
    def flat(tuple) when is_tuple(tuple), do: Tuple.to_list(tuple)
    def flat(%T{} = t), do: [t]

    # The value of the constant `slot`, computed now (see `constant_values/2`).
    @doc false
    def constant_value(slot, st) do
      {[value], st} = constant_values([slot], st)
      {value, st}
    end

    # The values of the constant `slots`, computed now, with the constants they are
    # made of (each kept in `st.values`, so that a later computation, the next pass's
    # condition or the folding, starts from them).
    defp constant_values(slots, st) do
      needed = needed_constants(slots, st, MapSet.new()) |> Enum.sort()

      st =
        if needed == [] do
          st
        else
          known =
            needed
            |> Enum.flat_map(&Emily.Program.input_slots(Map.fetch!(st.instr_at, &1)))
            |> Enum.filter(&Map.has_key?(st.values, &1))
            |> Enum.uniq()

          index = Map.new(Enum.with_index(known ++ needed))
          at = &Map.fetch!(index, &1)
          instrs = Enum.map(needed, &Emily.Program.map_slots(Map.fetch!(st.instr_at, &1), at))
          outputs = Enum.map(needed, at)
          program = Emily.Program.new(instrs, inputs: length(known), outputs: outputs)
          inputs = Enum.map(known, &Map.fetch!(st.values, &1))
          values = Emily.Program.eval(program, inputs, stream: Emily.Stream.default(st.device))
          %{st | values: Map.merge(st.values, Map.new(Enum.zip(needed, values)))}
        end

      {Enum.map(slots, &Map.fetch!(st.values, &1)), st}
    rescue
      # (MLX rejected the constants: the graph runs on the evaluator, which says why.)
      e in Emily.Error -> throw({:unsupported, {:folding, Exception.message(e)}})
    end

    defp needed_constants([], _st, acc), do: acc

    defp needed_constants([slot | rest], st, acc) do
      if MapSet.member?(acc, slot) or Map.has_key?(st.values, slot) do
        needed_constants(rest, st, acc)
      else
        inputs = Emily.Program.input_slots(Map.fetch!(st.instr_at, slot))
        needed_constants(inputs ++ rest, st, MapSet.put(acc, slot))
      end
    end

    # Each node's slot with its type, for Emily.Backend.Compose.
    @doc false
    def typed(nodes, st) do
      Enum.map_reduce(nodes, st, fn %T{type: type} = t, st ->
        {slot, st} = lower_node(t, st)
        {{slot, type}, st}
      end)
    end

    # The slot of `x` cast to `type` (a plain MLX cast, as Emily.Backend's operands).
    @doc false
    def operand(%T{type: from} = x, to, st) do
      {slot, st} = lower_node(x, st)
      if from == to, do: {slot, st}, else: emit(st, :astype, [slot, to])
    end

    # The slot of `{op, args}`, emitted only if no earlier instruction is the same: an
    # instruction is a pure function of its op and arguments (the op table's ops are;
    # its random ops take an explicit key and give the same numbers for the same key),
    # and slots are assigned once, so equal instructions hold equal values. Map keys
    # compare exactly, so 1 and 1.0, or 0.0 and -0.0 (OTP 27), stay apart.
    #
    # A view of a view is emitted as one view of the first one's input: a transpose of a
    # transpose as their composition, nothing where that is the identity (Bumblebee's
    # attention transposes its queries back and forth around the rotary embedding), a
    # reshape of a reshape as one reshape. Each instruction left out is one MLX node
    # fewer for the host to build and to evaluate.
    @doc false
    def emit(st, :transpose, [x, perm]) do
      case st.instr_at do
        %{^x => {:transpose, [y, inner]}} ->
          composed = Enum.map(perm, &Enum.at(inner, &1))

          if composed == Enum.to_list(0..(length(composed) - 1)//1),
            do: {y, st},
            else: emit_new(st, :transpose, [y, composed])

        _ ->
          emit_new(st, :transpose, [x, perm])
      end
    end

    def emit(st, :reshape, [x, shape]) do
      case st.instr_at do
        %{^x => {:reshape, [y, _]}} -> emit_new(st, :reshape, [y, shape])
        _ -> emit_new(st, :reshape, [x, shape])
      end
    end

    # A cast to bool of a bool, or of a bool cast to another type, is that bool; `any`
    # and `all` of a bool cast to another type read the bool (a cast of a bool is 0 or 1).
    # Nx's comparisons answer u8, so Bumblebee's stopping test casts MLX's bool to u8
    # and back between each comparison, reduction and logical op: a kernel each.
    def emit(st, :astype, [x, :bool] = args) do
      case uncast_bool(st, x) do
        nil -> emit_new(st, :astype, args)
        y -> {y, st}
      end
    end

    def emit(st, op, [x | rest] = args) when op in [:any, :all] do
      case uncast_bool(st, x) do
        nil -> emit_new(st, op, args)
        y -> emit_new(st, op, [y | rest])
      end
    end

    def emit(st, op, args), do: emit_new(st, op, args)

    @bool_ops Emily.Backend.Compose.bool_ops()

    # The bool slot `x` holds, as itself or cast to another type; nil if none.
    defp uncast_bool(st, x) do
      source = with %{^x => {:astype, [y, _]}} <- st.instr_at, do: y, else: (_ -> x)

      cond do
        bool?(st, source) -> source
        bool?(st, x) -> x
        true -> nil
      end
    end

    defp bool?(st, x) do
      case st.instr_at do
        %{^x => {:astype, [_, :bool]}} -> true
        %{^x => {op, _}} -> op in @bool_ops
        _ -> false
      end
    end

    defp emit_new(st, op, args) do
      key = {op, args}

      case st.emitted do
        %{^key => slot} ->
          {slot, st}

        _ ->
          slot = st.next
          const? = Enum.all?(Emily.Program.input_slots(key), &MapSet.member?(st.const, &1))

          {slot,
           %{
             st
             | next: slot + 1,
               instrs: [key | st.instrs],
               emitted: Map.put(st.emitted, key, slot),
               instr_at: Map.put(st.instr_at, slot, key),
               const: if(const?, do: MapSet.put(st.const, slot), else: st.const)
           }}
      end
    end
  end
end
