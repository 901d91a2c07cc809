if Code.ensure_loaded?(Nx) do
  defmodule Emily.Compiler.Native.Ops do
    @moduledoc false
    # How each Nx op of an `Nx.Defn.Expr` graph lowers to program instructions (see
    # Emily.Compiler.Native), with the casts and the MLX ops Emily.Backend uses for it:
    # creation, elementwise ops and casts, shapes, dot and reductions, FFTs, and the
    # blocks with a kernel. The ops that address elements by position go to
    # Emily.Compiler.Native.Index; loops, conditionals and blocks' defaults to
    # Emily.Compiler.Native.Control.

    alias Nx.Tensor, as: T
    alias Emily.Backend.Compose
    alias Emily.Compiler.Native.{Control, Index}

    @behaviour Compose

    import Emily.Compiler.Native,
      only: [lower_node: 2, emit: 3, operand: 3, typed: 2, checked: 4, axes: 2, composed: 1]

    @unary Emily.Backend.Ops.unary()
    @f64_imprecise Emily.Backend.Ops.f64_imprecise()

    @binary Emily.Backend.Ops.arith()

    @compare Emily.Backend.Ops.compare()

    @logical Emily.Backend.Ops.logical()
    @classify Emily.Backend.Ops.classify()
    @reduce Emily.Backend.Ops.reduce()

    # Shape ops of a tensor and a list of axes.
    @axes_ops %{squeeze: :squeeze, transpose: :transpose, reverse: :flip}

    @scan Emily.Backend.Ops.scan()
    @take Emily.Backend.Ops.take()

    # What Emily.Compiler.Native.Index lowers.
    @index_ops [:slice, :put_slice, :gather, :indexed_add, :indexed_put, :argmax, :argmin] ++
                 [:sort, :argsort | Emily.Backend.Ops.window()] ++
                 [:window_scatter_max, :window_scatter_min, :reduce, :window_reduce, :conv]

    # What Emily.Compiler.Native.Control lowers (besides blocks without a kernel).
    @control [:block, :while, :cond, :elem, :runtime_call, :triangular_solve, :attach_token] ++
               Emily.Compiler.Native.Hooks.ops()

    @kernel_blocks Map.new(
                     for mod <- [Emily.Fast, Emily.Quantization, Emily.Distributed],
                         struct <- mod.blocks(),
                         do: {struct, mod}
                   )

    # The linear algebra blocks lowered on the CPU: Native op and its arguments after
    # the tensors.
    @linalg %{
      Nx.Block.LinAlg.Cholesky => {:cholesky, [false]},
      Nx.Block.LinAlg.Solve => {:solve, []},
      Nx.Block.LinAlg.Determinant => {:det, []}
    }

    # Integers beyond this do not survive the op table's `float` argument exactly.
    @max_exact 9_007_199_254_740_992

    @doc false
    def lower_op(:parameter, [i], _t, st), do: {i, st}
    def lower_op(:metadata, [expr, _meta], _t, st), do: lower_node(expr, st)

    # An integer beyond what a double holds exactly: as Nx writes it into its type, its
    # two's complement bits cut to the type's width (Nx types a literal as s32 by
    # default); 64 bits are built from their two 32-bit halves.
    def lower_op(:constant, [v], %T{type: {kind, bits} = type, shape: shape}, st)
        when is_integer(v) and abs(v) >= @max_exact and kind in [:s, :u] do
      wrapped = Bitwise.band(v, Bitwise.bsl(1, bits) - 1)

      {x, st} =
        if bits < 64 do
          signed =
            if kind == :s and wrapped >= Bitwise.bsl(1, bits - 1),
              do: wrapped - Bitwise.bsl(1, bits),
              else: wrapped

          emit(st, :full, [{}, signed, type])
        else
          {hi, st} = emit(st, :full, [{}, Bitwise.bsr(wrapped, 32), {:u, 64}])
          {shift, st} = emit(st, :full, [{}, 32, {:u, 64}])
          {hi, st} = emit(st, :left_shift, [hi, shift])
          {lo, st} = emit(st, :full, [{}, Bitwise.band(wrapped, 0xFFFF_FFFF), {:u, 64}])
          {x, st} = emit(st, :bitwise_or, [hi, lo])
          if kind == :s, do: emit(st, :view, [x, type]), else: {x, st}
        end

      emit(st, :broadcast_to, [x, shape])
    end

    # A complex constant: a complex scalar (`scalar/3`), broadcast.
    def lower_op(:constant, [value], %T{type: {:c, _} = type, shape: shape}, st) do
      {c, st} = scalar(st, value, type)
      emit(st, :broadcast_to, [c, shape])
    end

    def lower_op(:constant, [value], %T{type: type, shape: shape}, st) do
      emit(st, :full, [shape, real_constant(value), type])
    end

    def lower_op(:iota, [axis], %T{type: type, shape: shape}, st),
      do: composed(Compose.iota({__MODULE__, st}, shape, axis, type))

    # (On f64, those MLX computes with f32 accuracy run on the evaluator path, where
    # Emily.Backend computes them on Nx.BinaryBackend.)
    def lower_op(op, [_x], %T{type: {:f, 64}}, _st) when op in @f64_imprecise,
      do: throw({:unsupported, {:f64_imprecise, op}})

    def lower_op(op, [x], %T{type: type}, st) when is_map_key(@unary, op) do
      {x, st} = operand(x, type, st)
      emit(st, Map.fetch!(@unary, op), [x])
    end

    def lower_op(:abs, [%T{type: {:u, _}} = x], _t, st), do: lower_node(x, st)

    def lower_op(:abs, [x], %T{type: type}, st) do
      {x, st} = if match?({:c, _}, x.type), do: lower_node(x, st), else: operand(x, type, st)
      emit(st, :abs, [x])
    end

    # Complex parts, as Emily.Backend's: a real tensor is its own real part, and its
    # imaginary part is zero.
    def lower_op(:real, [%T{type: {:c, _}} = x], _t, st) do
      {x, st} = lower_node(x, st)
      emit(st, :real, [x])
    end

    def lower_op(:real, [x], %T{type: type}, st), do: operand(x, type, st)

    def lower_op(:imag, [%T{type: {:c, _}} = x], _t, st) do
      {x, st} = lower_node(x, st)
      emit(st, :imag, [x])
    end

    def lower_op(:imag, [_x], %T{type: type, shape: shape}, st),
      do: emit(st, :full, [shape, 0, type])

    def lower_op(:conjugate, [x], %T{type: type}, st) do
      {x, st} = operand(x, type, st)
      emit(st, :conjugate, [x])
    end

    # As Emily.Backend's: MLX's transform, then, with Nx's `:eps`, each component within
    # it of zero set to zero (Compose.clean_transform/4).
    def lower_op(op, [x, opts], %T{type: {:c, _} = type}, st) when op in [:fft, :ifft] do
      {x, st} = operand(x, type, st)
      {y, st} = emit(st, op, [x, opts[:length], opts[:axis]])
      composed(Compose.clean_transform({__MODULE__, st}, y, type, opts[:eps]))
    end

    def lower_op(:bitcast, [x], %T{type: type}, st) do
      {x, st} = lower_node(x, st)
      emit(st, :view, [x, type])
    end

    # As Emily.Backend's: on the CPU, Nx.BinaryBackend's formula (Compose.erf_inv/3); on
    # a GPU, MLX's erfinv.
    def lower_op(:erf_inv, [x], %T{type: type}, %{device: :cpu} = st) do
      {z, st} = operand(x, {:f, 64}, st)
      composed(Compose.erf_inv({__MODULE__, st}, z, type))
    end

    def lower_op(:erf_inv, [x], %T{type: type}, st) do
      {x, st} = operand(x, type, st)
      emit(st, :erfinv, [x])
    end

    def lower_op(op, [x], %T{type: type}, st) when op in [:ceil, :floor] do
      {x, st} = operand(x, type, st)

      case type do
        {k, _} when k in [:u, :s] -> {x, st}
        _ -> emit(st, op, [x])
      end
    end

    def lower_op(op, [x], %T{type: type, shape: shape}, st) when is_map_key(@classify, op) do
      {[x], st} = typed([x], st)
      composed(Compose.classify({__MODULE__, st}, Map.fetch!(@classify, op), x, type, shape))
    end

    def lower_op(op, [l, r], %T{type: type}, st) when is_map_key(@binary, op) do
      {l, st} = operand(l, type, st)
      {r, st} = operand(r, type, st)
      emit(st, Map.fetch!(@binary, op), [l, r])
    end

    def lower_op(op, [l, r], %T{type: type}, st) when is_map_key(@compare, op),
      do: compared(Map.fetch!(@compare, op), l, r, type, st)

    def lower_op(op, [l, r], %T{type: type}, st) when is_map_key(@logical, op),
      do: logical(Map.fetch!(@logical, op), [l, r], type, st)

    # Nx's float to integer cast (Compose.cast/4; from complex, of the real part). A
    # complex to float cast keeps the real part (MLX's astype, below, as Emily.Backend's).
    def lower_op(:as_type, [%T{type: {fk, _} = from} = x], %T{type: {tk, _} = to}, st)
        when fk in [:f, :bf, :c] and tk in [:u, :s] do
      {x, st} = lower_node(x, st)
      composed(Compose.cast({__MODULE__, st}, x, from, to))
    end

    def lower_op(:as_type, [x], %T{type: to}, st), do: operand(x, to, st)

    def lower_op(:reshape, [x], %T{shape: shape}, st) do
      {x, st} = lower_node(x, st)
      emit(st, :reshape, [x, shape])
    end

    def lower_op(op, [x, axes], _t, st) when is_map_key(@axes_ops, op) do
      {x, st} = lower_node(x, st)
      emit(st, Map.fetch!(@axes_ops, op), [x, axes])
    end

    def lower_op(:broadcast, [x, shape, axes], %T{type: type}, st) do
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

    def lower_op(:dot, [l, cl, bl, r, cr, br], %T{type: type} = t, st) do
      {l, st} = operand(l, type, st)
      {r, st} = operand(r, type, st)
      {slot, st} = emit(st, :dot, [l, cl, bl, r, cr, br])
      # (Each product's result, for Native.Siblings' report.)
      st = %{st | dots: Map.put(st.dots, slot, {t.shape, t.type})}
      {slot, checked(st, :dot, slot, t)}
    end

    def lower_op(op, [x, opts], %T{type: type}, st) when is_map_key(@reduce, op) do
      {slot, st} = operand(x, type, st)
      emit(st, Map.fetch!(@reduce, op), [slot, axes(x, opts[:axes]), opts[:keep_axes] || false])
    end

    def lower_op(op, [x, opts], %T{type: type}, st) when op in [:all, :any] do
      {slot, st} = lower_node(x, st)
      args = [slot, axes(x, opts[:axes]), opts[:keep_axes] || false]
      composed(Compose.op_as({__MODULE__, st}, op, args, type))
    end

    def lower_op(:select, [pred, on_true, on_false], %T{type: type}, st) do
      {p, st} = predicate(pred, st)
      {a, st} = operand(on_true, type, st)
      {b, st} = operand(on_false, type, st)
      emit(st, :where, [p, a, b])
    end

    def lower_op(:clip, [x, lo, hi], %T{type: type}, st) do
      {x, st} = operand(x, type, st)
      {lo, st} = operand(lo, type, st)
      {hi, st} = operand(hi, type, st)
      emit(st, :clip, [x, lo, hi])
    end

    # Indexing, orderings, scans, windows and convolutions: Emily.Compiler.Native.Index.
    def lower_op(op, args, t, st) when op in @index_ops, do: Index.lower_op(op, args, t, st)

    def lower_op(:block, [%struct{} | _] = args, t, st)
        when is_map_key(@take, struct) or is_map_key(@scan, struct),
        do: Index.lower_op(:block, args, t, st)

    def lower_op(:concatenate, [tensors, axis], %T{type: type}, st) do
      {slots, st} = Enum.map_reduce(tensors, st, &operand(&1, type, &2))
      emit(st, :concatenate, [slots, axis])
    end

    def lower_op(:stack, [tensors, axis], %T{type: type}, st) do
      {slots, st} = Enum.map_reduce(tensors, st, &operand(&1, type, &2))
      emit(st, :stack, [slots, axis])
    end

    def lower_op(:eye, [], %T{type: type, shape: shape}, st) do
      rank = tuple_size(shape)
      {x, st} = emit(st, :eye, [elem(shape, rank - 2), elem(shape, rank - 1), 0, type])
      if rank > 2, do: emit(st, :broadcast_to, [x, shape]), else: {x, st}
    end

    def lower_op(:pad, [x, value, config], %T{type: type}, st) do
      {x, st} = operand(x, type, st)
      {v, st} = operand(value, type, st)
      [lo, hi, interior] = for i <- 0..2, do: Enum.map(config, &elem(&1, i))
      emit(st, :pad, [x, v, lo, hi, interior])
    end

    def lower_op(:block, [%Nx.Block.LogicalNot{}, [x], _default, _fun], t, st),
      do: logical(:logical_not, [x], t.type, st)

    # Linear algebra as Emily.Backend computes it, LAPACK through MLX (on the CPU only:
    # a GPU program cannot hold it) in the input's real type: Cholesky, solve, and the
    # determinant of up to 3x3 (MLX's closed forms, as Nx's). The others run on the
    # host (Emily.Compiler.Native.Control).
    def lower_op(:block, [%struct{}, [a | _] = args, _default, _fun], %T{type: type} = t, st)
        when is_map_key(@linalg, struct) and st.device == :cpu and
               elem(a.type, 0) == :f and elem(a.type, 1) in [32, 64] do
      {op, extra} = Map.fetch!(@linalg, struct)

      if (struct == Nx.Block.LinAlg.Determinant and elem(a.shape, tuple_size(a.shape) - 1) > 3) or
           Enum.any?(args, &(&1.type != a.type)) do
        Control.lower_op(:block, t.data.args, t, st)
      else
        {slots, st} = Enum.map_reduce(args, st, &lower_node/2)
        {y, st} = emit(st, op, slots ++ extra)
        emit(st, :astype, [y, type])
      end
    end

    # A collective whose backend runs on another device than the program's (a ring
    # collective in a GPU program) runs on the host, where Emily.Distributed picks a
    # stream of its backend's device: MLX aborts on a ring collective on a GPU stream.
    @collectives Emily.Distributed.blocks()
    def lower_op(:block, [%struct{group: %{backend: backend}} | _], t, st)
        when struct in @collectives and backend != nil and
               backend == :nccl != (st.device == :gpu),
        do: Control.host_block(t, st)

    # The blocks of Emily.Fast, Emily.Quantization and Emily.Distributed lower to the MLX
    # op their module's native_call/3 names, with the casts of its arguments, or, where
    # it names none, to their default.
    def lower_op(:block, [%struct{} = block, in_args, _default, _fun], t, st)
        when is_map_key(@kernel_blocks, struct) do
      case @kernel_blocks[struct].native_call(block, t, in_args) do
        nil ->
          Control.lower_op(:block, t.data.args, t, st)

        {op, spec} ->
          inputs = List.to_tuple(in_args)

          {args, st} =
            Enum.map_reduce(spec, st, fn
              {:arg, i, type}, st -> operand(elem(inputs, i), type, st)
              other, st -> {other, st}
            end)

          {slot, st} = emit(st, op, args)
          {slot, if(match?(%T{}, t), do: checked(st, op, slot, t), else: st)}
      end
    end

    def lower_op(op, args, t, st) when op in @control, do: Control.lower_op(op, args, t, st)

    def lower_op(op, _args, _t, _st), do: throw({:unsupported, {:op, op}})

    # A predicate (a select's, a logical op's operand) as MLX's bool. A comparison's or
    # logical op's own bool result is read through its cast to Nx's u8 (emit/3 drops
    # the cast back, and the program drops the unread cast).
    defp predicate(x, st), do: operand(x, :bool, st)

    # A comparison (`name`, MLX's) of two nodes, as `type` (Compose.compare/5).
    defp compared(name, l, r, type, st) do
      {[l, r], st} = typed([l, r], st)
      composed(Compose.compare({__MODULE__, st}, name, l, r, type))
    end

    # A logical op (`name`, MLX's) of nodes read as predicates, as `type`
    # (Compose.logical/4).
    defp logical(name, nodes, type, st) do
      {args, st} =
        Enum.map_reduce(nodes, st, fn x, st ->
          {slot, st} = predicate(x, st)
          {{slot, :bool}, st}
        end)

      composed(Compose.logical({__MODULE__, st}, name, args, type))
    end

    # Emily.Backend.Compose's builder for programs: each op an instruction, each scalar a
    # `full` (exact where a double holds the value, as the op table's float argument is;
    # a complex one from its parts), each limit as below.
    @impl Compose
    def op(st, name, args), do: emit(st, name, args)

    # A complex scalar: its two parts as floats, read as one complex number (exact,
    # infinities and NaN included, as no arithmetic touches them).
    @impl Compose
    def scalar(st, value, {:c, bits} = type) do
      real = {:f, div(bits, 2)}

      {parts, st} =
        Enum.map_reduce(complex_parts(value), st, &emit(&2, :full, [{1}, &1, real]))

      {parts, st} = emit(st, :concatenate, [parts, 0])
      {c, st} = emit(st, :view, [parts, type])
      emit(st, :reshape, [c, {}])
    end

    def scalar(st, value, type), do: emit(st, :full, [{}, real_constant(value), type])

    # An integer type's limit as a scalar; the 64-bit ones, which a double does not hold
    # exactly, from bit operations (computed once, when constants are folded).
    @impl Compose
    def limit(st, :min, {:u, _} = type), do: emit(st, :full, [{}, 0, type])

    def limit(st, :max, {:u, 64} = type) do
      {zero, st} = limit(st, :min, type)
      emit(st, :bitwise_invert, [zero])
    end

    def limit(st, :max, {:u, bits} = type), do: emit(st, :full, [{}, 2 ** bits - 1, type])

    def limit(st, :min, {:s, 64} = type) do
      {one, st} = emit(st, :full, [{}, 1, type])
      {shift, st} = emit(st, :full, [{}, 63, type])
      emit(st, :left_shift, [one, shift])
    end

    def limit(st, :max, {:s, 64} = type) do
      {min, st} = limit(st, :min, type)
      emit(st, :bitwise_invert, [min])
    end

    def limit(st, :min, {:s, bits} = type),
      do: emit(st, :full, [{}, -(2 ** (bits - 1)), type])

    def limit(st, :max, {:s, bits} = type),
      do: emit(st, :full, [{}, 2 ** (bits - 1) - 1, type])

    defp real_constant(v) when is_integer(v) and abs(v) < @max_exact, do: v
    defp real_constant(v) when is_float(v) or v in [:nan, :infinity, :neg_infinity], do: v
    defp real_constant(v), do: throw({:unsupported, {:constant, v}})

    defp complex_parts(%Complex{re: re, im: im}), do: [real_constant(re), real_constant(im)]
    defp complex_parts(v), do: [real_constant(v), 0]
  end
end
