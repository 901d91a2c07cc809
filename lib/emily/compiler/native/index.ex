if Code.ensure_loaded?(Nx) do
  defmodule Emily.Compiler.Native.Index do
    @moduledoc false
    # The ops that read or write elements by position, lowered to program instructions
    # (see Emily.Compiler.Native.Ops): slices and put_slice with tensor starts,
    # gather, the indexed ops and the take blocks, argmax/argmin, sorts and the
    # cumulative blocks, window reductions and scatters, reduce with one op for a
    # function, and convolutions; each with the casts and MLX ops Emily.Backend uses.

    alias Nx.Defn.Expr
    alias Nx.Tensor, as: T
    alias Emily.Backend.Compose
    alias Emily.Compiler.Native.{Control, Ops}

    import Emily.Compiler.Native,
      only: [
        lower_node: 2,
        emit: 3,
        operand: 3,
        typed: 2,
        constant_value: 2,
        axes: 2,
        composed: 1
      ]

    @arg_reduce Emily.Backend.Ops.arg_reduce()
    @scatter Emily.Backend.Ops.scatter()
    @scan Emily.Backend.Ops.scan()
    @take Emily.Backend.Ops.take()
    @window Emily.Backend.Ops.window()
    @reduce_funs Emily.Backend.Ops.reduce_funs()

    @doc false
    # Start indices that read an input stay on the device, where the op clamps them as
    # Nx does.
    def lower_op(:slice, [x, starts, lengths, strides], _t, st) do
      {slot, st} = lower_node(x, st)

      case known_starts(starts, st) do
        {:ok, starts, st} ->
          {starts, stops} = Emily.Backend.Ops.slice_bounds(x.shape, starts, lengths)
          emit(st, :slice, [slot, starts, stops, strides])

        {:dynamic, starts, st} ->
          {starts, axes, st} = dynamic_starts(starts, st)
          emit(st, :slice_dynamic, [slot, starts, axes, lengths, strides])
      end
    end

    def lower_op(op, [x, opts], %T{type: type, shape: shape}, st)
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

    def lower_op(op, [x, window, opts], %T{type: type}, st) when op in @window do
      {x, st} = operand(x, type, st)
      emit(st, op, [x | Emily.Backend.Ops.window_args(window, opts)])
    end

    # A reduce whose function is one Nx op on its two arguments, and the same over
    # windows, as Emily.Backend computes them (Compose.reduce/7, Compose.window_reduce/7).
    def lower_op(:reduce, [x, acc, opts, fun], %T{type: type}, st) do
      ops = reduce_fun(fun, :reduce)
      axes = axes(x, opts[:axes])
      {[x, acc], st} = typed([x, acc], st)
      composed(Compose.reduce({Ops, st}, ops, x, acc, axes, opts[:keep_axes] || false, type))
    end

    def lower_op(:window_reduce, [x, acc, window, opts, fun], %T{type: type}, st) do
      ops = reduce_fun(fun, :window_reduce)
      {[x, acc], st} = typed([x, acc], st)
      composed(Compose.window_reduce({Ops, st}, ops, x, acc, window, opts, type))
    end

    # As Emily.Backend's (Compose.window_scatter/9).
    def lower_op(op, [x, source, init, window, opts], %T{type: type}, st)
        when op in [:window_scatter_max, :window_scatter_min] do
      {[typed_x, source, init], st} = typed([x, source, init], st)
      b = {Ops, st}
      composed(Compose.window_scatter(b, op, typed_x, source, init, window, opts, x.shape, type))
    end

    # (Emily.Backend computes a complex convolution as four real ones: not lowered.)
    def lower_op(:conv, [x, kernel, opts], %T{type: type}, st) when elem(type, 0) != :c do
      {x, st} = operand(x, type, st)
      {w, st} = operand(kernel, type, st)
      emit(st, :conv, [x, w | Emily.Backend.Ops.conv_args(opts)])
    end

    def lower_op(op, [x, opts], %T{type: type}, st) when op in [:sort, :argsort] do
      {slot, st} = lower_node(x, st)
      {y, st} = emit(st, op, [slot, opts[:axis], opts[:direction] == :desc])
      if op == :argsort, do: emit(st, :astype, [y, type]), else: {y, st}
    end

    def lower_op(:put_slice, [x, starts, update], %T{type: type, shape: shape}, st) do
      {slot, st} = operand(x, type, st)

      if Nx.size(update.shape) == 0 do
        {slot, st}
      else
        {u, st} = operand(update, type, st)
        put_slice(st, {slot, shape}, {u, update.shape}, starts)
      end
    end

    # Indices run as Emily.Backend runs them without :debug_bounds_check (reads clamp,
    # out-of-range writes drop); with it, the backend checks them on the host between
    # ops, which a program cannot.
    def lower_op(:gather, [x, indices, opts], _t, st) do
      unless_bounds_checked(:gather)
      {x, st} = lower_node(x, st)
      {i, st} = lower_node(indices, st)
      emit(st, :gather, [x, i, opts[:axes]])
    end

    def lower_op(op, [x, indices, updates, opts], %T{type: type}, st)
        when is_map_key(@scatter, op) do
      unless_bounds_checked(op)
      {x, st} = operand(x, type, st)
      {i, st} = lower_node(indices, st)
      {u, st} = operand(updates, type, st)
      emit(st, Map.fetch!(@scatter, op), [x, i, u, opts[:axes]])
    end

    def lower_op(:block, [%struct{axis: axis}, [x, indices], _default, _fun], _t, st)
        when is_map_key(@take, struct) do
      op = Map.fetch!(@take, struct)
      unless_bounds_checked(op)
      {x, st} = lower_node(x, st)
      {i, st} = lower_node(indices, st)
      emit(st, op, [x, i, axis])
    end

    # As Emily.Backend's (Compose.scan/6).
    def lower_op(:block, [%struct{axis: axis, reverse: reverse}, [x], _default, _fun], t, st)
        when is_map_key(@scan, struct) do
      {[x], st} = typed([x], st)
      composed(Compose.scan({Ops, st}, Map.fetch!(@scan, struct), x, axis, reverse, t.type))
    end

    # A take or cumulative block of another form: its default.
    def lower_op(:block, args, t, st), do: Control.lower_op(:block, args, t, st)

    def lower_op(op, _args, _t, _st), do: throw({:unsupported, {:op, op}})

    # The ops of a reduce's function that is one of Emily.Backend.Ops.reduce_funs/0 on
    # its two parameters; any other function is not lowered.
    defp reduce_fun(%T{data: %Expr{op: :fun, args: [[a, b], body, _mfa]}}, op) do
      case body do
        %T{data: %Expr{op: fun, args: [x, y]}} when is_map_key(@reduce_funs, fun) ->
          if Enum.sort([id(x), id(y)]) == Enum.sort([id(a), id(b)]),
            do: Map.fetch!(@reduce_funs, fun),
            else: throw({:unsupported, {op, :function}})

        _ ->
          throw({:unsupported, {op, :function}})
      end
    end

    defp id(%T{data: %Expr{id: id}}), do: id

    @doc false
    # The update slot `u` (of `upd_shape`, not empty) written into slot `x` (of `shape`)
    # at Nx's `starts` (integers or scalar tensors, clamped as Nx clamps them).
    def put_slice(st, {x, shape}, {u, upd_shape}, starts) do
      case known_starts(starts, st) do
        {:ok, starts, st} ->
          lengths = Tuple.to_list(upd_shape)
          {starts, stops} = Emily.Backend.Ops.slice_bounds(shape, starts, lengths)
          ones = List.duplicate(1, tuple_size(shape))
          emit(st, :slice_update, [x, u, starts, stops, ones])

        {:dynamic, starts, st} ->
          {starts, axes, st} = dynamic_starts(starts, st)
          emit(st, :slice_update_dynamic, [x, u, starts, axes])
      end
    end

    @doc false
    # As put_slice/4 for an update `u` whose index along `axis` stands for `repeats`
    # consecutive indices of x's (each head of a grouped-query key for the query heads it
    # serves), covering that axis: one instruction that reads `u` unrepeated (on a CUDA
    # GPU one kernel, in place where x's buffer can be donated), whether the starts are
    # known or computed.
    def put_slice_repeated(st, x, u, starts, axis, repeats) do
      {_known_or_dynamic, starts, st} = known_starts(starts, st)
      {starts, axes, st} = dynamic_starts(starts, st)
      emit(st, :slice_update_repeated, [x, u, starts, axes, axis, repeats])
    end

    # Start indices as numbers, where each is a number or a tensor computed from
    # constants alone (an unrolled loop's counter): computed now. Where one reads an
    # input, `{:dynamic, starts, st}`: those computed now as numbers, the rest tensors.
    defp known_starts(starts, st) do
      {starts, st} =
        Enum.map_reduce(starts, st, fn
          i, st when is_integer(i) ->
            {i, st}

          %T{} = t, st ->
            {slot, st} = lower_node(t, st)

            if MapSet.member?(st.const, slot) do
              {value, st} = constant_value(slot, st)
              {hd(Emily.to_list(value)), st}
            else
              {t, st}
            end
        end)

      if Enum.all?(starts, &is_integer/1), do: {:ok, starts, st}, else: {:dynamic, starts, st}
    end

    # The start indices as one s64 vector, with the axes it gives starts for: where some
    # start is a tensor and every integer one is 0, only the tensor starts (the op starts
    # unlisted axes at 0), so that a decoding step's `[0, offset, 0, 0]` is the offset
    # alone; otherwise all.
    defp dynamic_starts(starts, st) do
      if Enum.any?(starts, &(not is_integer(&1))) and
           Enum.all?(starts, &(&1 == 0 or not is_integer(&1))) do
        indexed = for {i, axis} <- Enum.with_index(starts), not is_integer(i), do: {i, axis}
        {vector, st} = starts_vector(Enum.map(indexed, &elem(&1, 0)), st)
        {vector, Enum.map(indexed, &elem(&1, 1)), st}
      else
        {vector, st} = starts_vector(starts, st)
        {vector, Enum.to_list(0..(length(starts) - 1)//1), st}
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

      case parts do
        [one] -> {one, st}
        parts -> emit(st, :concatenate, [parts, 0])
      end
    end

    defp unless_bounds_checked(op) do
      if Emily.Debug.bounds_check?(), do: throw({:unsupported, {:debug_bounds_check, op}})
    end
  end
end
