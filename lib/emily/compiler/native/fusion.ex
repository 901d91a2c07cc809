if Code.ensure_loaded?(Nx) do
  defmodule Emily.Compiler.Native.Fusion do
    @moduledoc false
    # Rewrites of the native path (Emily.Compiler.Native): subgraphs that compute RMS
    # norm, layer norm, rotary embeddings or scaled dot-product attention as chains of
    # Nx ops, in the exact form Bumblebee's and Axon's layers write them, lowered to
    # MLX's fused kernel for that function (the ops Emily.Fast's blocks lower to); Axon's
    # gelu, and its silu alone or gating another product (a gated unit's
    # `up * silu(gate)`), each lowered to one kernel of the same ops (cpp/kernels.h);
    # Axon's dense layer, its bias added inside the product; and a cache update of
    # repeated heads, written unrepeated. A node
    # is rewritten when it is the root of such a subgraph, matched on its ops, arguments
    # and shapes; the nodes inside are then not lowered (unless something else reads
    # them, which lowers them as usual).
    #
    # A rewrite fires only where the kernel computes the graph's function: the same
    # reduction axis (the last) and divisor (its size: a mean, a biased variance), the
    # same epsilon added at the same place, the same additive mask, the same scale, the
    # same result type, and the same casts around the kernel. MLX's kernels compute
    # their statistics and the softmax in f32: a graph that computes them in f32 gets
    # the same values up to rounding; one that computes them in f16 or bf16 gets the
    # more precise result (the kernel never computes in a narrower type than the graph).
    # Anything else (another axis or divisor, epsilon outside the square root, a mask
    # that replaces scores rather than adding to them, a lossy cast of the input before
    # the statistics, f64, vectorized tensors) is not matched and lowers op by op.

    alias Nx.Tensor, as: T
    alias Nx.Defn.Expr
    alias Emily.Compiler.Native.Index

    import Emily.Compiler.Native, only: [emit: 3, operand: 3, lower_node: 2, constant_value: 2]

    @kernel_types [{:f, 16}, {:bf, 16}, {:f, 32}]

    # The rewrites, by the names the report gives them: the `:fuse` option's words.
    @rewrites [:rms_norm, :layer_norm, :rope, :scaled_dot_product_attention, :gelu, :silu] ++
                [:dense, :sliced_dot, :repeated_update, :dots]

    @doc false
    def rewrites, do: @rewrites

    @doc false
    # The slot of `t` lowered to a fused kernel, with the rewrite recorded in
    # `st.fused`; nil where no rewrite matches `t`.
    def rewrite(%T{data: %Expr{op: op}} = t, st)
        when op in [:multiply, :add, :dot, :divide, :slice, :put_slice] do
      # (A build may still decline, on values it computes: nil.)
      with {info, build} <- match(t),
           true <- MapSet.member?(st.fuse, info.rewrite),
           {_slot, _st} = built <- build.(st) do
        record(built, Map.put(info, :shape, t.shape), t)
      else
        _ -> nil
      end
    end

    def rewrite(_t, _st), do: nil

    @doc false
    # The rewrites the lowering may make, a set (the compiler's `:fuse` option: `true`,
    # the default, all; `false` none; a list of names, those; `except: names`, all but
    # those). None under :debug_detect_nan_inf, whose checks follow the ops
    # Emily.Backend runs.
    def enabled(opts) do
      allowed =
        case Keyword.get(opts, :fuse, true) do
          true -> @rewrites
          false -> []
          [except: names] = given -> @rewrites -- known!(names, given)
          names when is_list(names) -> known!(names, names)
          other -> raise ArgumentError, "Emily.Compiler's :fuse #{bad(other)}"
        end

      if Emily.Debug.detect_nan_inf?(), do: MapSet.new(), else: MapSet.new(allowed)
    end

    defp known!(names, given) do
      case Enum.reject(List.wrap(names), &(&1 in @rewrites)) do
        [] ->
          List.wrap(names)

        unknown ->
          raise ArgumentError,
                "Emily.Compiler's :fuse names no rewrite #{inspect(unknown)}; it #{bad(given)}"
      end
    end

    defp bad(given) do
      "takes true, false, a list of rewrites or except: a list of rewrites (the rewrites: " <>
        "#{inspect(@rewrites)}), got: #{inspect(given)}"
    end

    @telemetry? Code.ensure_loaded?(:telemetry)
    @collect {__MODULE__, :collect}

    @doc false
    # Reports the rewrites one program's lowering made (in order): the
    # `[:emily, :compiler, :fusion]` event, and the list `collect/1` gathers.
    def report([]), do: :ok

    def report(fused) do
      if @telemetry? do
        :telemetry.execute([:emily, :compiler, :fusion], %{count: length(fused)}, %{
          rewrites: fused
        })
      end

      case Process.get(@collect) do
        nil -> :ok
        acc -> Process.put(@collect, [fused | acc])
      end

      :ok
    end

    @doc false
    # The rewrites the lowerings `fun` runs make, in order, with what `fun` returns.
    def collect(fun) do
      previous = Process.put(@collect, [])

      try do
        result = fun.()
        {result, @collect |> Process.get() |> Enum.reverse() |> Enum.concat()}
      after
        if previous, do: Process.put(@collect, previous), else: Process.delete(@collect)
      end
    end

    defp record({slot, st}, info, %T{type: type}),
      do: {slot, %{st | fused: [Map.put(info, :type, type) | st.fused]}}

    defp match(%T{vectorized_axes: [_ | _]}), do: nil
    defp match(%T{shape: {}}), do: nil
    defp match(%T{data: %Expr{op: :put_slice}} = t), do: repeated_update(t)
    defp match(%T{type: type}) when type not in @kernel_types, do: nil

    defp match(%T{data: %Expr{op: :dot}} = t), do: attention(t)

    # (A layer norm without weight and bias is also the RMS norm of the centered input:
    # the layer norm kernel takes the centering too.)
    defp match(%T{data: %Expr{op: :multiply}} = t), do: layer_norm(t) || rms_norm(t) || silu(t)

    defp match(%T{data: %Expr{op: :add}} = t), do: layer_norm(t) || rope(t) || dense(t)

    defp match(%T{data: %Expr{op: :divide}} = t), do: gelu(t)

    defp match(%T{data: %Expr{op: :slice}} = t), do: sliced_dot(t)

    ## RMS norm

    # `x * rsqrt(mean(x², -1) + eps)`, cast or not, times a weight vector or not:
    # Bumblebee's rms_norm (either upcast mode: the input cast to f32, or input and
    # weight) and Emily.Fast's composition. MLX computes the normalized value in f32,
    # casts it to the result type, then multiplies by the weight in that type.
    defp rms_norm(%T{shape: shape, type: type, data: %Expr{args: [l, r]}} = t) do
      h = last(shape)

      weighted =
        Enum.find_value([{l, r}, {r, l}], fn {a, w} ->
          with %T{shape: {^h}, type: {k, _}} when k in [:f, :bf] <- w,
               %T{type: ^type} <- a,
               {x0, eps} <- rms_normalized(strip_cast(a), type, shape) do
            {x0, w, eps}
          else
            _ -> nil
          end
        end)

      case weighted || rms_unweighted(t, type, shape) do
        {x0, w, eps} ->
          build = fn st ->
            {x, st} = operand(x0, type, st)
            {w, st} = if w, do: operand(w, type, st), else: {nil, st}
            emit(st, :rms_norm, [x, w, eps])
          end

          {%{rewrite: :rms_norm, eps: eps, weight: w != nil}, build}

        nil ->
          nil
      end
    end

    defp rms_unweighted(t, type, shape) do
      case rms_normalized({t, type}, type, shape) do
        {x0, eps} -> {x0, nil, eps}
        nil -> nil
      end
    end

    # `m = x * rsqrt(mean(x * x) + eps)` (`{m, type before a cast}`) whose result cast
    # to `type` is what MLX's kernel gives for the input `x0`: the input before an
    # upcast that keeps it exactly.
    defp rms_normalized({m, _}, type, shape) do
      with %T{shape: ^shape, type: stats, data: %Expr{op: :multiply, args: [p, q]}} <- m,
           true <- stats in @kernel_types,
           {x, eps} <-
             Enum.find_value([{p, q}, {q, p}], fn {x, rs} ->
               with %T{shape: ^shape, type: ^stats} <- x,
                    {:ok, eps, inner} <- rsqrt_eps(rs),
                    true <- mean_last?(inner, x, &square_of?(&1, x)) do
                 {x, eps}
               else
                 _ -> nil
               end
             end),
           {:ok, x0} <- exact_input(x, type) do
        {x0, eps}
      else
        _ -> nil
      end
    end

    # The input the kernel is given for `x` (the tensor the statistics are computed
    # from) with `type` as the result type: x itself, or what x is an upcast of, where
    # casting that to `type` and then to f32 gives x (so the kernel sees the same
    # values). nil where the kernel would see other values.
    defp exact_input(%T{type: xt} = x, type) do
      x0 =
        case strip(x) do
          %T{data: %Expr{op: :as_type, args: [%T{type: from} = x0]}} when from in @kernel_types ->
            x0

          _ ->
            x
        end

      cond do
        x0.type == type -> {:ok, x0}
        type == {:f, 32} and x0.type in @kernel_types -> {:ok, x0}
        xt == type -> {:ok, x}
        true -> nil
      end
    end

    ## Layer norm

    # Axon's layer_norm, `gamma * rsqrt(var(x) + eps) * (x - mean(x)) + beta` (gamma and
    # beta reshaped to `{1, ..., 1, H}`), and the order MLX and Emily.Fast write it in,
    # `(x - mean(x)) * rsqrt(var(x) + eps) * weight + bias`, with or without the weight
    # and the bias. The variance is the biased one (divided by H), as MLX's.
    defp layer_norm(%T{shape: shape, type: type, data: %Expr{op: :add, args: [l, r]}}) do
      Enum.find_value([{l, r}, {r, l}], fn {y, b} ->
        with true <- affine_vector?(b, shape),
             {x0, w, eps} <- ln_product(y, type, shape) do
          ln_build(x0, w, b, eps, type, shape)
        else
          _ -> nil
        end
      end)
    end

    defp layer_norm(%T{shape: shape, type: type} = t) do
      case ln_product(t, type, shape) do
        {x0, w, eps} -> ln_build(x0, w, nil, eps, type, shape)
        nil -> nil
      end
    end

    defp ln_build(x0, w, b, eps, type, shape) do
      h = last(shape)

      build = fn st ->
        {x, st} = operand(x0, type, st)
        {w, st} = vector(w, h, type, st)
        {b, st} = vector(b, h, type, st)
        emit(st, :layer_norm, [x, w, b, eps])
      end

      {%{rewrite: :layer_norm, eps: eps, weight: w != nil, bias: b != nil}, build}
    end

    defp vector(nil, _h, _type, st), do: {nil, st}

    defp vector(v, h, type, st) do
      {slot, st} = operand(v, type, st)
      if v.shape == {h}, do: {slot, st}, else: emit(st, :reshape, [slot, {h}])
    end

    # A product of `x - mean(x)`, `rsqrt(var(x) + eps)` and at most one weight vector,
    # in any order and grouping: `{x0, weight | nil, eps}`.
    defp ln_product(%T{shape: shape, data: %Expr{op: :multiply}} = t, type, shape) do
      factors = factors(t, 2)

      with n when n in [2, 3] <- length(factors),
           {[c], rest} <- Enum.split_with(factors, &centered_input(&1, shape)),
           x = centered_input(c, shape),
           {[rs], rest} <-
             Enum.split_with(rest, &match?({:ok, _, _}, ln_rsqrt(&1, x))),
           {:ok, eps, _} <- ln_rsqrt(rs, x),
           w when w == [] or length(w) == 1 <- rest,
           w = List.first(w),
           true <- w == nil or affine_vector?(w, shape),
           true <- x.type in @kernel_types,
           {:ok, x0} <- exact_input(x, type) do
        {x0, w, eps}
      else
        _ -> nil
      end
    end

    defp ln_product(_t, _type, _shape), do: nil

    # The leaves of a tree of multiplies, `depth` levels at most, not entering the
    # factors a layer norm is made of.
    defp factors(t, depth) do
      case strip(t) do
        %T{data: %Expr{op: :multiply, args: [a, b]}} when depth > 0 ->
          factors(a, depth - 1) ++ factors(b, depth - 1)

        _ ->
          [t]
      end
    end

    # x where `t` is `x - mean(x)` of x's shape; else nil.
    defp centered_input(t, shape) do
      with %T{shape: ^shape, data: %Expr{op: :subtract, args: [x, mean]}} <- strip(t),
           %T{shape: ^shape} <- x,
           true <- mean_last?(mean, x, &same?(&1, x)) do
        x
      else
        _ -> nil
      end
    end

    # `rsqrt(var(x) + eps)`: `{:ok, eps, var}`.
    defp ln_rsqrt(t, x) do
      with {:ok, eps, var} <- rsqrt_eps(t),
           true <- mean_last?(var, x, &centered_square?(&1, x)) do
        {:ok, eps, var}
      else
        _ -> nil
      end
    end

    # `(x - mean(x))²`, as `pow(c, 2)` or `c * c` of one node `c`.
    defp centered_square?(t, x) do
      case strip(t) do
        %T{data: %Expr{op: :pow, args: [c, two]}} ->
          constant(two) == 2 and same?(centered_input(c, x.shape), x)

        %T{data: %Expr{op: :multiply, args: [a, b]}} ->
          same?(a, b) and same?(centered_input(a, x.shape), x)

        _ ->
          false
      end
    end

    # A weight or bias vector as a layer norm takes it: `{H}`, or `{1, ..., 1, H}` of the
    # input's rank (Axon reshapes them so), of a floating type.
    defp affine_vector?(%T{shape: vshape, type: {k, _}} = v, shape)
         when k in [:f, :bf] and v.vectorized_axes == [] and tuple_size(shape) > 0 do
      h = last(shape)
      rank = tuple_size(shape)

      vshape == {h} or
        (tuple_size(vshape) == rank and
           Tuple.to_list(vshape) == List.duplicate(1, rank - 1) ++ [h])
    end

    defp affine_vector?(_v, _shape), do: false

    ## Rotary embedding

    # Bumblebee's apply_rotary_embedding on one position per row (a decoding step):
    # `x * cos + rotate_half(x) * sin` on `[B, 1, heads, D]`, cos and sin the rows of
    # its tables at `position_ids` (`take`, a new axis, a cast to x's type), rotate_half
    # `concatenate([-x[.., D/2..], x[.., ..D/2]])`. MLX's kernel takes positions as
    # offsets, which for one position per row are the positions themselves. The tables
    # are constants: the rewrite fires only where they are `cos` and `sin` of
    # `p * f` for some frequencies `f` (each half of the last axis the same), found
    # from the tables and checked against them within f32's rounding of the angles,
    # and the kernel is given those frequencies (so every scaling strategy whose tables
    # have that form is covered, and one whose tables do not, such as longrope's
    # rescaled ones, is not rewritten). The kernel computes in f32: where the graph
    # multiplies in f16 or bf16 by tables cast to that type, the kernel's result is the
    # more precise one. Prefill (many positions per row, any positions) lowers op by op.
    defp rope(%T{shape: {b, 1, _h, d} = shape, type: type, data: %Expr{args: [l, r]}})
         when rem(d, 2) == 0 do
      Enum.find_value([{l, r}, {r, l}], fn {direct, rotated} ->
        with {x, cos, ids} <- table_product(direct, shape, type),
             {rot, sin, ids2} <- table_product(rotated, shape, type),
             true <- same?(ids, ids2) and rotated_half?(rot, x, d) do
          build = fn st -> rope_build(x, cos, sin, ids, b, d, st) end
          {%{rewrite: :rope, dims: d}, build}
        else
          _ -> nil
        end
      end)
    end

    defp rope(_t), do: nil

    # `y * c` (either order), y of `shape` and `type`, c the rows of a `{P, D}` table at
    # `{B, 1}` positions, as `{B, 1, 1, D}`: `{y, table, position_ids}`.
    defp table_product(t, {b, 1, _, d} = shape, type) do
      with %T{data: %Expr{op: :multiply, args: [p, q]}} <- strip(t) do
        Enum.find_value([{p, q}, {q, p}], fn {y, c} ->
          with %T{shape: ^shape, type: ^type} <- y,
               %T{shape: {^b, 1, 1, ^d}} <- c,
               {:ok, table, ids} <- table_rows(c) do
            {y, table, ids}
          else
            _ -> nil
          end
        end)
      else
        _ -> nil
      end
    end

    defp table_rows(c) do
      rows =
        case strip(c) do
          %T{data: %Expr{op: :as_type, args: [%T{type: {k, _}} = from]}} when k in [:f, :bf] ->
            from

          other ->
            other
        end

      with %T{data: %Expr{op: :reshape, args: [taken]}} <- strip(rows),
           %T{data: %Expr{op: :block, args: [%Nx.Block.Take{axis: 0}, [table, ids], _, _]}} <-
             strip(taken),
           %T{shape: {_, _}, type: {:f, 32}} <- table,
           %T{shape: {_, 1}, type: {k, _}} when k in [:s, :u] <- ids do
        {:ok, table, ids}
      else
        _ -> :error
      end
    end

    # `concatenate([-x[.., h..], x[.., ..h]], -1)`, h = D / 2, slices of the whole rest.
    defp rotated_half?(rot, x, d) do
      h = div(d, 2)

      with %T{data: %Expr{op: :concatenate, args: [[neg, lo], 3]}} <- strip(rot),
           %T{data: %Expr{op: :negate, args: [hi]}} <- strip(neg) do
        half_slice?(hi, x, h) and half_slice?(lo, x, 0)
      else
        _ -> false
      end
    end

    defp half_slice?(t, x, from) do
      {b, l, heads, d} = x.shape

      case strip(t) do
        %T{data: %Expr{op: :slice, args: [y, start, lengths, strides]}} ->
          same?(y, x) and start == [0, 0, 0, from] and
            lengths == [b, l, heads, div(d, 2)] and strides == [1, 1, 1, 1]

        _ ->
          false
      end
    end

    defp rope_build(x, cos, sin, ids, b, d, st) do
      {tc, st} = lower_node(cos, st)
      {ts, st} = lower_node(sin, st)

      with true <- MapSet.member?(st.const, tc) and MapSet.member?(st.const, ts),
           {{:ok, freqs}, st} <- table_frequencies(tc, ts, d, st) do
        {xs, st} = lower_node(x, st)
        {ids, st} = operand(ids, {:s, 32}, st)
        {offsets, st} = emit(st, :reshape, [ids, {b}])
        {periods, st} = constant_vector(Enum.map(freqs, &(1 / &1)), st)
        {heads_first, st} = emit(st, :transpose, [xs, [0, 2, 1, 3]])
        {y, st} = emit(st, :rope_array, [heads_first, d, false, 0.0, 1.0, offsets, periods])
        emit(st, :transpose, [y, [0, 2, 1, 3]])
      else
        _ -> nil
      end
    end

    # rope_frequencies/4 of two constant tables, once per pair of slots: every layer's
    # queries and keys share the same tables.
    defp table_frequencies(tc, ts, d, st) do
      case st.rope_tables do
        %{{^tc, ^ts} => found} ->
          {found, st}

        tables ->
          {cv, st} = constant_value(tc, st)
          {sv, st} = constant_value(ts, st)
          found = rope_frequencies(cv, sv, d, st.device)
          {found, %{st | rope_tables: Map.put(tables, {tc, ts}, found)}}
      end
    end

    # A vector of f32 numbers as constant instructions (folded into one value).
    defp constant_vector(values, st) do
      {slots, st} = Enum.map_reduce(values, st, &emit(&2, :full, [{1}, &1, {:f, 32}]))
      emit(st, :concatenate, [slots, 0])
    end

    # The frequencies f (D / 2 of them) for which the `{P, D}` tables are cos and sin of
    # `p * f`, each half of D the same: estimated from rows 1, 2, 4, ... (the angle at
    # row 2q unwrapped around twice the estimate at q, so each step halves the error),
    # then checked over every row, in f32 as the tables were computed, within a few
    # roundings of the largest angle.
    defp rope_frequencies(cos, sin, d, device) do
      alias Emily.Native, as: N
      s = Emily.Stream.default(device)
      {p, ^d} = Emily.shape(cos)
      h = div(d, 2)
      row = fn t, i -> Emily.to_list(N.slice(s, t, [i, 0], [i + 1, h], [1, 1])) end

      with true <- p >= 2,
           f0 = Enum.zip_with(row.(sin, 1), row.(cos, 1), &:math.atan2/2),
           f = refined(f0, 2, p, row, cos, sin),
           true <- Enum.all?(f, &(&1 > 0)) do
        freqs = Emily.from_list(f, {:f, 32}, stream: s)
        positions = N.reshape(s, N.arange(s, 0, p, 1, {:f, 32}), {p, 1})
        angle = N.multiply(s, positions, N.reshape(s, freqs, {1, h}))
        angle = N.concatenate(s, [angle, angle], 1)
        tol = 1.0e-5 + 8 * p * Enum.max(f) * :math.pow(2, -24)

        err =
          for {table, fun} <- [{cos, &N.cos/2}, {sin, &N.sin/2}] do
            diff = N.abs(s, N.subtract(s, table, fun.(s, angle)))
            hd(Emily.to_list(N.max(s, diff, [0, 1], false)))
          end

        if Enum.max(err) <= tol, do: {:ok, f}, else: :error
      else
        _ -> :error
      end
    end

    defp refined(f, q, p, _row, _cos, _sin) when q >= p, do: f

    defp refined(f, q, p, row, cos, sin) do
      angles = Enum.zip_with(row.(sin, q), row.(cos, q), &:math.atan2/2)

      f =
        Enum.zip_with(angles, f, fn a, est ->
          turns = Float.round((q * est - a) / (2 * :math.pi()))
          (a + 2 * :math.pi() * turns) / q
        end)

      refined(f, q * 2, p, row, cos, sin)
    end

    ## GELU

    # Axon's gelu, `((erf(x / c) + 1) * x) / 2` with c its sqrt(2) in x's type. The kernel
    # computes those five ops, each rounded as the graph rounds it, in one pass (an f32
    # pass on a CPU, MLX's fused kernel of the ops on a GPU; else the five ops).
    defp gelu(%T{type: type, data: %Expr{args: [num, two]}}) do
      with k when k == 2 <- constant(two),
           %T{data: %Expr{op: :multiply, args: [a, b]}} <- strip(num),
           {x, c} <- Enum.find_value([{a, b}, {b, a}], &erf_plus_one/1),
           %T{type: ^type} <- x do
        build = fn st ->
          {xs, st} = operand(x, type, st)
          emit(st, :gelu_erf, [xs, c])
        end

        {%{rewrite: :gelu}, build}
      else
        _ -> nil
      end
    end

    # `{x, c}` where `plus` is `erf(x / c) + 1` and `x` is `other`.
    defp erf_plus_one({plus, other}) do
      with %T{data: %Expr{op: :add, args: [l, r]}} <- strip(plus),
           erf when erf != nil <-
             Enum.find_value([{l, r}, {r, l}], fn {e, k} -> constant(k) == 1 && e end),
           %T{data: %Expr{op: :erf, args: [q]}} <- strip(erf),
           %T{data: %Expr{op: :divide, args: [x, c]}} <- strip(q),
           c when is_number(c) and c > 0 <- constant(c),
           true <- same?(x, other) do
        {x, c}
      else
        _ -> nil
      end
    end

    ## SiLU

    # Axon's silu, `sigmoid(x) * x`, and that times a tensor of the same shape and type
    # (Bumblebee's gated feed-forward: `up * silu(gate)`, either order): the `silu` op
    # computes those two or three ops as they are, each rounded to the type, so its
    # values are the graph's.
    defp silu(%T{shape: shape, type: type, data: %Expr{args: [a, b]}} = t) do
      case silu_of(t) do
        %T{} = x ->
          {%{rewrite: :silu, gated: false}, &silu_build(x, nil, type, &1)}

        nil ->
          Enum.find_value([{a, b}, {b, a}], fn {act, by} ->
            with %T{shape: ^shape, type: ^type} <- by,
                 %T{shape: ^shape, type: ^type} = act <- strip(act),
                 %T{} = x <- silu_of(act) do
              {%{rewrite: :silu, gated: true}, &silu_build(x, by, type, &1)}
            else
              _ -> nil
            end
          end)
      end
    end

    # x where `t` is `sigmoid(x) * x` (either order) of t's shape and type; else nil.
    defp silu_of(%T{shape: shape, type: type, data: %Expr{op: :multiply, args: [a, b]}}) do
      Enum.find_value([{a, b}, {b, a}], fn {sig, x} ->
        with %T{shape: ^shape, type: ^type} <- x,
             %T{type: ^type, data: %Expr{op: :sigmoid, args: [y]}} <- strip(sig),
             true <- same?(y, x) do
          x
        else
          _ -> nil
        end
      end)
    end

    defp silu_of(_t), do: nil

    defp silu_build(x, by, type, st) do
      {xs, st} = operand(x, type, st)
      {bs, st} = if by, do: operand(by, type, st), else: {nil, st}
      emit(st, :silu, [xs, bs])
    end

    ## Dense

    # Axon's dense layer, `dot(x, [last], w, [0]) + bias` with w (K, N) and bias (N), all
    # of the result's type: the `dense` op, which adds the bias inside the product where
    # the product is a matrix product (BLAS's `beta`, one pass over the result instead of
    # two), so each element is the same dot product and sum, rounded in another order.
    defp dense(%T{shape: shape, type: type, data: %Expr{args: [a, b]}}) do
      Enum.find_value([{a, b}, {b, a}], fn {d, bias} ->
        with %T{shape: ^shape, type: ^type, data: %Expr{op: :dot, args: dot}} <- strip(d),
             [%T{type: ^type} = x, [c], [], %T{type: ^type, shape: {_k, n}} = w, [0], []] <- dot,
             true <- c == tuple_size(x.shape) - 1,
             %T{type: ^type, shape: {^n}} <- bias do
          build = fn st ->
            {xs, st} = operand(x, type, st)
            {ws, st} = operand(w, type, st)
            {bs, st} = operand(bias, type, st)
            emit(st, :dense, [xs, ws, bs])
          end

          {%{rewrite: :dense}, build}
        else
          _ -> nil
        end
      end)
    end

    ## An update of repeated heads

    # `put_slice(c, starts, r)` where r `{B, L, H * g, D}` repeats each head of x0
    # `{B, L, H, D}` g times (Bumblebee's grouped-query keys and values, repeated before
    # they are cached) and covers c's whole head axis: the same elements written from x0,
    # read unrepeated (Index.put_slice_repeated/6). The head axis's start clamps to 0
    # either way. Any type: it moves elements only.
    defp repeated_update(%T{shape: {_, _, hg, d}, type: type} = t) do
      %Expr{args: [c, starts, r]} = t.data

      with {_, _, ^hg, ^d} <- r.shape,
           {:ok, x0, g} <- repeats(r) do
        build = fn st ->
          {cs, st} = operand(c, type, st)
          {xs, st} = operand(x0, type, st)
          starts = List.replace_at(starts, 2, 0)
          Index.put_slice_repeated(st, cs, xs, starts, 2, g)
        end

        {%{rewrite: :repeated_update, groups: g}, build}
      else
        _ -> nil
      end
    end

    defp repeated_update(_t), do: nil

    ## A slice of a product

    # A slice of `dot(l, r)` (no batch axes) that keeps all of r's free axes: the product
    # of the slice of l, which computes only the rows kept. Bumblebee's generation takes
    # `logits[[.., -1]]` of an LM head applied to every position of the prompt; this
    # computes the head for the last one. Each element is the same dot product.
    defp sliced_dot(%T{data: %Expr{args: [p, starts, lengths, strides]}}) do
      with %T{type: type, data: %Expr{op: :dot, args: [l, cl, [], r, cr, []]}} <- strip(p),
           true <- Enum.all?(starts, &is_integer/1),
           free = Enum.to_list(0..(tuple_size(l.shape) - 1)//1) -- cl,
           {kept, rest} = Enum.split(Enum.zip([starts, lengths, strides]), length(free)),
           r_free = Enum.to_list(0..(tuple_size(r.shape) - 1)//1) -- cr,
           true <- rest == Enum.map(r_free, &{0, elem(r.shape, &1), 1}),
           true <- Enum.any?(Enum.zip(free, kept), fn {a, {_, n, _}} -> n < elem(l.shape, a) end) do
        by_axis = Map.new(Enum.zip(free, kept))

        {starts_l, lengths_l, strides_l} =
          Enum.map(
            0..(tuple_size(l.shape) - 1)//1,
            &Map.get(by_axis, &1, {0, elem(l.shape, &1), 1})
          )
          |> unzip3()

        build = fn st ->
          {ls, st} = operand(l, type, st)
          {from, to} = Emily.Backend.Ops.slice_bounds(l.shape, starts_l, lengths_l)
          {ls, st} = emit(st, :slice, [ls, from, to, strides_l])
          {rs, st} = operand(r, type, st)
          emit(st, :dot, [ls, cl, [], rs, cr, []])
        end

        {%{rewrite: :sliced_dot}, build}
      else
        _ -> nil
      end
    end

    defp unzip3(triples) do
      {Enum.map(triples, &elem(&1, 0)), Enum.map(triples, &elem(&1, 1)),
       Enum.map(triples, &elem(&1, 2))}
    end

    ## Attention

    # Bumblebee's attention (Layers.attention: attention_weights_impl, then
    # attention_output_impl), on `[B, heads, L, D]` queries, keys and values:
    # `softmax(q·k * scale + bias) · v`, the softmax as Axon writes it
    # (`exp(s - max(s)) * (1 / sum(exp(s - max(s))))`), bias the additive mask
    # Bumblebee builds from its key mask and causal mask (`select(mask, 0, lowest)`), or
    # any other floating-point tensor it adds (the kernel adds the same), or none. Keys
    # and values repeated for grouped-query attention (Bumblebee's repeat_interleave
    # over the heads) are given to the kernel unrepeated, as it computes grouped heads
    # itself.
    defp attention(%T{type: type, data: %Expr{args: [p, [3], [0, 1], v, [2], [0, 1]]}}) do
      with %T{type: ^type, shape: {_, _, _, _} = sshape} <- p,
           %T{type: ^type, shape: {_, _, _, _}} <- v,
           {:ok, s} <- softmax_last(p),
           %T{type: ^type, shape: ^sshape} <- s,
           {:ok, scores, bias} <- scores_and_bias(s),
           {:ok, scale, d} <- scaled(scores),
           %T{type: ^type, data: %Expr{op: :dot, args: [q, [3], [0, 1], k, [3], [0, 1]]}} <- d,
           %T{type: ^type} <- q,
           %T{type: ^type} <- k,
           true <- bias == nil or mask_shape?(bias, sshape) do
        {k, v, groups} = unrepeated(k, v)
        nq = elem(q.shape, 1)
        build = fn st -> attention_build(q, k, v, scale, bias, type, st) end
        info = %{rewrite: :scaled_dot_product_attention, mask: bias && :additive}
        {Map.merge(info, %{heads: {nq, div(nq, groups)}, scale: scale}), build}
      else
        _ -> nil
      end
    end

    defp attention(_t), do: nil

    defp attention_build(q, k, v, scale, bias, type, st) do
      {q, st} = operand(q, type, st)
      {k, st} = heads_first(k, type, st)
      {v, st} = heads_first(v, type, st)

      {mask, st} =
        case bias do
          nil ->
            {["", nil], st}

          bias ->
            {slot, st} = operand(bias, type, st)
            {["array", slot], st}
        end

      emit(st, :scaled_dot_product_attention, [q, k, v, scale] ++ mask ++ [nil])
    end

    # A key or value: the node itself, or `{:unrepeated, x}`, the unrepeated
    # `[B, L, heads, D]` tensor to transpose.
    defp heads_first({:unrepeated, x}, type, st) do
      {slot, st} = operand(x, type, st)
      emit(st, :transpose, [slot, [0, 2, 1, 3]])
    end

    defp heads_first(x, type, st), do: operand(x, type, st)

    # `exp(s - max(s)) / sum(exp(s - max(s)))` over the last axis (Axon's softmax: the
    # reciprocal of the sum times the exponentials, the max under stop_grad), or the
    # plain quotient: `{:ok, s}`.
    defp softmax_last(p) do
      with {e, z} <- quotient(strip(p)),
           %T{data: %Expr{op: :sum, args: [e2, opts]}} <- strip(z),
           true <- same?(e, e2) and last_axis?(opts, e),
           %T{data: %Expr{op: :exp, args: [diff]}} <- strip(e),
           %T{data: %Expr{op: :subtract, args: [s, mx]}} <- strip(diff),
           %T{data: %Expr{op: :reduce_max, args: [s2, mopts]}} <- strip(mx),
           true <- same?(s, s2) and last_axis?(mopts, s) do
        {:ok, strip(s)}
      else
        _ -> nil
      end
    end

    defp quotient(%T{data: %Expr{op: :divide, args: [e, z]}}), do: {e, z}

    defp quotient(%T{data: %Expr{op: :multiply, args: [a, b]}}) do
      Enum.find_value([{a, b}, {b, a}], fn {inv, e} ->
        case strip(inv) do
          %T{data: %Expr{op: :divide, args: [one, z]}} -> if constant(one) == 1, do: {e, z}
          _ -> nil
        end
      end)
    end

    defp quotient(_p), do: nil

    # The scores before the mask, and the additive mask (or nil).
    defp scores_and_bias(%T{shape: shape, data: %Expr{op: :add, args: [a, b]}}) do
      Enum.find_value([{a, b}, {b, a}], fn {scores, bias} ->
        with %T{shape: ^shape} <- scores, {:ok, _, _} <- scaled(scores) do
          {:ok, scores, bias}
        else
          _ -> nil
        end
      end)
    end

    defp scores_and_bias(s), do: {:ok, s, nil}

    # `q·k * scale` (scale a number), or `q·k`: `{:ok, scale, dot}`.
    defp scaled(t) do
      case strip(t) do
        %T{shape: shape, data: %Expr{op: :multiply, args: [a, b]}} ->
          Enum.find_value([{a, b}, {b, a}], fn {c, d} ->
            with scale when is_number(scale) <- constant(c),
                 %T{shape: ^shape, data: %Expr{op: :dot}} <- strip(d) do
              {:ok, scale * 1.0, strip(d)}
            else
              _ -> nil
            end
          end)

        %T{data: %Expr{op: :dot}} = d ->
          {:ok, 1.0, d}

        _ ->
          nil
      end
    end

    # A floating-point mask of rank 4 or less that broadcasts to the scores' shape
    # (from the right, as Nx's add and MLX's mask do) without widening them.
    defp mask_shape?(%T{shape: mshape, type: {k, _}} = m, sshape)
         when k in [:f, :bf] and m.vectorized_axes == [] do
      dims = Tuple.to_list(mshape)

      length(dims) <= 4 and
        dims
        |> Enum.reverse()
        |> Enum.zip(Enum.reverse(Tuple.to_list(sshape)))
        |> Enum.all?(fn {m, s} -> m == 1 or m == s end)
    end

    defp mask_shape?(_m, _shape), do: false

    # Keys and values `transpose(repeat_interleave(x, groups, axis: 2), [0, 2, 1, 3])`
    # both (same groups): `{{:unrepeated, k0}, {:unrepeated, v0}, groups}`; otherwise
    # as they are, one group.
    defp unrepeated(k, v) do
      with {:ok, k0, g} <- repeated_heads(k),
           {:ok, v0, ^g} <- repeated_heads(v) do
        {{:unrepeated, k0}, {:unrepeated, v0}, g}
      else
        _ -> {k, v, 1}
      end
    end

    # `transpose(r, [0, 2, 1, 3])` where r `{B, L, H * g, D}` repeats each head of
    # `x0` (`{B, L, H, D}`) g times in place (r[.., h, ..] = x0[.., div(h, g), ..]):
    # reshapes that keep the element order, a broadcast of one unit axis to g, reshapes
    # again. The broadcast axis must sit where, in element order, everything before it
    # is B * L * H and everything after it D.
    defp repeated_heads(t) do
      case strip(t) do
        %T{data: %Expr{op: :transpose, args: [r, [0, 2, 1, 3]]}} -> repeats(r)
        _ -> nil
      end
    end

    # `{:ok, x0, g}` where r `{B, L, H * g, D}` is x0 `{B, L, H, D}` with each head
    # repeated g times in place, as above; nil otherwise.
    defp repeats(r) do
      with {b, l, hg, d} <- r.shape,
           %T{data: %Expr{op: :broadcast, args: [pre, out, axes]}} = bc <- through_reshapes(r),
           true <- axes == Enum.to_list(0..(tuple_size(out) - 1)//1),
           true <- tuple_size(pre.shape) == tuple_size(out),
           [{p, g}] <- expanded(pre.shape, out),
           true <- is_integer(g) and g > 1 and rem(hg, g) == 0,
           in_dims = Tuple.to_list(pre.shape),
           true <- product(Enum.take(in_dims, p)) == b * l * div(hg, g),
           true <- product(Enum.drop(in_dims, p + 1)) == d,
           %T{} = x0 <- reshaped_from(pre, {b, l, div(hg, g), d}),
           true <- bc.type == x0.type and x0.type == r.type do
        {:ok, x0, g}
      else
        _ -> nil
      end
    end

    # The node of `shape` that `t` is a chain of reshapes of (the same elements in the
    # same order), `t` itself included; nil if none.
    defp reshaped_from(t, shape) do
      case strip(t) do
        %T{shape: ^shape} = x -> x
        %T{data: %Expr{op: :reshape, args: [x]}} -> reshaped_from(x, shape)
        _ -> nil
      end
    end

    defp through_reshapes(t) do
      case strip(t) do
        %T{data: %Expr{op: :reshape, args: [x]}} -> through_reshapes(x)
        other -> other
      end
    end

    # The axes a broadcast of the same rank widens: `[{axis, size}]`.
    defp expanded(from, to) do
      for {{f, s}, i} <- Enum.zip(Tuple.to_list(from), Tuple.to_list(to)) |> Enum.with_index(),
          f != s,
          do: if(f == 1, do: {i, s}, else: {i, :mismatch})
    end

    defp product(dims), do: Enum.reduce(dims, 1, &(&1 * &2))

    ## Shared pieces

    # `rsqrt(v + eps)` (eps a number, on either side): `{:ok, eps, v}`.
    defp rsqrt_eps(t) do
      with %T{data: %Expr{op: :rsqrt, args: [s]}} <- strip(t),
           %T{shape: shape, data: %Expr{op: :add, args: [a, b]}} <- strip(s) do
        Enum.find_value([{a, b}, {b, a}], fn {e, v} ->
          with eps when is_number(eps) <- constant(e),
               %T{shape: ^shape} <- v do
            {:ok, eps * 1.0, v}
          else
            _ -> nil
          end
        end)
      else
        _ -> nil
      end
    end

    # Whether `t` is the mean over the last axis of x's shape (kept) of a node for which
    # `of?` holds: `sum(y, axes: [last], keep_axes: true) / H`.
    defp mean_last?(t, x, of?) do
      h = last(x.shape)

      with %T{data: %Expr{op: :divide, args: [s, n]}} <- strip(t),
           true <- constant(n) == h,
           %T{data: %Expr{op: :sum, args: [y, opts]}} <- strip(s),
           true <- last_axis?(opts, x) and y.shape == x.shape do
        of?.(y)
      else
        _ -> false
      end
    end

    # Reduction options naming x's last axis alone, kept.
    defp last_axis?(opts, %T{shape: shape}) do
      opts[:axes] == [tuple_size(shape) - 1] and opts[:keep_axes] == true
    end

    defp square_of?(t, x) do
      case strip(t) do
        %T{data: %Expr{op: :pow, args: [y, two]}} -> same?(y, x) and constant(two) == 2
        %T{data: %Expr{op: :multiply, args: [a, b]}} -> same?(a, x) and same?(b, x)
        _ -> false
      end
    end

    defp strip_cast(t) do
      case strip(t) do
        %T{data: %Expr{op: :as_type, args: [%T{type: from} = m]}} -> {m, from}
        m -> {m, m.type}
      end
    end

    # A node without the metadata around it (stop_grad, a custom gradient, Axon's cached
    # logits): lowered as the node itself.
    defp strip(%T{data: %Expr{op: :metadata, args: [%T{} = inner, _meta]}}), do: strip(inner)
    defp strip(t), do: t

    defp same?(%T{} = a, %T{} = b), do: strip(a).data.id == strip(b).data.id
    defp same?(_a, _b), do: false

    # The number a constant node holds (every element of it); nil for anything else.
    defp constant(%T{} = t) do
      case strip(t) do
        %T{data: %Expr{op: :constant, args: [v]}} when is_number(v) -> v
        _ -> nil
      end
    end

    defp constant(_), do: nil

    defp last(shape) when tuple_size(shape) > 0, do: elem(shape, tuple_size(shape) - 1)
    defp last(_shape), do: nil
  end
end
