if Code.ensure_loaded?(Nx) do
  defmodule Emily.Compiler.Native do
    @moduledoc false
    # The native path of Emily.Compiler: an `Nx.Defn.Expr` graph lowered once into one
    # `Emily.Program` (instructions over the op table), replayed per run in one native
    # call. `lower/3` throws `{:unsupported, reason}` on anything outside the subset it
    # knows; the compiler then runs the whole graph on the evaluator path.
    #
    # Each node is lowered with the same casts Emily.Backend applies eagerly (operands
    # cast to the node's type, comparisons in the merged type then cast to u8), so both
    # paths compute the same MLX ops.
    #
    # Each distinct instruction is emitted once (`emit/3`): nodes the Nx graph does not
    # share but that compute the same thing (the same cast of a slot wanted by several
    # ops, `x - mean` written twice, broadcasts of one constant) reuse the first slot.

    alias Nx.Defn.{Composite, Expr}
    alias Nx.Tensor, as: T
    alias Emily.Backend.Storage

    @unary Emily.Backend.Ops.unary()

    # Nx's remainder has the dividend's sign and its quotient truncates.
    @binary Map.merge(Emily.Backend.Ops.arith(), %{remainder: :fmod, quotient: :trunc_divide})

    @compare Emily.Backend.Ops.compare()

    @logical %{logical_and: :logical_and, logical_or: :logical_or, logical_xor: :not_equal}

    @reduce %{sum: :sum, product: :prod, reduce_max: :max, reduce_min: :min}

    @fast_blocks Emily.Fast.blocks()

    # Integers beyond this do not survive the op table's `float` argument exactly.
    @max_exact 9_007_199_254_740_992

    @doc false
    # Lowers `fun.(vars)`. Returns `{program, extras, output, checks}`: extras are the
    # Emily tensors passed after the parameters (the captured tensors, copied to
    # `device`, then the folded constants; see `fold_constants/2`), output
    # the result container of templates, checks the `{op, template}` of each result
    # whose count of non-finite values the program returns after the outputs (under
    # :debug_detect_nan_inf; see `check_finite!/2`). Throws `{:unsupported, reason}`.
    def lower(vars, fun, opts) do
      %{instrs: instrs, inputs: inputs, outputs: outputs} = lowered = lowering(vars, fun, opts)

      program =
        Emily.Program.new(instrs,
          inputs: inputs,
          outputs: outputs,
          compile: Keyword.get(opts, :compile, false)
        )

      {program, lowered.extras, lowered.template, lowered.checks}
    end

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

    defmodule Lowering do
      @moduledoc false
      # A defn compiler that only lowers, and throws the result out of the jit call.
      @behaviour Nx.Defn.Compiler

      @impl true
      def __jit__(_key, vars, fun, _args, opts),
        do: throw({:lowered, Emily.Compiler.Native.instructions(vars, fun, opts[:lowering])})

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
      l = lowering(vars, fun, opts)
      {l.instrs, l.inputs, l.outputs, l.extras, l.template}
    end

    defp lowering(vars, fun, opts) do
      device = Keyword.fetch!(opts, :device)
      flat_vars = Composite.flatten_list(vars)

      if Enum.any?(flat_vars, &(&1.vectorized_axes != [])),
        do: throw({:unsupported, :vectorized})

      result = fun.(vars)
      outputs = Composite.flatten_list([result])

      if Enum.any?(outputs, &(not match?(%T{data: %Expr{}}, &1) or &1.vectorized_axes != [])),
        do: throw({:unsupported, :vectorized})

      params = length(flat_vars)
      tensors = collect_tensors(outputs, {%{}, []}) |> elem(1) |> Enum.reverse()
      extra_slots = tensors |> Enum.with_index(params) |> Map.new(fn {t, i} -> {t.data.id, i} end)
      extras = Enum.map(tensors, &to_device(&1.data.args |> hd(), device))

      st = %{
        next: params + length(extras),
        instrs: [],
        memo: extra_slots,
        emitted: %{},
        device: device,
        checks: []
      }

      {slots, st} = Enum.map_reduce(outputs, st, &lower_node/2)

      {template, []} =
        Composite.traverse(result, outputs, fn _, [t | rest] -> {Nx.to_template(t), rest} end)

      checks = Enum.reverse(st.checks)

      fold_constants(%{
        instrs: Enum.reverse(st.instrs),
        inputs: params + length(extras),
        outputs: slots ++ Enum.map(checks, &elem(&1, 0)),
        extras: Enum.map(extras, & &1.data.ref),
        template: template,
        checks: Enum.map(checks, fn {_slot, op, t} -> {op, t} end),
        device: device
      })
    end

    # Instructions that read no input, directly or through others (constants, iotas and
    # what is computed from them alone), give the same values on every run. They run
    # once, here, and the program reads each value it needs as one more input (an
    # evaluated array, as Python MLX's scalar operands are): left in, each would cost
    # every run a step of MLX's evaluation, a hand-off to the stream's thread. A value
    # over @max_folded bytes is not kept (the compiled function would hold it): the
    # instruction stays in the program, reading the folded values it needs. The lowering
    # emits one slot per instruction. If MLX rejects the constant part, nothing is
    # folded, so that the error comes from the run, naming its instruction.
    @max_folded 1_048_576

    defp fold_constants(lowered, kept \\ MapSet.new()) do
      %{instrs: instrs, inputs: n, outputs: outputs, device: device} = lowered
      indexed = Enum.with_index(instrs, n)

      const =
        Enum.reduce(indexed, MapSet.new(), fn {instr, slot}, const ->
          if slot in kept or not Enum.all?(Emily.Program.input_slots(instr), &(&1 in const)),
            do: const,
            else: MapSet.put(const, slot)
        end)

      {folded, live} = Enum.split_with(indexed, fn {_instr, slot} -> slot in const end)

      needed =
        live
        |> Enum.flat_map(fn {instr, _slot} -> Emily.Program.input_slots(instr) end)
        |> Enum.concat(outputs)
        |> Enum.filter(&(&1 in const))
        |> Enum.uniq()

      with [_ | _] <- folded,
           {:ok, values} <- run_folded(folded, needed, device) do
        case for {slot, v} <- Enum.zip(needed, values), Emily.nbytes(v) > @max_folded, do: slot do
          [] -> refold(lowered, live, needed, values)
          big -> fold_constants(lowered, MapSet.union(kept, MapSet.new(big)))
        end
      else
        _ -> lowered
      end
    end

    defp run_folded(folded, needed, device) do
      index = folded |> Enum.with_index(fn {_instr, slot}, i -> {slot, i} end) |> Map.new()
      slot = &Map.fetch!(index, &1)
      instrs = Enum.map(folded, fn {instr, _} -> Emily.Program.map_slots(instr, slot) end)
      program = Emily.Program.new(instrs, inputs: 0, outputs: Enum.map(needed, slot))
      {:ok, Emily.Program.eval(program, [], stream: Emily.Stream.default(device))}
    rescue
      Emily.Error -> :error
    end

    # The program without the folded instructions: inputs, then the folded values it
    # reads, then its own instructions' slots.
    defp refold(lowered, live, needed, values) do
      n = lowered.inputs
      index = needed |> Enum.with_index(n) |> Map.new()

      index =
        live
        |> Enum.with_index(n + length(needed))
        |> Enum.reduce(index, fn {{_instr, slot}, new}, index -> Map.put(index, slot, new) end)

      renumber = fn slot -> if slot < n, do: slot, else: Map.fetch!(index, slot) end

      %{
        lowered
        | instrs: Enum.map(live, fn {instr, _} -> Emily.Program.map_slots(instr, renumber) end),
          inputs: n + length(needed),
          outputs: Enum.map(lowered.outputs, renumber),
          extras: lowered.extras ++ values
      }
    end

    defp to_device(%T{data: %Emily.Backend{}} = t, _device), do: t
    defp to_device(%T{} = t, device), do: Nx.backend_copy(t, {Emily.Backend, device: device})

    # The `:tensor` nodes of the graph, in first-seen order.
    defp collect_tensors([], acc), do: acc

    defp collect_tensors([%T{data: %Expr{id: id, op: op, args: args}} = t | rest], {seen, acc}) do
      acc =
        cond do
          Map.has_key?(seen, id) -> {seen, acc}
          op == :tensor -> {Map.put(seen, id, true), [t | acc]}
          true -> collect_tensors(args_tensors(args), {Map.put(seen, id, true), acc})
        end

      collect_tensors(rest, acc)
    end

    defp collect_tensors([_ | rest], acc), do: collect_tensors(rest, acc)

    defp args_tensors(args) do
      Enum.flat_map(args, fn
        %T{} = t -> [t]
        list when is_list(list) -> Enum.filter(list, &match?(%T{}, &1))
        _ -> []
      end)
    end

    defp lower_node(%T{data: %Expr{id: id}} = t, st) do
      case st.memo do
        %{^id => slot} ->
          {slot, st}

        _ ->
          check_type(t.type, st.device)
          {slot, st} = lower_op(t.data.op, t.data.args, t, st)
          {slot, %{st | memo: Map.put(st.memo, id, slot)}}
      end
    end

    defp check_type(type, device) do
      cond do
        not Storage.native?(type) -> throw({:unsupported, {:type, type}})
        type == {:f, 64} and device == :gpu -> throw({:unsupported, {:type, type}})
        true -> :ok
      end
    end

    defp lower_op(:parameter, [i], _t, st), do: {i, st}
    defp lower_op(:metadata, [expr, _meta], _t, st), do: lower_node(expr, st)

    defp lower_op(:constant, [value], %T{type: type, shape: shape}, st) do
      value =
        case value do
          v when is_integer(v) and abs(v) < @max_exact -> v
          v when is_float(v) -> v
          v when v in [:nan, :infinity, :neg_infinity] -> v
          _ -> throw({:unsupported, {:constant, value}})
        end

      if match?({:c, _}, type), do: throw({:unsupported, {:constant, type}})
      emit(st, :full, [shape, value, type])
    end

    defp lower_op(:iota, [axis], %T{type: type, shape: shape}, st) do
      if match?({:c, _}, type), do: throw({:unsupported, {:iota, type}})
      # MLX's arange has no 16-bit floats: count in f32 and cast, as Emily.Backend does.
      count_type =
        if match?({_, 16}, type) and elem(type, 0) in [:f, :bf], do: {:f, 32}, else: type

      n = if axis == nil, do: Tuple.product(shape), else: elem(shape, axis)
      {x, st} = emit(st, :arange, [0, n, 1, count_type])
      {x, st} = if count_type == type, do: {x, st}, else: emit(st, :astype, [x, type])

      if axis == nil do
        emit(st, :reshape, [x, shape])
      else
        dims =
          shape |> Tuple.to_list() |> Enum.with_index(fn d, i -> if i == axis, do: d, else: 1 end)

        {x, st} = emit(st, :reshape, [x, List.to_tuple(dims)])
        emit(st, :broadcast_to, [x, shape])
      end
    end

    defp lower_op(op, [x], %T{type: type}, st) when is_map_key(@unary, op) do
      {x, st} = operand(x, type, st)
      emit(st, Map.fetch!(@unary, op), [x])
    end

    defp lower_op(:abs, [%T{type: {:u, _}} = x], _t, st), do: lower_node(x, st)

    defp lower_op(:abs, [x], %T{type: type}, st) do
      {x, st} = if match?({:c, _}, x.type), do: lower_node(x, st), else: operand(x, type, st)
      emit(st, :abs, [x])
    end

    defp lower_op(op, [x], %T{type: type}, st) when op in [:ceil, :floor] do
      {x, st} = operand(x, type, st)

      case type do
        {k, _} when k in [:u, :s] -> {x, st}
        _ -> emit(st, op, [x])
      end
    end

    defp lower_op(op, [%T{type: {k, _}} = x], %T{type: type}, st)
         when op in [:is_nan, :is_infinity] and k in [:f, :bf] do
      {x, st} = lower_node(x, st)
      {y, st} = emit(st, if(op == :is_nan, do: :isnan, else: :isinf), [x])
      emit(st, :astype, [y, type])
    end

    defp lower_op(op, [l, r], %T{type: type}, st) when is_map_key(@binary, op) do
      {l, st} = operand(l, type, st)
      {r, st} = operand(r, type, st)
      emit(st, Map.fetch!(@binary, op), [l, r])
    end

    defp lower_op(op, [l, r], %T{type: type}, st) when is_map_key(@compare, op) do
      common = Nx.Type.merge(l.type, r.type)
      {l, st} = operand(l, common, st)
      {r, st} = operand(r, common, st)
      {y, st} = emit(st, Map.fetch!(@compare, op), [l, r])
      emit(st, :astype, [y, type])
    end

    defp lower_op(op, [l, r], %T{type: type}, st) when is_map_key(@logical, op) do
      {l, st} = operand(l, :bool, st)
      {r, st} = operand(r, :bool, st)
      {y, st} = emit(st, Map.fetch!(@logical, op), [l, r])
      emit(st, :astype, [y, type])
    end

    defp lower_op(:as_type, [%T{type: from} = x], %T{type: to}, st) do
      case {from, to} do
        {{fk, _}, {tk, _}} when fk in [:f, :bf] and tk in [:u, :s] ->
          throw({:unsupported, {:as_type, from, to}})

        {{:c, _}, _} ->
          throw({:unsupported, {:as_type, from, to}})

        _ ->
          operand(x, to, st)
      end
    end

    defp lower_op(:reshape, [x], %T{shape: shape}, st) do
      {x, st} = lower_node(x, st)
      emit(st, :reshape, [x, shape])
    end

    defp lower_op(:squeeze, [x, axes], _t, st) do
      {x, st} = lower_node(x, st)
      emit(st, :squeeze, [x, axes])
    end

    defp lower_op(:transpose, [x, axes], _t, st) do
      {x, st} = lower_node(x, st)
      emit(st, :transpose, [x, axes])
    end

    defp lower_op(:reverse, [x, axes], _t, st) do
      {x, st} = lower_node(x, st)
      emit(st, :flip, [x, axes])
    end

    defp lower_op(:broadcast, [x, shape, axes], %T{type: type}, st) do
      rank = tuple_size(shape)
      {slot, st} = operand(x, type, st)

      {slot, st} =
        if tuple_size(x.shape) == rank and axes == Enum.to_list(0..(rank - 1)//1) do
          {slot, st}
        else
          dims =
            x.shape
            |> Tuple.to_list()
            |> Enum.zip(axes)
            |> Enum.reduce(List.duplicate(1, rank), fn {d, a}, acc ->
              List.replace_at(acc, a, d)
            end)

          emit(st, :reshape, [slot, List.to_tuple(dims)])
        end

      emit(st, :broadcast_to, [slot, shape])
    end

    defp lower_op(:dot, [l, cl, bl, r, cr, br], %T{type: type} = t, st) do
      {l, st} = operand(l, type, st)
      {r, st} = operand(r, type, st)
      {slot, st} = emit(st, :dot, [l, cl, bl, r, cr, br])
      {slot, checked(st, :dot, slot, t)}
    end

    defp lower_op(op, [x, opts], %T{type: type}, st) when is_map_key(@reduce, op) do
      {slot, st} = operand(x, type, st)
      emit(st, Map.fetch!(@reduce, op), [slot, axes(x, opts[:axes]), opts[:keep_axes] || false])
    end

    defp lower_op(op, [x, opts], %T{type: type}, st) when op in [:all, :any] do
      {slot, st} = lower_node(x, st)
      {y, st} = emit(st, op, [slot, axes(x, opts[:axes]), opts[:keep_axes] || false])
      emit(st, :astype, [y, type])
    end

    defp lower_op(:select, [pred, on_true, on_false], %T{type: type}, st) do
      {p, st} = operand(pred, :bool, st)
      {a, st} = operand(on_true, type, st)
      {b, st} = operand(on_false, type, st)
      emit(st, :where, [p, a, b])
    end

    defp lower_op(:clip, [x, lo, hi], %T{type: type}, st) do
      {x, st} = operand(x, type, st)
      {lo, st} = operand(lo, type, st)
      {hi, st} = operand(hi, type, st)
      emit(st, :clip, [x, lo, hi])
    end

    defp lower_op(:slice, [x, starts, lengths, strides], _t, st) do
      if not Enum.all?(starts, &is_integer/1), do: throw({:unsupported, :dynamic_slice})
      {slot, st} = lower_node(x, st)

      starts =
        [Tuple.to_list(x.shape), starts, lengths]
        |> Enum.zip_with(fn [dim, start, len] -> start |> max(0) |> min(dim - len) end)

      stops = Enum.zip_with(starts, lengths, &(&1 + &2))
      emit(st, :slice, [slot, starts, stops, strides])
    end

    defp lower_op(:concatenate, [tensors, axis], %T{type: type}, st) do
      {slots, st} = Enum.map_reduce(tensors, st, &operand(&1, type, &2))
      emit(st, :concatenate, [slots, axis])
    end

    # Emily.Fast's blocks lower to their fused kernel (Emily.Fast.native_call/3 names it
    # and the casts of its arguments); other blocks are not lowered.
    defp lower_op(:block, [%struct{} = block, in_args, _default, _fun], t, st)
         when struct in @fast_blocks do
      case Emily.Fast.native_call(block, t, in_args) do
        nil ->
          throw({:unsupported, {:block, struct}})

        {op, spec} ->
          inputs = List.to_tuple(in_args)

          {args, st} =
            Enum.map_reduce(spec, st, fn
              {:arg, i, type}, st -> operand(elem(inputs, i), type, st)
              other, st -> {other, st}
            end)

          {slot, st} = emit(st, op, args)
          {slot, checked(st, op, slot, t)}
      end
    end

    # A tuple's element: the tuple comes from `while`, `cond`, a block or the like.
    defp lower_op(:elem, [%T{data: %Expr{op: op}} | _], _t, _st),
      do: throw({:unsupported, {:op, op}})

    defp lower_op(op, _args, _t, _st), do: throw({:unsupported, {:op, op}})

    # Under :debug_detect_nan_inf, the results Emily.Backend checks (matmul, norms,
    # attention) are checked here too: the program also returns each one's count of
    # non-finite values (read and reported by the compiler after the run). Each checked
    # slot is counted once, however often the graph uses it.
    defp checked(st, op, slot, %T{type: {kind, _}} = t) do
      if kind in [:f, :bf, :c] and Emily.Debug.checks_finite?(op) do
        {count, st} = emit(st, :debug_count_nonfinite, [slot])

        if Enum.any?(st.checks, &(elem(&1, 0) == count)),
          do: st,
          else: %{st | checks: [{count, op, Nx.to_template(t)} | st.checks]}
      else
        st
      end
    end

    defp axes(%T{shape: shape}, nil), do: Enum.to_list(0..(tuple_size(shape) - 1)//1)
    defp axes(_x, axes), do: axes

    # The slot of `x` cast to `type` (a plain MLX cast, as Emily.Backend's operands).
    defp operand(%T{type: from} = x, to, st) do
      {slot, st} = lower_node(x, st)
      if from == to, do: {slot, st}, else: emit(st, :astype, [slot, to])
    end

    # The slot of `{op, args}`, emitted only if no earlier instruction is the same: an
    # instruction is a pure function of its op and arguments (the op table's ops are;
    # its random ops take an explicit key and give the same numbers for the same key),
    # and slots are assigned once, so equal instructions hold equal values. Map keys
    # compare exactly, so 1 and 1.0, or 0.0 and -0.0 (OTP 27), stay apart.
    defp emit(st, op, args) do
      key = {op, args}

      case st.emitted do
        %{^key => slot} ->
          {slot, st}

        _ ->
          slot = st.next
          instrs = [key | st.instrs]
          {slot, %{st | next: slot + 1, instrs: instrs, emitted: Map.put(st.emitted, key, slot)}}
      end
    end
  end
end
