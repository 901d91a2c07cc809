# Emily.Fast: the fused kernels on Emily (eagerly, through Emily.Compiler's evaluator and
# native paths) against their default implementation on Nx.BinaryBackend, hand-checked
# values for rope and the attention masks, and the argument errors.
if Code.ensure_loaded?(Nx) do
  defmodule Emily.Nx.FastTest do
    use ExUnit.Case, async: false
    @moduletag :nx

    import Nx.Defn
    import Emily.NxOracle
    import Emily.NxCompiler
    alias Emily.NxOracle, as: O
    alias Emily.Fast

    doctest Emily.Fast

    defn(rms(x, w), do: Fast.rms_norm(x, w, eps: 1.0e-5))
    defn(rms_no_weight(x), do: Fast.rms_norm(x, nil, eps: 1.0e-6))
    defn(ln(x, w, b), do: Fast.layer_norm(x, w, b, eps: 1.0e-5))
    defn(ln_weight(x, w), do: Fast.layer_norm(x, w, nil))
    defn(ln_bias(x, b), do: Fast.layer_norm(x, nil, b))
    defn(ln_plain(x), do: Fast.layer_norm(x, nil, nil))
    defn(rope_half(x), do: Fast.rope(x, offset: 5))
    defn(rope_trad(x), do: Fast.rope(x, traditional: true, dims: 4, base: 500.0, scale: 0.5))
    defn(rope_at(x, offset), do: Fast.rope(x, dims: 4, offset: offset))
    defn(rope_freqs(x, freqs), do: Fast.rope(x, freqs: freqs, offset: 2))
    defn(sdpa(q, k, v), do: Fast.scaled_dot_product_attention(q, k, v))
    defn(sdpa_causal(q, k, v), do: Fast.scaled_dot_product_attention(q, k, v, mask: :causal))

    defn(sdpa_mask(q, k, v, mask),
      do: Fast.scaled_dot_product_attention(q, k, v, mask: mask, scale: 0.3)
    )

    defn(sdpa_sinks(q, k, v, sinks), do: Fast.scaled_dot_product_attention(q, k, v, sinks: sinks))

    defn(sdpa_sinks_causal(q, k, v, sinks),
      do: Fast.scaled_dot_product_attention(q, k, v, sinks: sinks, mask: :causal)
    )

    defn(sdpa_sinks_mask(q, k, v, mask, sinks),
      do: Fast.scaled_dot_product_attention(q, k, v, mask: mask, sinks: sinks)
    )

    # A transformer-ish block: every kernel in one graph.
    defn block(x, w, q, k, v, offset) do
      h = Fast.rms_norm(x, w)
      q = Fast.rope(q * Nx.sum(h), offset: offset)
      k = Fast.rope(k, offset: offset)
      a = Fast.scaled_dot_product_attention(q, k, v, mask: :causal)
      Fast.layer_norm(a, nil, nil)
    end

    defp oracle(fun, args, opts) do
      case opts[:oracle] do
        nil ->
          apply(fun, args)

        wide ->
          %{type: type} = apply(fun, args)
          up = Enum.map(args, &if(Nx.Type.float?(&1.type), do: Nx.as_type(&1, wide), else: &1))
          Nx.as_type(apply(fun, up), type)
      end
    end

    defp tol(type, opts) do
      case opts[:tol] do
        nil -> O.tol(type)
        tol -> tol
      end
    end

    # `fun` on Nx.BinaryBackend (the blocks' default implementations) is the oracle:
    # Emily eagerly, through the evaluator path and through the native path (with and
    # without mx::compile, lowered without falling back) must agree with it. With
    # `oracle: {:f, 32}`, the oracle runs on the floating inputs upcast to f32 and is
    # rounded to the result type once, at the end.
    defp check_paths(fun, args, opts \\ []) do
      expected = Nx.with_default_backend(Nx.BinaryBackend, fn -> oracle(fun, args, opts) end)
      assert %Nx.BinaryBackend{} = expected.data
      tol = tol(expected.type, opts)
      emily_args = Enum.map(args, &emily/1)

      assert_same(apply(fun, emily_args), expected, tol: tol)
      assert_same(apply(ejit(fun, native: false), args), expected, tol: tol)

      for out <- native_results(fun, args), do: assert_same(out, expected, tol: tol)

      expected
    end

    # Emily.Backend runs the block natively: its default implementation is never called.
    defp assert_native(fun, args) do
      args = Enum.map(args, &emily/1)
      me = self()

      # Intercept the block: call Emily.Backend.block/4 with a default that reports.
      [{struct, out, block_args}] = capture_blocks(fun, args)

      result =
        Emily.Backend.block(struct, out, block_args, fn _s, _a ->
          send(me, :default_called)
        end)

      refute_received :default_called
      assert %Emily.Backend{} = result.data
      result
    end

    # The blocks `fun` builds (traced through Nx.Defn.Expr), with the block's arguments
    # (here always parameters of `fun`) replaced by the actual arguments.
    defp capture_blocks(fun, args) do
      expr = apply(Nx.Defn.debug_expr(fun), Enum.map(args, &Nx.to_template/1))

      {_, blocks} =
        Nx.Defn.Composite.traverse(expr, [], fn t, acc -> {t, find_blocks(t, acc)} end)

      for {struct, in_args, res} <- Enum.reverse(blocks) do
        {struct, Nx.to_template(res), Enum.map(in_args, &param_value(&1, args))}
      end
    end

    defp find_blocks(
           %Nx.Tensor{data: %Nx.Defn.Expr{op: :block, args: [s, in_args, res, _]}},
           acc
         ),
         do: [{s, in_args, res} | acc]

    defp find_blocks(%Nx.Tensor{data: %Nx.Defn.Expr{op: :metadata, args: [t, _]}}, acc),
      do: find_blocks(t, acc)

    defp find_blocks(_t, acc), do: acc

    defp param_value(%Nx.Tensor{data: %Nx.Defn.Expr{op: :parameter, args: [i]}}, args),
      do: Enum.at(args, i)

    defp types, do: [{:f, 32}, {:bf, 16}, {:f, 16}]

    ## RMS norm

    test "rms_norm agrees with its default, with and without weight" do
      for type <- types() do
        x = O.tensor({3, 8}, type)
        w = O.tensor({8}, type)
        check_paths(&rms/2, [x, w])
        check_paths(&rms_no_weight/1, [O.tensor({2, 3, 5}, type)])
      end
    end

    test "rms_norm: mixed types promote, integers become floats" do
      out = check_paths(&rms/2, [O.tensor({2, 4}, {:bf, 16}), O.tensor({4}, {:f, 32})])
      assert out.type == {:f, 32}

      out = check_paths(&rms_no_weight/1, [Nx.tensor([[1, 2, 3, 4]], type: :s32)])
      assert out.type == {:f, 32}
    end

    test "rms_norm: hand-checked values" do
      # rms([3, 4]) = sqrt(12.5); [3, 4] / 3.5355 = [0.8485, 1.1314]; times [1, 2].
      x = emily(Nx.tensor([[3.0, 4.0], [0.0, 0.0]]))
      out = Fast.rms_norm(x[0..0], emily(Nx.tensor([1.0, 2.0])), eps: 0.0)
      [a, b] = Nx.to_flat_list(out)
      assert_in_delta a, 0.848528, 1.0e-5
      assert_in_delta b, 2.262742, 1.0e-5

      # 0 / sqrt(0 + 0) is NaN: eps matters (and :debug_detect_nan_inf catches it).
      if Emily.Debug.detect_nan_inf?() do
        assert_raise Emily.Error, fn -> Fast.rms_norm(x, nil, eps: 0.0) end
      else
        assert Enum.drop(Nx.to_flat_list(Fast.rms_norm(x, nil, eps: 0.0)), 2) == [:nan, :nan]
      end

      out = Fast.rms_norm(x, nil, eps: 1.0)
      assert Enum.drop(Nx.to_flat_list(out), 2) == [0.0, 0.0]
    end

    test "rms_norm runs natively on Emily" do
      out = assert_native(&rms/2, [O.tensor({2, 4}, {:f, 32}), O.tensor({4}, {:f, 32})])
      assert out.shape == {2, 4}
    end

    ## Layer norm

    test "layer_norm agrees with its default, weight and bias each optional" do
      for type <- types() do
        x = O.tensor({3, 6}, type)
        w = O.tensor({6}, type)
        b = O.tensor({6}, type)
        check_paths(&ln/3, [x, w, b])
        check_paths(&ln_weight/2, [x, w])
        check_paths(&ln_bias/2, [x, b])
        check_paths(&ln_plain/1, [O.tensor({2, 2, 4}, type)])
      end
    end

    test "layer_norm: hand-checked values" do
      # [1, 3]: mean 2, variance 1: [-1, 1] * [2, 3] + [10, 20].
      out =
        Fast.layer_norm(
          emily(Nx.tensor([[1.0, 3.0]])),
          emily(Nx.tensor([2.0, 3.0])),
          emily(Nx.tensor([10.0, 20.0])),
          eps: 0.0
        )

      assert Nx.to_flat_list(out) == [8.0, 23.0]
    end

    test "layer_norm runs natively on Emily" do
      x = O.tensor({2, 4}, {:bf, 16})
      assert_native(&ln/3, [x, O.tensor({4}, {:bf, 16}), O.tensor({4}, {:bf, 16})])
      assert_native(&ln_plain/1, [x])
    end

    ## RoPE

    # MLX's rope on iota(8) + 1 as {1, 1, 2, 4}, base 10000: position 0 is unchanged;
    # at position 1 the pairs turn by 1 rad and 0.01 rad. Rotate-half pairs (5, 7) and
    # (6, 8): 5 cos 1 - 7 sin 1 = -3.18879, 6 cos .01 - 8 sin .01 = 5.91970,
    # 5 sin 1 + 7 cos 1 = 7.98947, 6 sin .01 + 8 cos .01 = 8.05960. Traditional pairs
    # (5, 6) and (7, 8): 5 cos 1 - 6 sin 1 = -2.34731, 5 sin 1 + 6 cos 1 = 7.44917, ...
    @rope_x Nx.tensor([[[[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]]])
    @rope_half [1.0, 2.0, 3.0, 4.0, -3.18879, 5.91970, 7.98947, 8.05960]
    @rope_trad [1.0, 2.0, 3.0, 4.0, -2.34731, 7.44917, 6.91965, 8.06960]
    # dims 2, offset 3: only (x0, x1) turns, by 3 and 4 rad.
    @rope_dims2 [-1.27223, -1.83887, 3.0, 4.0, 1.27260, -7.70587, 7.0, 8.0]

    test "rope: hand-checked values, both layouts, dims and offsets" do
      for backend <- [Nx.BinaryBackend, Emily.Backend] do
        x = Nx.backend_copy(@rope_x, backend)
        assert_list(Fast.rope(x), @rope_half)
        assert_list(Fast.rope(x, traditional: true), @rope_trad)
        assert_list(Fast.rope(x, dims: 2, offset: 3), @rope_dims2)
        assert_list(Fast.rope(x, dims: 2, offset: Nx.tensor(3)), @rope_dims2)
        # Wavelengths [1, 100] are base 10000's for dims 4.
        assert_list(Fast.rope(x, freqs: Nx.tensor([1.0, 100.0])), @rope_half)
        # Rank 3: {B, L, D}.
        assert_list(Fast.rope(Nx.reshape(x, {1, 2, 4})), @rope_half)
      end
    end

    defp assert_list(t, expected) do
      for {a, e} <- Enum.zip(Nx.to_flat_list(t), expected), do: assert_in_delta(a, e, 1.0e-4)
    end

    test "rope agrees with its default (options, types, tensor offsets)" do
      for type <- types() do
        x = O.tensor({2, 3, 5, 8}, type)
        check_paths(&rope_half/1, [x])
        check_paths(&rope_trad/1, [x])
        check_paths(&rope_at/2, [x, Nx.tensor(7)])
        check_paths(&rope_freqs/2, [x, Nx.tensor([1.0, 3.0, 10.0, 50.0])])
      end

      # A rank-3 and a rank-5 input.
      check_paths(&rope_half/1, [O.tensor({2, 4, 6}, {:f, 32})])
      check_paths(&rope_half/1, [O.tensor({2, 2, 2, 3, 4}, {:f, 32})])
    end

    test "rope with one offset per batch entry" do
      x = O.tensor({3, 2, 4, 6}, {:f, 32})
      offsets = Nx.tensor([0, 4, 9], type: :s32)
      out = check_paths(&rope_at/2, [x, offsets])

      # Each batch entry is the scalar-offset rope of that entry.
      for {i, offset} <- [{0, 0}, {1, 4}, {2, 9}] do
        assert_same(Fast.rope(emily(x[i..i]), dims: 4, offset: offset), out[i..i])
      end
    end

    test "rope with a large position offset" do
      check_paths(&rope_at/2, [O.tensor({1, 2, 3, 4}, {:f, 32}), Nx.tensor(40_000)],
        tol: {1.0e-3, 1.0e-3}
      )
    end

    test "rope runs natively on Emily (integer and tensor offsets)" do
      x = O.tensor({1, 2, 3, 8}, {:f, 16})
      assert_native(&rope_half/1, [x])
      assert_native(&rope_at/2, [x, Nx.tensor(2)])
      assert_native(&rope_freqs/2, [x, Nx.tensor([1.0, 3.0, 10.0, 50.0])])
    end

    ## Attention

    test "attention agrees with its default, types and masks" do
      # MLX's fused kernel keeps the scores and the weighted sum in f32; the default, like
      # MLX's own reference, rounds the scores to the input type, which for f16 and bf16
      # moves an output near zero by more than one rounding. The oracle is the default
      # on f32 inputs, rounded once.
      for type <- types() do
        q = O.tensor({2, 2, 3, 4}, type)
        k = O.tensor({2, 2, 5, 4}, type)
        v = O.tensor({2, 2, 5, 6}, type)
        o = [oracle: {:f, 32}]
        check_paths(&sdpa/3, [q, k, v], o)
        check_paths(&sdpa_causal/3, [q, k, v], o)
        # Boolean (integer) and additive masks, broadcast from lower ranks.
        check_paths(&sdpa_mask/4, [q, k, v, O.tensor({3, 5}, {:u, 8}, {:range, 0, 1})], o)
        check_paths(&sdpa_mask/4, [q, k, v, O.tensor({2, 1, 1, 5}, {:u, 8}, {:range, 0, 1})], o)
        check_paths(&sdpa_mask/4, [q, k, v, O.tensor({2, 2, 3, 5}, type)], o)
        check_paths(&sdpa_mask/4, [q, k, v, O.tensor({5}, {:f, 32})], o)
      end
    end

    test "attention: causal mask aligned to the end of the keys (hand-checked)" do
      q = Nx.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
      k = Nx.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]])
      v = Nx.tensor([[[[1.0], [2.0], [3.0]]]])

      for backend <- [Nx.BinaryBackend, Emily.Backend] do
        [q, k, v] = Enum.map([q, k, v], &Nx.backend_copy(&1, backend))
        out = Fast.scaled_dot_product_attention(q, k, v, scale: 1.0, mask: :causal)
        # Query 0 sees keys 0-1: scores [1, 0], (1 e + 2) / (e + 1) = 1.26894.
        # Query 1 sees keys 0-2: scores [0, 1, 1], (1 + 2e + 3e) / (1 + 2e) = 2.26696.
        assert_list(out, [1.26894, 2.26696])
      end

      # More queries than keys: the first queries see no key and get the mean value.
      q = O.tensor({1, 1, 4, 2}, {:f, 32})
      k = O.tensor({1, 1, 2, 2}, {:f, 32})
      v = Nx.tensor([[[[1.0], [5.0]]]])
      out = check_paths(&sdpa_causal/3, [q, k, v])
      [a, b, c, _] = Nx.to_flat_list(out)
      assert_in_delta a, 3.0, 1.0e-5
      assert_in_delta b, 3.0, 1.0e-5
      assert_in_delta c, 1.0, 1.0e-5
    end

    test "attention: causal equals an explicit end-aligned mask" do
      q = O.tensor({1, 2, 3, 4}, {:f, 32})
      k = O.tensor({1, 2, 6, 4}, {:f, 32})
      v = O.tensor({1, 2, 6, 4}, {:f, 32})
      # Query i sees keys 0..i + 3.
      mask = Nx.tensor(for i <- 0..2, do: for(j <- 0..5, do: if(j <= i + 3, do: 1, else: 0)))

      causal = Nx.with_default_backend(Nx.BinaryBackend, fn -> sdpa_causal(q, k, v) end)

      explicit =
        Nx.with_default_backend(Nx.BinaryBackend, fn ->
          Fast.scaled_dot_product_attention(q, k, v, mask: mask)
        end)

      assert_same(emily(causal), emily(explicit))
      assert_same(sdpa_causal(emily(q), emily(k), emily(v)), explicit)
      assert_same(ejit(&sdpa_causal/3, native: true).(q, k, v), explicit)
    end

    test "attention: boolean and additive masks (hand-checked)" do
      q = Nx.tensor([[[[1.0, 0.0]]]])
      k = Nx.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]])
      v = Nx.tensor([[[[1.0], [2.0], [3.0]]]])

      for backend <- [Nx.BinaryBackend, Emily.Backend] do
        [q, k, v] = Enum.map([q, k, v], &Nx.backend_copy(&1, backend))
        attend = &Fast.scaled_dot_product_attention(q, k, v, scale: 1.0, mask: &1)
        # Scores [1, 0, 1]. Keys 1-2: weights [1, e] / (1 + e) on [2, 3] = 2.73106.
        assert_list(attend.(Nx.tensor([0, 1, 1], type: :u8)), [2.73106])
        assert_list(attend.(Nx.tensor([-1.0e9, 0.0, 0.0])), [2.73106])
        # An additive bias: scores [1, 1, 1] -> the mean, 2.
        assert_list(attend.(Nx.tensor([0.0, 1.0, 0.0])), [2.0])
        # Nothing to attend to: the mean of the values.
        assert_list(attend.(Nx.tensor([0, 0, 0], type: :u8)), [2.0])
        # No mask: weights [e, 1, e] / (2e + 1): (e + 2 + 3e) / (2e + 1) = 2.0.
        assert_list(Fast.scaled_dot_product_attention(q, k, v, scale: 1.0), [2.0])
      end
    end

    test "attention: grouped-query equals multi-head with repeated key/value heads" do
      for type <- [{:f, 32}, {:bf, 16}] do
        q = O.tensor({2, 6, 3, 4}, type)
        k = O.tensor({2, 2, 5, 4}, type)
        v = O.tensor({2, 2, 5, 3}, type)
        out = check_paths(&sdpa_causal/3, [q, k, v])
        assert out.shape == {2, 6, 3, 3}

        # Query heads 0-2 use key/value head 0, heads 3-5 head 1.
        repeat = fn t -> Nx.take(t, Nx.tensor([0, 0, 0, 1, 1, 1]), axis: 1) end

        mha =
          Nx.with_default_backend(Nx.BinaryBackend, fn ->
            sdpa_causal(q, repeat.(k), repeat.(v))
          end)

        assert_same(emily(out), mha, tol: {0, 0})
        assert_same(sdpa_causal(emily(q), emily(k), emily(v)), mha, tol: O.tol(type))

        # A per-head mask broadcast over the groups.
        mask = O.tensor({2, 6, 3, 5}, {:u, 8}, {:range, 0, 1})
        check_paths(&sdpa_mask/4, [q, k, v, mask])
      end
    end

    test "attention sinks: hand-checked, and agreeing with the default" do
      # One key of score 1 and a sink of logit 1: half the weight goes to the sink.
      q = Nx.tensor([[[[1.0, 0.0]]]])
      k = Nx.tensor([[[[1.0, 0.0]]]])
      v = Nx.tensor([[[[10.0]]]])

      for backend <- [Nx.BinaryBackend, Emily.Backend] do
        [q, k, v, sinks] = Enum.map([q, k, v, Nx.tensor([1.0])], &Nx.backend_copy(&1, backend))
        out = Fast.scaled_dot_product_attention(q, k, v, scale: 1.0, sinks: sinks)
        assert_list(out, [5.0])
      end

      # Grouped heads (4 query heads, 2 key/value heads), every mask kind, each type.
      for type <- types() do
        q = O.tensor({2, 4, 3, 4}, type)
        k = O.tensor({2, 2, 5, 4}, type)
        v = O.tensor({2, 2, 5, 6}, type)
        sinks = O.tensor({4}, type)
        o = [oracle: {:f, 32}]
        check_paths(&sdpa_sinks/4, [q, k, v, sinks], o)
        check_paths(&sdpa_sinks_causal/4, [q, k, v, sinks], o)
        mask = O.tensor({3, 5}, {:u, 8}, {:range, 0, 1})
        check_paths(&sdpa_sinks_mask/5, [q, k, v, mask, sinks], o)
        check_paths(&sdpa_sinks_mask/5, [q, k, v, O.tensor({5}, {:f, 32}), sinks], o)
      end
    end

    test "attention runs natively on Emily" do
      q = O.tensor({1, 4, 2, 4}, {:f, 32})
      k = O.tensor({1, 2, 3, 4}, {:f, 32})
      v = O.tensor({1, 2, 3, 4}, {:f, 32})
      assert_native(&sdpa/3, [q, k, v])
      assert_native(&sdpa_causal/3, [q, k, v])
      assert_native(&sdpa_mask/4, [q, k, v, Nx.tensor([1, 0, 1], type: :u8)])
      assert_native(&sdpa_mask/4, [q, k, v, O.tensor({2, 3}, {:f, 32})])
      sinks = O.tensor({4}, {:f, 32})
      assert_native(&sdpa_sinks/4, [q, k, v, sinks])
      assert_native(&sdpa_sinks_mask/5, [q, k, v, Nx.tensor([1, 0, 1], type: :u8), sinks])
    end

    ## Together, f64, grad

    test "a block using every kernel, in one native program" do
      args = [
        O.tensor({2, 8}, {:f, 32}),
        O.tensor({8}, {:f, 32}),
        O.tensor({1, 4, 3, 8}, {:f, 32}, :unit),
        O.tensor({1, 2, 5, 8}, {:f, 32}),
        O.tensor({1, 2, 5, 8}, {:f, 32}),
        Nx.tensor(2)
      ]

      check_paths(&block/6, args, tol: {1.0e-4, 1.0e-4})
    end

    test "f64 runs the default implementation, on Emily and on the native path" do
      x = O.tensor({2, 4}, {:f, 64})
      w = O.tensor({4}, {:f, 64})
      expected = Nx.with_default_backend(Nx.BinaryBackend, fn -> rms(x, w) end)
      assert_same(rms(emily(x), emily(w)), expected)
      assert_same(ejit(&rms/2, native: false).(x, w), expected)

      {out, fallbacks} = with_fallbacks(fn -> ejit(&rms/2, native: true).(x, w) end)

      # MLX computes f64 on the CPU only: a GPU program cannot hold it.
      if Emily.default_device() == :gpu,
        do: assert([%{reason: {:type, {:f, 64}}}] = fallbacks),
        else: assert(fallbacks == [])

      assert_same(out, expected)
    end

    test "grad through the kernels matches Nx.BinaryBackend" do
      loss = fn x, w, k ->
        h = Fast.rms_norm(x, w)
        q = Fast.rope(Nx.reshape(h, {1, 1, 2, 4}))
        kk = Nx.reshape(k, {1, 1, 3, 4})
        Nx.sum(Fast.scaled_dot_product_attention(q, kk, Nx.multiply(kk, 2), mask: :causal))
      end

      grad = fn x, w, k -> Nx.Defn.grad({x, w, k}, fn {x, w, k} -> loss.(x, w, k) end) end
      args = [O.tensor({2, 4}, {:f, 32}), O.tensor({4}, {:f, 32}), O.tensor({3, 4}, {:f, 32})]

      expected =
        Nx.with_default_backend(Nx.BinaryBackend, fn ->
          apply(Nx.Defn.jit(grad, compiler: Nx.Defn.Evaluator), args)
        end)

      for native <- [false, true],
          do:
            assert_same(apply(ejit(grad, native: native), args), expected, tol: {1.0e-4, 1.0e-4})
    end

    ## Errors

    test "bad shapes and options raise ArgumentError" do
      x = Nx.iota({2, 4}, type: :f32)

      assert_raise ArgumentError, ~r/weight of shape \{4\}/, fn ->
        Fast.rms_norm(x, Nx.iota({3}, type: :f32))
      end

      assert_raise ArgumentError, ~r/bias of shape/, fn ->
        Fast.layer_norm(x, nil, Nx.iota({2, 4}, type: :f32))
      end

      assert_raise ArgumentError, ~r/rank 1 or more/, fn -> Fast.rms_norm(1.0, nil) end
      assert_raise ArgumentError, ~r/unknown keys/, fn -> Fast.rms_norm(x, nil, epsilon: 1) end

      x4 = Nx.iota({1, 1, 2, 4}, type: :f32)
      assert_raise ArgumentError, ~r/rank 3 or more/, fn -> Fast.rope(x) end

      assert_raise ArgumentError, ~r/:dims must be a positive even/, fn ->
        Fast.rope(x4, dims: 3)
      end

      assert_raise ArgumentError, ~r/:dims must be/, fn -> Fast.rope(x4, dims: 6) end
      assert_raise ArgumentError, ~r/floating-point/, fn -> Fast.rope(Nx.iota({1, 2, 4})) end

      assert_raise ArgumentError, ~r/integer tensor/, fn ->
        Fast.rope(x4, offset: Nx.tensor(1.0))
      end

      assert_raise ArgumentError, ~r/one per batch/, fn ->
        Fast.rope(x4, offset: Nx.tensor([1, 2]))
      end

      assert_raise ArgumentError, ~r/:freqs must be a vector of dims/, fn ->
        Fast.rope(x4, freqs: Nx.tensor([1.0, 2.0, 3.0]))
      end

      q = Nx.iota({1, 4, 2, 8}, type: :f32)
      k = Nx.iota({1, 2, 3, 8}, type: :f32)
      sdpa = &Fast.scaled_dot_product_attention/4

      assert_raise ArgumentError, ~r/keys of rank 4/, fn ->
        sdpa.(q, Nx.iota({2, 3, 8}), k, [])
      end

      assert_raise ArgumentError, ~r/key\/value heads must divide/, fn ->
        sdpa.(q, Nx.iota({1, 3, 3, 8}), Nx.iota({1, 3, 3, 8}), [])
      end

      assert_raise ArgumentError, ~r/query and key feature sizes/, fn ->
        sdpa.(q, Nx.iota({1, 2, 3, 4}), k, [])
      end

      assert_raise ArgumentError, ~r/batch sizes/, fn ->
        sdpa.(q, Nx.iota({2, 2, 3, 8}), Nx.iota({2, 2, 3, 8}), [])
      end

      assert_raise ArgumentError, ~r/key and value heads and lengths/, fn ->
        sdpa.(q, k, Nx.iota({1, 2, 4, 8}), [])
      end

      assert_raise ArgumentError,
                   ~r/sinks of shape \{4\} \(one per query head\), got \{2\}/,
                   fn ->
                     sdpa.(q, k, k, sinks: Nx.tensor([0.0, 1.0]))
                   end

      assert_raise ArgumentError, ~r/does not broadcast/, fn ->
        sdpa.(q, k, k, mask: Nx.iota({2, 4}))
      end

      assert_raise ArgumentError, ~r/expected real tensors/, fn ->
        Fast.layer_norm(Nx.tensor([[Complex.new(1.0, 1.0)]]), nil, nil)
      end

      assert_raise ArgumentError, ~r/vectorized/, fn ->
        Fast.rms_norm(Nx.vectorize(x, :rows), nil)
      end

      # The default stream still works.
      assert Nx.to_flat_list(Fast.rms_norm(emily(Nx.tensor([[2.0]])), nil, eps: 0.0)) == [1.0]
    end
  end
else
  defmodule Emily.Nx.FastTest do
    use ExUnit.Case, async: true
    @moduletag :nx
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
