defmodule Emily.Native.FastTest do
  use Emily.TestCase, async: true

  defp assert_alive, do: assert(l(N.add(s(), t([1.0]), t([2.0]))) == [3.0])

  defp seq(n, f \\ fn i -> :math.sin(i * 0.7 + 0.3) end), do: for(i <- 0..(n - 1), do: f.(i))

  describe "rms_norm" do
    test "hand-computed, with and without weight" do
      # rms([3, 4]) = sqrt(12.5)
      x = t([3.0, 4.0], {:f, 32}, {1, 2})
      r = :math.sqrt(12.5)
      assert_close(l(N.rms_norm(s(), x, nil, 0.0)), [3 / r, 4 / r])
      assert_close(l(N.rms_norm(s(), x, t([2.0, 0.5]), 0.0)), [6 / r, 2 / r])
      # eps inside the root: rms([1, 1]) with eps 3 -> 1 / 2
      assert_close(l(N.rms_norm(s(), t([1.0, 1.0], {:f, 32}, {1, 2}), nil, 3.0)), [0.5, 0.5])
    end

    test "matches x * rsqrt(mean(x^2) + eps) * w built from basic ops" do
      x = t(seq(24), {:f, 32}, {2, 3, 4})
      w = t([0.5, 1.0, 1.5, 2.0])
      ms = N.mean(s(), N.square(s(), x), [-1], true)
      ref = N.multiply(s(), N.multiply(s(), x, N.rsqrt(s(), N.add(s(), ms, t([1.0e-5])))), w)
      assert_close(l(N.rms_norm(s(), x, w, 1.0e-5)), l(ref), 1.0e-5)
    end

    test "bf16 keeps its dtype" do
      y = N.rms_norm(s(), t([3.0, 4.0], {:bf, 16}, {1, 2}), nil, 0.0)
      assert Emily.dtype(y) == {:bf, 16}
      assert_close(l(y), [0.8485281, 1.1313708], 1.0e-2)
    end
  end

  describe "layer_norm" do
    test "hand-computed, with weight and bias optional" do
      # [1, 2, 3]: mean 2, variance 2/3
      x = t([1.0, 2.0, 3.0], {:f, 32}, {1, 3})
      z = 1 / :math.sqrt(2 / 3)
      assert_close(l(N.layer_norm(s(), x, nil, nil, 0.0)), [-z, 0.0, z])
      w = t([1.0, 2.0, 3.0])
      b = t([0.5, 0.5, 0.5])
      assert_close(l(N.layer_norm(s(), x, w, nil, 0.0)), [-z, 0.0, 3 * z])
      assert_close(l(N.layer_norm(s(), x, nil, b, 0.0)), [0.5 - z, 0.5, 0.5 + z])
      assert_close(l(N.layer_norm(s(), x, w, b, 0.0)), [0.5 - z, 0.5, 0.5 + 3 * z])
    end

    test "matches (x - mean) * rsqrt(var + eps) * w + b built from basic ops" do
      x = t(seq(30), {:f, 32}, {5, 6})
      w = t(seq(6, &(1.0 + &1 / 10)))
      b = t(seq(6, &(&1 / 4 - 0.5)))
      mu = N.mean(s(), x, [-1], true)
      v = N.var(s(), x, [-1], true, 0)
      norm = N.multiply(s(), N.subtract(s(), x, mu), N.rsqrt(s(), N.add(s(), v, t([1.0e-5]))))
      ref = N.add(s(), N.multiply(s(), norm, w), b)
      assert_close(l(N.layer_norm(s(), x, w, b, 1.0e-5)), l(ref), 1.0e-5)
    end
  end

  describe "rope" do
    # Rotates feature pairs by (offset + position) * scale * inv_freq[i], where
    # inv_freq[i] = base^(-i / (dims / 2)) or 1 / freqs[i]. Pairs are (i, i + dims/2), or
    # (2i, 2i + 1) when traditional; features past `dims` pass through.
    defp ref_rope(x, {_b, h, len, d}, dims, traditional, base, scale, offsets, freqs \\ nil) do
      half = div(dims, 2)

      inv =
        for i <- 0..(half - 1),
            do: if(freqs, do: 1 / Enum.at(freqs, i), else: base ** (-i / half))

      rows = Enum.chunk_every(x, d)

      for {row, r} <- Enum.with_index(rows) do
        batch = div(r, h * len)
        pos = rem(r, len) + Enum.at(offsets, min(batch, length(offsets) - 1))
        {rot, rest} = Enum.split(row, dims)

        pairs =
          if traditional,
            do: rot |> Enum.chunk_every(2) |> Enum.map(&List.to_tuple/1),
            else: Enum.zip(Enum.take(rot, half), Enum.drop(rot, half))

        rotated =
          for {{x1, x2}, i} <- Enum.with_index(pairs) do
            th = pos * scale * Enum.at(inv, i)
            {x1 * :math.cos(th) - x2 * :math.sin(th), x1 * :math.sin(th) + x2 * :math.cos(th)}
          end

        out =
          if traditional,
            do: Enum.flat_map(rotated, &Tuple.to_list/1),
            else: Enum.map(rotated, &elem(&1, 0)) ++ Enum.map(rotated, &elem(&1, 1))

        out ++ rest
      end
      |> List.flatten()
    end

    test "hand-computed: position 1, base 10000, dims 4" do
      x = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], {:f, 32}, {1, 1, 2, 4})
      # row 0 at position 0 is unchanged; row 1 rotates (5, 7) by 1 rad and (6, 8) by 0.01
      {c1, s1} = {:math.cos(1.0), :math.sin(1.0)}
      {c2, s2} = {:math.cos(0.01), :math.sin(0.01)}

      expected = [
        1.0,
        2.0,
        3.0,
        4.0,
        5 * c1 - 7 * s1,
        6 * c2 - 8 * s2,
        5 * s1 + 7 * c1,
        6 * s2 + 8 * c2
      ]

      assert_close(l(N.rope(s(), x, 4, false, 10_000.0, 1.0, 0, nil)), expected)
    end

    test "traditional pairs, partial dims, scale and an int offset" do
      shape = {2, 2, 3, 6}
      xv = seq(72)
      x = t(xv, {:f, 32}, shape)

      for trad <- [false, true], {dims, scale, offset} <- [{6, 1.0, 0}, {4, 0.5, 5}] do
        y = N.rope(s(), x, dims, trad, 10.0, scale, offset, nil)
        assert_close(l(y), ref_rope(xv, shape, dims, trad, 10.0, scale, [offset]), 1.0e-5)
      end
    end

    test "offset as an array: a scalar, or one per batch" do
      shape = {2, 1, 3, 4}
      xv = seq(24)
      x = t(xv, {:f, 32}, shape)
      y = N.rope_array(s(), x, 4, false, 100.0, 1.0, t([3], {:s, 32}, {}), nil)
      assert_close(l(y), ref_rope(xv, shape, 4, false, 100.0, 1.0, [3]), 1.0e-5)
      assert_close(l(y), l(N.rope(s(), x, 4, false, 100.0, 1.0, 3, nil)), 1.0e-6)
      y = N.rope_array(s(), x, 4, true, 100.0, 1.0, t([0, 7], {:s, 32}), nil)
      assert_close(l(y), ref_rope(xv, shape, 4, true, 100.0, 1.0, [0, 7]), 1.0e-5)
    end

    test "explicit freqs replace the base" do
      shape = {1, 1, 4, 4}
      xv = seq(16)
      x = t(xv, {:f, 32}, shape)
      freqs = [2.0, 50.0]
      y = N.rope(s(), x, 4, false, 10_000.0, 1.0, 1, t(freqs))
      assert_close(l(y), ref_rope(xv, shape, 4, false, nil, 1.0, [1], freqs), 1.0e-5)
      y = N.rope_array(s(), x, 4, true, 10_000.0, 1.0, t([2], {:s, 32}, {}), t(freqs))
      assert_close(l(y), ref_rope(xv, shape, 4, true, nil, 1.0, [2], freqs), 1.0e-5)
    end
  end

  describe "scaled_dot_product_attention" do
    # softmax(q k^T * scale + mask) v from basic ops, heads of k/v repeated for grouped
    # queries (q reshaped to [B, Hkv, rep, L, D] against k/v expanded to [B, Hkv, 1, ...]).
    defp ref_sdpa(q, k, v, scale, mask \\ nil) do
      {b, hq, lq, d} = Emily.shape(q)
      {_, hk, lk, _} = Emily.shape(k)
      rep = div(hq, hk)
      q5 = N.reshape(s(), q, {b, hk, rep, lq, d})
      k5 = N.expand_dims(s(), k, [2])
      v5 = N.expand_dims(s(), v, [2])

      scores =
        N.matmul(s(), N.multiply(s(), q5, t([scale])), N.transpose(s(), k5, [0, 1, 2, 4, 3]))

      scores = N.reshape(s(), scores, {b, hq, lq, lk})

      scores =
        case mask do
          nil -> scores
          {:bool, m} -> N.where(s(), m, scores, t([:neg_infinity]))
          {:add, m} -> N.add(s(), scores, m)
        end

      p = N.reshape(s(), N.softmax(s(), scores, [-1], true), {b, hk, rep, lq, lk})
      N.reshape(s(), N.matmul(s(), p, v5), {b, hq, lq, Emily.shape(v) |> elem(3)})
    end

    test "hand-computed: one query over two keys" do
      q = t([1.0, 0.0], {:f, 32}, {1, 1, 1, 2})
      k = t([1.0, 0.0, 0.0, 1.0], {:f, 32}, {1, 1, 2, 2})
      v = t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {1, 1, 2, 2})
      # scores [1, 0]: weights e/(e+1), 1/(e+1)
      e = :math.exp(1)
      {w0, w1} = {e / (e + 1), 1 / (e + 1)}
      y = N.scaled_dot_product_attention(s(), q, k, v, 1.0, "", nil, nil)
      assert Emily.shape(y) == {1, 1, 1, 2}
      assert_close(l(y), [w0 + 3 * w1, 2 * w0 + 4 * w1])
      # scale 0: plain average
      assert_close(l(N.scaled_dot_product_attention(s(), q, k, v, 0.0, "", nil, nil)), [2.0, 3.0])
    end

    test "hand-computed: causal masking and a sink" do
      q = t([1.0, 0.0, 1.0, 0.0], {:f, 32}, {1, 1, 2, 2})
      k = t([1.0, 0.0, 0.0, 1.0], {:f, 32}, {1, 1, 2, 2})
      v = t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {1, 1, 2, 2})
      e = :math.exp(1)
      # query 0 sees key 0 only; query 1 sees both (scores [1, 0])
      {w0, w1} = {e / (e + 1), 1 / (e + 1)}
      y = N.scaled_dot_product_attention(s(), q, k, v, 1.0, "causal", nil, nil)
      # GPU kernels multiply f32 as TF32.
      assert_close(l(y), [1.0, 2.0, w0 + 3 * w1, 2 * w0 + 4 * w1], 1.0e-3)
      # a sink logit 0 adds exp(0) = 1 to the softmax denominator, and no value
      {u0, u1} = {e / (e + 2), 1 / (e + 2)}
      y = N.scaled_dot_product_attention(s(), q, k, v, 1.0, "", nil, t([0.0]))
      assert_close(l(y), [u0 + 3 * u1, 2 * u0 + 4 * u1, u0 + 3 * u1, 2 * u0 + 4 * u1], 1.0e-3)
    end

    test "causal masking aligns to the end of the keys" do
      # one query, three keys: the query is the last position and sees them all
      q = t(seq(4), {:f, 32}, {1, 1, 1, 4})
      k = t(seq(12, &:math.cos/1), {:f, 32}, {1, 1, 3, 4})
      v = t(seq(12, &(&1 * 1.0)), {:f, 32}, {1, 1, 3, 4})
      causal = N.scaled_dot_product_attention(s(), q, k, v, 0.5, "causal", nil, nil)
      assert_close(l(causal), l(ref_sdpa(q, k, v, 0.5)), 1.0e-5)
    end

    test "matches the composition: no mask, causal, bool and additive masks, grouped queries" do
      {b, hq, hk, lq, lk, d} = {2, 4, 2, 3, 5, 8}
      q = t(seq(b * hq * lq * d), {:f, 32}, {b, hq, lq, d})
      k = t(seq(b * hk * lk * d, &:math.cos(&1 * 0.3)), {:f, 32}, {b, hk, lk, d})
      v = t(seq(b * hk * lk * d, &(rem(&1, 7) - 3.0)), {:f, 32}, {b, hk, lk, d})
      scale = 1 / :math.sqrt(d)

      y = N.scaled_dot_product_attention(s(), q, k, v, scale, "", nil, nil)
      assert_close(l(y), l(ref_sdpa(q, k, v, scale)), 1.0e-5)

      # causal with Lq < Lk: query i sees keys 0 .. i + (Lk - Lq)
      keep = for i <- 0..(lq - 1), j <- 0..(lk - 1), do: j <= i + (lk - lq)
      causal_mask = t(keep, :bool, {lq, lk})
      y = N.scaled_dot_product_attention(s(), q, k, v, scale, "causal", nil, nil)
      assert_close(l(y), l(ref_sdpa(q, k, v, scale, {:bool, causal_mask})), 1.0e-5)

      # Array masks: the references in f32 on the CPU stream, since on a GPU these run
      # Emily's attention kernel (f32) and MLX's composition multiplies f32 as TF32.
      bool_mask = t(for(i <- 0..(lq * lk - 1), do: rem(i, 3) != 1), :bool, {1, 1, lq, lk})
      y = N.scaled_dot_product_attention(s(), q, k, v, scale, "array", bool_mask, nil)
      expect = with_cpu(fn -> l(ref_sdpa(q, k, v, scale, {:bool, bool_mask})) end)
      assert_close(l(y), expect, 1.0e-5)

      add_mask = t(seq(hq * lq * lk, &(-rem(&1, 4) * 0.5)), {:f, 32}, {hq, lq, lk})
      y = N.scaled_dot_product_attention(s(), q, k, v, scale, "array", add_mask, nil)
      expect = with_cpu(fn -> l(ref_sdpa(q, k, v, scale, {:add, add_mask})) end)
      assert_close(l(y), expect, 1.0e-5)
    end

    # On MLX's CUDA backend a decoding step's attention with an array mask is Emily's
    # kernel (cpp/cuda_attention.cc): Bumblebee's shapes (a [B, L, heads, D] cache read
    # transposed, grouped-query heads, a [B, 1, 1, L] padding mask), over a cache of more
    # keys than the block's 32 warps and one of fewer (some warps see no key), bool and
    # additive masks, one that hides every key, one of two axes and one of all four (the
    # kernel reads each as broadcast), in f32, bf16 and f16, against the CPU stream's f32
    # on the same rounded values.
    @tag :gpu
    test "a decoding step with an array mask on a GPU, against the CPU" do
      for lk <- [5, 301], do: check_gpu_decode_attention(lk)
    end

    defp check_gpu_decode_attention(lk) do
      gpu = Emily.Stream.default(:gpu)
      {b, hq, hk, d} = {2, 8, 2, 128}
      keep = for bi <- 0..(b - 1), j <- 0..(lk - 1), do: j < div(lk * (4 + bi), 6)
      lowest = -3.4028234663852886e38

      on = fn list, type, shape, stream ->
        Emily.from_list(list, type, shape: shape, stream: stream)
      end

      rounded = fn list, type -> l(Emily.from_list(list, type)) end

      for type <- [{:f, 32}, {:bf, 16}, {:f, 16}], lq <- [1, 8] do
        q = rounded.(seq(b * hq * lq * d, &:math.cos(&1 * 1.3)), type)
        k0 = rounded.(seq(b * lk * hk * d, &:math.sin(&1 * 0.37)), type)
        v0 = rounded.(seq(b * lk * hk * d, &:math.cos(&1 * 0.11)), type)

        run = fn stream, type ->
          cache = &N.transpose(stream, on.(&1, type, {b, lk, hk, d}, stream), [0, 2, 1, 3])
          {qs, ks, vs} = {on.(q, type, {b, hq, lq, d}, stream), cache.(k0), cache.(v0)}
          bool = on.(keep, :bool, {b, 1, 1, lk}, stream)

          add =
            on.(Enum.map(keep, &if(&1, do: 0.0, else: lowest)), {:f, 32}, {b, 1, 1, lk}, stream)

          # No key seen: every row gets the values' mean, as the composition gives.
          none = on.(Enum.map(keep, fn _ -> false end), :bool, {b, 1, 1, lk}, stream)
          # A mask of fewer axes (each query row its own keys), and one of every axis.
          rows = on.(for(i <- 1..lq, j <- 1..lk, do: rem(i + j, 3) != 0), :bool, {lq, lk}, stream)
          # (Each head and row its own additive part, so that a wrong stride on any axis shows.)
          parts = for x <- 0..(b * hq * lq * lk - 1), do: -rem(x * 7 + div(x, lk), 5) * 0.5
          parts = on.(parts, {:f, 32}, {b, hq, lq, lk}, stream)
          full = N.add(stream, N.broadcast_to(stream, add, {b, hq, lq, lk}), parts)

          for mask <- [
                bool,
                N.astype(stream, add, type),
                none,
                rows,
                N.astype(stream, full, type)
              ] do
            l(N.scaled_dot_product_attention(stream, qs, ks, vs, 0.088, "array", mask, nil))
          end
        end

        tol = %{{:f, 32} => 1.0e-5, {:bf, 16} => 1.0e-2, {:f, 16} => 2.0e-3}[type]

        for {got, want} <- Enum.zip(run.(gpu, type), run.(cpu(), {:f, 32})) do
          assert_close(got, want, tol)
        end
      end
    end

    # On an x86-64 CPU, up to 8 query rows run Emily's decoding kernel, which reads k and
    # v through their strides (a cache laid out [B, L, heads, D], transposed); more rows
    # run MLX's composition. Both against the reference, for either layout.
    test "a [B, L, heads, D] cache read transposed, for a step and for a prefill" do
      {b, hq, hk, lk, d} = {1, 4, 2, 13, 16}
      k0 = t(seq(b * lk * hk * d, &:math.sin(&1 * 0.7)), {:f, 32}, {b, lk, hk, d})
      v0 = t(seq(b * lk * hk * d, &:math.cos(&1 * 0.2)), {:f, 32}, {b, lk, hk, d})
      k = N.transpose(s(), k0, [0, 2, 1, 3])
      v = N.transpose(s(), v0, [0, 2, 1, 3])

      for lq <- [1, 8, 9, 13] do
        q = t(seq(b * hq * lq * d, &:math.cos(&1 * 1.3)), {:f, 32}, {b, hq, lq, d})
        keep = for i <- 0..(lq - 1), j <- 0..(lk - 1), do: j <= i + (lk - lq)
        y = N.scaled_dot_product_attention(s(), q, k, v, 0.25, "causal", nil, nil)
        expect = ref_sdpa(q, k, v, 0.25, {:bool, t(keep, :bool, {lq, lk})})
        assert_close(l(y), l(expect), 1.0e-5)
      end

      # More queries than keys: the first rows see no key, and get the values' mean (the
      # causal mask is the type's lowest value, as MLX's).
      k3 = N.slice(s(), k, [0, 0, 0, 0], [b, hk, 3, d], [1, 1, 1, 1])
      v3 = N.slice(s(), v, [0, 0, 0, 0], [b, hk, 3, d], [1, 1, 1, 1])

      for lq <- [5, 11] do
        q = t(seq(b * hq * lq * d, &:math.sin(&1 * 0.9)), {:f, 32}, {b, hq, lq, d})
        lowest = -3.4028234663852886e38
        add = for i <- 0..(lq - 1), j <- 0..2, do: if(j <= i + 3 - lq, do: 0.0, else: lowest)
        y = N.scaled_dot_product_attention(s(), q, k3, v3, 0.25, "causal", nil, nil)
        expect = ref_sdpa(q, k3, v3, 0.25, {:add, t(add, {:f, 32}, {lq, 3})})
        assert_close(l(y), l(expect), 1.0e-5)
      end
    end

    # More query rows than a step's, f32, on an x86-64 CPU: Emily's kernel runs the
    # composition's steps on q, k and v in place (an encoder's or a prompt's projections
    # laid out [B, L, heads, D], read transposed) and writes its output in that layout:
    # the composition's values, and its bits where the heads are not grouped. Keys read
    # through a strided last axis or broadcast rows are copied for BLAS first.
    test "a prompt's attention on projections laid out [B, L, heads, D]" do
      {b, h, l, d} = {2, 3, 37, 16}

      proj = fn f ->
        N.transpose(s(), t(seq(b * l * h * d, f), {:f, 32}, {b, l, h, d}), [0, 2, 1, 3])
      end

      q = proj.(&:math.cos(&1 * 1.3))
      k = proj.(&:math.sin(&1 * 0.7))
      v = proj.(&:math.cos(&1 * 0.2))
      keep = for bi <- 0..(b - 1), j <- 0..(l - 1), do: j < 30 + 7 * bi
      lowest = -3.4028234663852886e38
      bool = t(keep, :bool, {b, 1, 1, l})
      add = t(Enum.map(keep, &if(&1, do: 0.0, else: lowest)), {:f, 32}, {b, 1, 1, l})
      causal = t(for(i <- 0..(l - 1), j <- 0..(l - 1), do: j <= i), :bool, {l, l})
      bits = &Emily.to_binary/1

      with_cpu(fn ->
        for {mode, mask, ref} <- [
              {"", nil, nil},
              {"array", bool, {:bool, bool}},
              {"array", add, {:add, add}},
              {"causal", nil, {:bool, causal}}
            ] do
          y = N.scaled_dot_product_attention(s(), q, k, v, 0.25, mode, mask, nil)
          assert bits.(y) == bits.(ref_sdpa(q, k, v, 0.25, ref)), "mask #{inspect(ref)}"

          # Transposed back and flattened, as Bumblebee reads it.
          flat = N.reshape(s(), N.transpose(s(), y, [0, 2, 1, 3]), {b, l, h * d})

          assert bits.(flat) ==
                   bits.(
                     N.reshape(
                       s(),
                       N.transpose(s(), ref_sdpa(q, k, v, 0.25, ref), [0, 2, 1, 3]),
                       {b, l, h * d}
                     )
                   )
        end

        # Grouped-query heads: 6 query heads over the 3 key/value heads.
        q6 =
          N.transpose(s(), t(seq(b * l * 6 * d, &:math.cos(&1 * 0.9)), {:f, 32}, {b, l, 6, d}), [
            0,
            2,
            1,
            3
          ])

        y = N.scaled_dot_product_attention(s(), q6, k, v, 0.25, "array", add, nil)
        assert_close(l(y), l(ref_sdpa(q6, k, v, 0.25, {:add, add})), 1.0e-5)

        # Keys with a strided last axis, and one key row broadcast over the length.
        ks =
          N.transpose(s(), t(seq(b * h * d * l, &:math.sin(&1 * 0.3)), {:f, 32}, {b, h, d, l}), [
            0,
            1,
            3,
            2
          ])

        y = N.scaled_dot_product_attention(s(), q, ks, v, 0.25, "", nil, nil)
        assert_close(l(y), l(ref_sdpa(q, ks, v, 0.25)), 1.0e-5)

        k1 =
          N.broadcast_to(
            s(),
            N.slice(s(), k, [0, 0, 0, 0], [b, h, 1, d], [1, 1, 1, 1]),
            {b, h, l, d}
          )

        y = N.scaled_dot_product_attention(s(), q, k1, v, 0.25, "causal", nil, nil)
        assert_close(l(y), l(ref_sdpa(q, k1, v, 0.25, {:bool, causal})), 1.0e-5)
      end)
    end

    # bf16 operands of a decoding step (Emily's kernel on an x86-64 CPU, and on a CUDA
    # GPU with an array mask), and of a prompt on a CPU (on x86-64, Emily's prompt kernel
    # on the operands widened to f32): against the f32 reference on the same rounded
    # values, within bf16's rounding of the result; the causal mask, a bool and a bf16
    # additive mask, grouped-query heads, a cache read transposed.
    test "bf16 decoding steps and prompts against the f32 reference" do
      {b, hq, hk, lk, d} = {1, 4, 2, 37, 64}
      bf = fn list, shape -> t(list, {:bf, 16}, shape) end
      f32 = fn x -> N.astype(s(), x, {:f, 32}) end

      k =
        N.transpose(s(), bf.(seq(b * lk * hk * d, &:math.sin(&1 * 0.7)), {b, lk, hk, d}), [
          0,
          2,
          1,
          3
        ])

      v =
        N.transpose(s(), bf.(seq(b * lk * hk * d, &:math.cos(&1 * 0.2)), {b, lk, hk, d}), [
          0,
          2,
          1,
          3
        ])

      keep = for j <- 0..(lk - 1), do: rem(j, 5) != 2

      for lq <- [1, 8, 9, 37], stream = if(lq > 8, do: cpu(), else: s()) do
        q = bf.(seq(b * hq * lq * d, &:math.cos(&1 * 1.3)), {b, hq, lq, d})
        causal = for i <- 0..(lq - 1), j <- 0..(lk - 1), do: j <= i + (lk - lq)
        bool = t(keep, :bool, {1, 1, 1, lk})
        add = bf.(Enum.map(keep, &if(&1, do: 0.0, else: -1.0e4)), {1, 1, 1, lk})

        for {mode, mask, ref} <- [
              {"causal", nil, {:bool, t(causal, :bool, {lq, lk})}},
              {"array", bool, {:bool, bool}},
              {"array", add, {:add, f32.(add)}}
            ] do
          y = N.scaled_dot_product_attention(stream, q, k, v, 0.125, mode, mask, nil)
          assert Emily.dtype(y) == {:bf, 16}
          expect = with_cpu(fn -> l(ref_sdpa(f32.(q), f32.(k), f32.(v), 0.125, ref)) end)
          assert_close(l(y), expect, 1.0e-2)
        end
      end
    end

    test "sinks against the composition with an extra softmax column" do
      {hq, lq, lk, d} = {2, 2, 3, 4}
      q = t(seq(hq * lq * d), {:f, 32}, {1, hq, lq, d})
      k = t(seq(hq * lk * d, &:math.cos/1), {:f, 32}, {1, hq, lk, d})
      v = t(seq(hq * lk * d, &(&1 / 3)), {:f, 32}, {1, hq, lk, d})
      sinks = [0.5, -1.0]
      y = N.scaled_dot_product_attention(s(), q, k, v, 1.0, "", nil, t(sinks))
      # the sink is a key whose value is zero: append it to k (scores) and v
      scores = N.matmul(s(), q, N.transpose(s(), k, [0, 1, 3, 2]))
      sink_col = N.broadcast_to(s(), t(sinks, {:f, 32}, {1, hq, 1, 1}), {1, hq, lq, 1})
      p = N.softmax(s(), N.concatenate(s(), [sink_col, scores], 3), [-1], true)
      v0 = N.concatenate(s(), [N.full(s(), {1, hq, 1, d}, 0.0, {:f, 32}), v], 2)
      assert_close(l(y), l(N.matmul(s(), p, v0)), 1.0e-5)
    end
  end

  test "bad shapes and arguments raise Emily.Error; the stream survives" do
    x = t(seq(8), {:f, 32}, {1, 1, 2, 4})
    q3 = t(seq(8), {:f, 32}, {1, 2, 4})

    cases = [
      {"rms_norm", fn -> N.rms_norm(s(), x, t([1.0, 2.0]), 0.0) end},
      {"layer_norm", fn -> N.layer_norm(s(), x, nil, t([1.0, 2.0, 3.0]), 0.0) end},
      {"rope", fn -> N.rope(s(), x, 3, false, 10.0, 1.0, 0, nil) end},
      {"rope", fn -> N.rope(s(), x, 4, false, 10.0, 1.0, 0, t([1.0, 2.0, 3.0])) end},
      {"rope_array", fn -> N.rope_array(s(), x, 4, false, 10.0, 1.0, t([1.0]), nil) end},
      {"scaled_dot_product_attention",
       fn -> N.scaled_dot_product_attention(s(), q3, q3, q3, 1.0, "", nil, nil) end},
      {"scaled_dot_product_attention",
       fn -> N.scaled_dot_product_attention(s(), x, x, x, 1.0, "sliding", nil, nil) end},
      {"scaled_dot_product_attention",
       fn ->
         N.scaled_dot_product_attention(s(), x, x, x, 1.0, "causal", t([true], :bool), nil)
       end},
      {"scaled_dot_product_attention",
       fn -> N.scaled_dot_product_attention(s(), x, x, x, 1.0, "", nil, t([1.0, 2.0])) end},
      {"scaled_dot_product_attention",
       fn ->
         N.scaled_dot_product_attention(
           s(),
           t([1, 2], {:s, 32}, {1, 1, 1, 2}),
           t([1, 2], {:s, 32}, {1, 1, 1, 2}),
           t([1, 2], {:s, 32}, {1, 1, 1, 2}),
           1.0,
           "",
           nil,
           nil
         )
       end}
    ]

    for {name, fun} <- cases do
      e = assert_raise Emily.Error, fn -> l(fun.()) end
      assert e.message =~ name <> ":", e.message
      assert_alive()
    end

    assert_raise ArgumentError, fn -> N.rms_norm(s(), x, :none, 0.0) end

    assert_raise ArgumentError, fn ->
      N.scaled_dot_product_attention(s(), x, x, x, 1.0, :causal, nil, nil)
    end
  end
end
