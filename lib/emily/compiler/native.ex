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

    @arg_reduce Emily.Backend.Ops.arg_reduce()
    @scatter Emily.Backend.Ops.scatter()
    @scan Emily.Backend.Ops.scan()
    @take Emily.Backend.Ops.take()

    @window [:window_sum, :window_product, :window_max, :window_min]

    @erf_inv Emily.Backend.Ops.erf_inv_coefficients()

    # The most passes of a `while` the lowering unrolls.
    @max_passes 1024

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
      known = MapSet.new(flat_vars, & &1.data.id)
      {_seen, tensors, defaults, _known} = collect(outputs, {%{}, [], %{}, known})
      tensors = Enum.reverse(tensors)
      extra_slots = tensors |> Enum.with_index(params) |> Map.new(fn {t, i} -> {t.data.id, i} end)
      extras = Enum.map(tensors, &to_device(&1.data.args |> hd(), device))

      st = %{
        next: params + length(extras),
        instrs: [],
        memo: extra_slots,
        emitted: %{},
        device: device,
        checks: [],
        defaults: defaults,
        whiles: %{},
        instr_at: %{},
        const: MapSet.new(),
        values: %{}
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
            collect(args_tensors(args), {Map.put(seen, id, true), tensors, defaults, known})
        end

      collect(rest, acc)
    end

    defp collect([_ | rest], acc), do: collect(rest, acc)

    # The parameters of a block's default (`nodes`): Nx.Defn.Expr.block/4 made one per
    # tensor argument, by position. They are its `:parameter` nodes that are not known
    # already (the function's, an enclosing loop's or block's), found without entering
    # an inner loop's body or an inner block's default, whose parameters are their own.
    defp block_params([], _known, _seen, params), do: params

    defp block_params([%T{data: %Expr{id: id, op: op, args: args}} | rest], known, seen, params) do
      cond do
        Map.has_key?(seen, id) ->
          block_params(rest, known, seen, params)

        op == :parameter ->
          params = if id in known, do: params, else: Map.put(params, id, hd(args))
          block_params(rest, known, Map.put(seen, id, true), params)

        true ->
          inner =
            case {op, args} do
              {:block, [_, in_args, _, _]} -> Enum.filter(in_args, &match?(%T{}, &1))
              {:while, [initial | _]} -> flat(initial)
              _ -> args_tensors(args)
            end

          block_params(inner ++ rest, known, Map.put(seen, id, true), params)
      end
    end

    defp block_params([_ | rest], known, seen, params),
      do: block_params(rest, known, seen, params)

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

    defp lower_op(:bitcast, [x], %T{type: type}, st) do
      {x, st} = lower_node(x, st)
      emit(st, :view, [x, type])
    end

    # As Emily.Backend's: on the CPU, Nx's own formula in f64, rounded once (equal to
    # Nx.BinaryBackend's to the last bit); on a GPU, MLX's erfinv.
    defp lower_op(:erf_inv, [x], %T{type: type}, %{device: :cpu} = st) do
      f64 = {:f, 64}
      {small, large} = @erf_inv
      {z, st} = operand(x, f64, st)
      {one, st} = emit(st, :full, [{}, 1, f64])
      {a, st} = emit(st, :subtract, [one, z])
      {b, st} = emit(st, :add, [one, z])
      {ab, st} = emit(st, :multiply, [a, b])
      {log, st} = emit(st, :log, [ab])
      {w, st} = emit(st, :negative, [log])
      {c, st} = emit(st, :full, [{}, 2.5, f64])
      {w_small, st} = emit(st, :subtract, [w, c])
      {small, st} = horner(small, w_small, st)
      {sqrt_w, st} = emit(st, :sqrt, [w])
      {c, st} = emit(st, :full, [{}, 3, f64])
      {w_large, st} = emit(st, :subtract, [sqrt_w, c])
      {large, st} = horner(large, w_large, st)
      {c, st} = emit(st, :full, [{}, 5, f64])
      {below, st} = emit(st, :less, [w, c])
      {poly, st} = emit(st, :where, [below, small, large])
      {y, st} = emit(st, :multiply, [poly, z])
      {edge, st} = emit(st, :equal, [z, one])
      {inf, st} = emit(st, :full, [{}, :infinity, f64])
      {y, st} = emit(st, :where, [edge, inf, y])
      {minus_one, st} = emit(st, :full, [{}, -1, f64])
      {edge, st} = emit(st, :equal, [z, minus_one])
      {neg_inf, st} = emit(st, :full, [{}, :neg_infinity, f64])
      {y, st} = emit(st, :where, [edge, neg_inf, y])
      emit(st, :astype, [y, type])
    end

    defp lower_op(:erf_inv, [x], %T{type: type}, st) do
      {x, st} = operand(x, type, st)
      emit(st, :erfinv, [x])
    end

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

    # Nx's float to integer cast, as Emily.Backend's: truncation, NaN to 0, infinities to
    # the type's limits.
    defp lower_op(:as_type, [%T{type: {fk, _} = from} = x], %T{type: {tk, _} = to}, st)
         when fk in [:f, :bf] and tk in [:u, :s] do
      {x, st} = lower_node(x, st)
      {y, st} = emit(st, :astype, [x, to])
      {nan, st} = emit(st, :isnan, [x])
      {zero, st} = emit(st, :full, [{}, 0, to])
      {y, st} = emit(st, :where, [nan, zero, y])
      {inf, st} = emit(st, :full, [{}, :infinity, from])
      {above, st} = emit(st, :equal, [x, inf])
      {max, st} = int_limit(st, :max, to)
      {y, st} = emit(st, :where, [above, max, y])
      {neg_inf, st} = emit(st, :negative, [inf])
      {below, st} = emit(st, :equal, [x, neg_inf])
      {min, st} = int_limit(st, :min, to)
      emit(st, :where, [below, min, y])
    end

    defp lower_op(:as_type, [%T{type: {:c, _} = from}], %T{type: to}, _st),
      do: throw({:unsupported, {:as_type, from, to}})

    defp lower_op(:as_type, [x], %T{type: to}, st), do: operand(x, to, st)

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

    # Start indices that read an input stay on the device, where the op clamps them as
    # Nx does.
    defp lower_op(:slice, [x, starts, lengths, strides], _t, st) do
      {slot, st} = lower_node(x, st)

      case known_starts(starts, st) do
        {:ok, starts, st} ->
          starts = clamp_starts(x.shape, starts, lengths)
          stops = Enum.zip_with(starts, lengths, &(&1 + &2))
          emit(st, :slice, [slot, starts, stops, strides])

        {:dynamic, st} ->
          {starts, st} = starts_vector(starts, st)
          emit(st, :slice_dynamic, [slot, starts, all_axes(x.shape), lengths, strides])
      end
    end

    defp lower_op(:concatenate, [tensors, axis], %T{type: type}, st) do
      {slots, st} = Enum.map_reduce(tensors, st, &operand(&1, type, &2))
      emit(st, :concatenate, [slots, axis])
    end

    defp lower_op(:stack, [tensors, axis], %T{type: type}, st) do
      {slots, st} = Enum.map_reduce(tensors, st, &operand(&1, type, &2))
      emit(st, :stack, [slots, axis])
    end

    defp lower_op(:eye, [], %T{type: type, shape: shape}, st) do
      rank = tuple_size(shape)
      {x, st} = emit(st, :eye, [elem(shape, rank - 2), elem(shape, rank - 1), 0, type])
      if rank > 2, do: emit(st, :broadcast_to, [x, shape]), else: {x, st}
    end

    defp lower_op(:pad, [x, value, config], %T{type: type}, st) do
      {x, st} = operand(x, type, st)
      {v, st} = operand(value, type, st)
      [lo, hi, interior] = for i <- 0..2, do: Enum.map(config, &elem(&1, i))
      emit(st, :pad, [x, v, lo, hi, interior])
    end

    defp lower_op(op, [x, opts], %T{type: type, shape: shape}, st)
         when is_map_key(@arg_reduce, op) do
      {slot, st} = lower_node(x, st)

      # Over all axes: over the flattened tensor, then shaped as Nx's result.
      {slot, axis, st} =
        case opts[:axis] do
          nil ->
            {flat, st} = emit(st, :reshape, [slot, {Nx.size(x.shape)}])
            {flat, 0, st}

          axis ->
            {slot, axis, st}
        end

      {first, last} = Map.fetch!(@arg_reduce, op)
      reduce = if opts[:tie_break] == :high, do: last, else: first
      {y, st} = emit(st, reduce, [slot, axis, opts[:keep_axis] || false])
      {y, st} = emit(st, :astype, [y, type])
      if opts[:axis] == nil and shape != {}, do: emit(st, :reshape, [y, shape]), else: {y, st}
    end

    defp lower_op(op, [x, window, opts], %T{type: type}, st) when op in @window do
      {x, st} = operand(x, type, st)
      {lo, hi} = Enum.unzip(opts[:padding])
      emit(st, op, [x, Tuple.to_list(window), opts[:strides], lo, hi, opts[:window_dilations]])
    end

    # As Emily.Backend's: the tensor padded as Nx pads it (a padded place can win a
    # window, its update then dropped; the op never selects its own padding), the
    # result cropped back.
    defp lower_op(op, [x, source, init, window, opts], %T{type: type}, st)
         when op in [:window_scatter_max, :window_scatter_min] do
      rank = tuple_size(window)
      {lo, hi} = Enum.unzip(opts[:padding])
      zeros = List.duplicate(0, rank)
      padded? = Enum.any?(opts[:padding], &(&1 != {0, 0}))

      {slot, st} =
        if padded? do
          pad_type = Emily.Backend.window_scatter_pad_type(x.type, init.type)
          {slot, st} = operand(x, pad_type, st)
          {value, st} = operand(init, pad_type, st)
          emit(st, :pad, [slot, value, lo, hi, zeros])
        else
          lower_node(x, st)
        end

      {source, st} = operand(source, type, st)
      {init, st} = operand(init, type, st)
      args = [slot, source, init, Tuple.to_list(window), opts[:strides], zeros, zeros]
      {y, st} = emit(st, op, args)

      if padded? do
        stops = Enum.zip_with(lo, Tuple.to_list(x.shape), &(&1 + &2))
        emit(st, :slice, [y, lo, stops, List.duplicate(1, rank)])
      else
        {y, st}
      end
    end

    # (Emily.Backend computes a complex convolution as four real ones: not lowered.)
    defp lower_op(:conv, [x, kernel, opts], %T{type: type}, st) when elem(type, 0) != :c do
      {x, st} = operand(x, type, st)
      {w, st} = operand(kernel, type, st)
      {lo, hi} = Enum.unzip(opts[:padding])

      emit(st, :conv, [
        x,
        w,
        opts[:strides],
        lo,
        hi,
        opts[:input_dilation],
        opts[:kernel_dilation],
        opts[:feature_group_size],
        opts[:batch_group_size],
        opts[:input_permutation] || [],
        opts[:kernel_permutation] || [],
        opts[:output_permutation] || []
      ])
    end

    defp lower_op(op, [x, opts], %T{type: type}, st) when op in [:sort, :argsort] do
      {slot, st} = lower_node(x, st)
      {y, st} = emit(st, op, [slot, opts[:axis], opts[:direction] == :desc])
      if op == :argsort, do: emit(st, :astype, [y, type]), else: {y, st}
    end

    defp lower_op(:put_slice, [x, starts, update], %T{type: type, shape: shape}, st) do
      {slot, st} = operand(x, type, st)

      if Nx.size(update.shape) == 0 do
        {slot, st}
      else
        {u, st} = operand(update, type, st)

        case known_starts(starts, st) do
          {:ok, starts, st} ->
            lengths = Tuple.to_list(update.shape)
            starts = clamp_starts(shape, starts, lengths)
            stops = Enum.zip_with(starts, lengths, &(&1 + &2))
            ones = List.duplicate(1, tuple_size(shape))
            emit(st, :slice_update, [slot, u, starts, stops, ones])

          {:dynamic, st} ->
            {starts, st} = starts_vector(starts, st)
            emit(st, :slice_update_dynamic, [slot, u, starts, all_axes(shape)])
        end
      end
    end

    # Indices run as Emily.Backend runs them without :debug_bounds_check (reads clamp,
    # out-of-range writes drop); with it, the backend checks them on the host between
    # ops, which a program cannot.
    defp lower_op(:gather, [x, indices, opts], _t, st) do
      unless_bounds_checked(:gather)
      {x, st} = lower_node(x, st)
      {i, st} = lower_node(indices, st)
      emit(st, :gather, [x, i, opts[:axes]])
    end

    defp lower_op(op, [x, indices, updates, opts], %T{type: type}, st)
         when is_map_key(@scatter, op) do
      unless_bounds_checked(op)
      {x, st} = operand(x, type, st)
      {i, st} = lower_node(indices, st)
      {u, st} = operand(updates, type, st)
      emit(st, Map.fetch!(@scatter, op), [x, i, u, opts[:axes]])
    end

    defp lower_op(:block, [%struct{axis: axis}, [x, indices], _default, _fun], _t, st)
         when is_map_key(@take, struct) do
      op = Map.fetch!(@take, struct)
      unless_bounds_checked(op)
      {x, st} = lower_node(x, st)
      {i, st} = lower_node(indices, st)
      emit(st, op, [x, i, axis])
    end

    # (MLX keeps 8- and 16-bit integer types in its scans; Nx's type is the node's.)
    defp lower_op(:block, [%struct{axis: axis, reverse: reverse}, [x], _default, _fun], t, st)
         when is_map_key(@scan, struct) do
      {x, st} = operand(x, t.type, st)
      {y, st} = emit(st, Map.fetch!(@scan, struct), [x, axis, reverse, true])
      emit(st, :astype, [y, t.type])
    end

    defp lower_op(:block, [%Nx.Block.LogicalNot{}, [x], _default, _fun], t, st) do
      {x, st} = operand(x, :bool, st)
      {y, st} = emit(st, :logical_not, [x])
      emit(st, :astype, [y, t.type])
    end

    # Emily.Fast's blocks lower to their fused kernel (Emily.Fast.native_call/3 names it
    # and the casts of its arguments), or, where it names none, to their default.
    defp lower_op(:block, [%struct{} = block, in_args, _default, _fun], t, st)
         when struct in @fast_blocks do
      case Emily.Fast.native_call(block, t, in_args) do
        nil ->
          {default, st} = block_default(t, st)
          lower_node(default, st)

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

    # Any other block: its default implementation (Nx's own, built of other ops), as
    # Emily.Backend runs the blocks it has no kernel for.
    defp lower_op(:block, [_block, _in_args, %T{}, _fun], t, st) do
      {default, st} = block_default(t, st)
      lower_node(default, st)
    end

    # An element of a block's tuple result: that element of its default.
    defp lower_op(:elem, [%T{data: %Expr{op: :block}} = block, i], _t, st) do
      {default, st} = block_default(block, st)
      lower_node(elem(default, i), st)
    end

    defp lower_op(:while, _args, t, st) do
      {[slot], st} = unrolled(t, st)
      {slot, st}
    end

    defp lower_op(:elem, [%T{data: %Expr{op: :while}} = loop, i], _t, st) do
      {slots, st} = unrolled(loop, st)
      {Enum.at(slots, i), st}
    end

    defp lower_op(:cond, [clauses, last], _t, st) do
      {[slot], st} = chosen(clauses, last, st)
      {slot, st}
    end

    defp lower_op(:elem, [%T{data: %Expr{op: :cond, args: [clauses, last]}}, i], _t, st) do
      {slots, st} = chosen(clauses, last, st)
      {Enum.at(slots, i), st}
    end

    # Otherwise a tuple's element comes from an op not lowered.
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

    defp axes(%T{shape: shape}, nil), do: all_axes(shape)
    defp axes(_x, axes), do: axes

    defp all_axes(shape), do: Enum.to_list(0..(tuple_size(shape) - 1)//1)

    defp clamp_starts(shape, starts, lengths) do
      [Tuple.to_list(shape), starts, lengths]
      |> Enum.zip_with(fn [dim, start, len] -> start |> max(0) |> min(dim - len) end)
    end

    # sum(coefficient * x^power), highest power first, in f64.
    defp horner([first | rest], x, st) do
      {acc, st} = emit(st, :full, [{}, first, {:f, 64}])

      Enum.reduce(rest, {acc, st}, fn coefficient, {acc, st} ->
        {product, st} = emit(st, :multiply, [acc, x])
        {c, st} = emit(st, :full, [{}, coefficient, {:f, 64}])
        emit(st, :add, [product, c])
      end)
    end

    # An integer type's limit as a scalar; the 64-bit ones, which a double does not hold
    # exactly, from bit operations (computed once, when constants are folded).
    defp int_limit(st, :min, {:u, _} = type), do: emit(st, :full, [{}, 0, type])

    defp int_limit(st, :max, {:u, 64} = type) do
      {zero, st} = int_limit(st, :min, type)
      emit(st, :bitwise_invert, [zero])
    end

    defp int_limit(st, :max, {:u, bits} = type), do: emit(st, :full, [{}, 2 ** bits - 1, type])

    defp int_limit(st, :min, {:s, 64} = type) do
      {one, st} = emit(st, :full, [{}, 1, type])
      {shift, st} = emit(st, :full, [{}, 63, type])
      emit(st, :left_shift, [one, shift])
    end

    defp int_limit(st, :max, {:s, 64} = type) do
      {min, st} = int_limit(st, :min, type)
      emit(st, :bitwise_invert, [min])
    end

    defp int_limit(st, :min, {:s, bits} = type),
      do: emit(st, :full, [{}, -(2 ** (bits - 1)), type])

    defp int_limit(st, :max, {:s, bits} = type),
      do: emit(st, :full, [{}, 2 ** (bits - 1) - 1, type])

    # Start indices as numbers, where each is a number or a tensor computed from
    # constants alone (an unrolled loop's counter): computed now. {:dynamic, st} where
    # one reads an input.
    defp known_starts(starts, st) do
      {slots, st} =
        Enum.map_reduce(starts, st, fn
          i, st when is_integer(i) ->
            {i, st}

          %T{} = t, st ->
            {slot, st} = lower_node(t, st)
            {{:slot, slot}, st}
        end)

      if Enum.all?(slots, &(is_integer(&1) or MapSet.member?(st.const, elem(&1, 1)))) do
        {starts, st} =
          Enum.map_reduce(slots, st, fn
            i, st when is_integer(i) ->
              {i, st}

            {:slot, slot}, st ->
              {value, st} = constant_value(slot, st)
              {hd(Emily.to_list(value)), st}
          end)

        {:ok, starts, st}
      else
        {:dynamic, st}
      end
    end

    # One s64 vector of start indices, integers and scalar tensors alike.
    defp starts_vector(starts, st) do
      {parts, st} =
        Enum.map_reduce(starts, st, fn
          i, st when is_integer(i) ->
            emit(st, :full, [{1}, i, {:s, 64}])

          %T{} = t, st ->
            {slot, st} = operand(t, {:s, 64}, st)
            emit(st, :reshape, [slot, {1}])
        end)

      emit(st, :concatenate, [parts, 0])
    end

    # A `while` whose condition reads no input (a loop over a range or a tensor's
    # elements, Nx.Random's rounds) runs a number of times known here: it is unrolled,
    # its condition computed before each pass, now, from the constants it is made of.
    # The final state's slots, once per node (and per pass of an enclosing loop).
    defp unrolled(%T{data: %Expr{id: id, args: [initial, arg, condition, body]}}, st) do
      case st.whiles do
        %{^id => slots} ->
          {slots, st}

        _ ->
          {state, st} = Enum.map_reduce(flat(initial), st, &lower_node/2)
          {state, st} = unroll(flat(arg), condition, flat(body), state, st, 0)
          {state, %{st | whiles: Map.put(st.whiles, id, state)}}
      end
    end

    defp unroll(params, condition, body, state, st, passes) do
      # What is lowered for one pass (its nodes, inner loops) holds for that pass only.
      outer = Map.take(st, [:memo, :whiles])
      bound = Enum.zip(params, state) |> Map.new(fn {p, slot} -> {p.data.id, slot} end)
      {pred, st} = lower_node(condition, %{st | memo: Map.merge(st.memo, bound)})

      if not MapSet.member?(st.const, pred),
        do: throw({:unsupported, {:while, :condition_reads_input}})

      {value, st} = constant_value(pred, st)

      cond do
        Emily.to_list(value) == [0] ->
          {state, Map.merge(st, outer)}

        passes == @max_passes ->
          throw({:unsupported, {:while, {:more_passes_than, @max_passes}}})

        true ->
          {state, st} = Enum.map_reduce(body, st, &lower_node/2)
          unroll(params, condition, body, state, Map.merge(st, outer), passes + 1)
      end
    end

    # A `cond`'s results: a clause whose predicate is computed from constants alone is
    # decided now; otherwise its branch and what follows are both computed and the
    # results selected (`where`). Branches hold no side effects (hooks and tokens are
    # not lowered) and MLX's ops do not fail on values, so computing a branch not taken
    # changes nothing but the time; under :debug_detect_nan_inf, whose checks would see
    # it, such a `cond` is not lowered.
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
        {taken, st} = Enum.map_reduce(flat(branch), st, &lower_node/2)
        {other, st} = chosen(rest, last, st)

        Enum.zip(taken, other)
        |> Enum.map_reduce(st, fn {a, b}, st -> emit(st, :where, [p, a, b]) end)
      end
    end

    defp flat(tuple) when is_tuple(tuple), do: Tuple.to_list(tuple)
    defp flat(%T{} = t), do: [t]

    # The value of the constant `slot`, computed now, with the constants it is made of
    # (each kept, so that the next pass's condition starts from them).
    defp constant_value(slot, st) do
      needed = needed_constants([slot], st, MapSet.new()) |> Enum.sort()

      known =
        needed
        |> Enum.flat_map(&Emily.Program.input_slots(Map.fetch!(st.instr_at, &1)))
        |> Enum.filter(&Map.has_key?(st.values, &1))
        |> Enum.uniq()

      index = Map.new(Enum.with_index(known ++ needed))
      at = &Map.fetch!(index, &1)
      instrs = Enum.map(needed, &Emily.Program.map_slots(Map.fetch!(st.instr_at, &1), at))
      program = Emily.Program.new(instrs, inputs: length(known), outputs: Enum.map(needed, at))
      inputs = Enum.map(known, &Map.fetch!(st.values, &1))
      values = Emily.Program.eval(program, inputs, stream: Emily.Stream.default(st.device))
      st = %{st | values: Map.merge(st.values, Map.new(Enum.zip(needed, values)))}
      {Map.fetch!(st.values, slot), st}
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

    # The default Nx traced for the block node `block`, its parameters (see collect/2)
    # bound to the slots of the block's tensor arguments.
    defp block_default(%T{data: %Expr{id: id, args: [_block, in_args, default, _fun]}}, st) do
      inputs = Enum.take_while(in_args, &(not is_list(&1)))
      {slots, st} = Enum.map_reduce(inputs, st, &lower_node/2)
      slots = List.to_tuple(slots)

      bound =
        Map.new(Map.fetch!(st.defaults, id), fn {param, pos} -> {param, elem(slots, pos)} end)

      {default, %{st | memo: Map.merge(st.memo, bound)}}
    end

    defp unless_bounds_checked(op) do
      if Emily.Debug.bounds_check?(), do: throw({:unsupported, {:debug_bounds_check, op}})
    end

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
