defmodule Emily.Native.QuantTest do
  use Emily.TestCase, async: true
  import Bitwise

  defp assert_alive, do: assert(l(N.add(s(), t([1.0]), t([2.0]))) == [3.0])

  # A deterministic, uneven matrix (rows of different scales) for round trips.
  defp data(rows, cols) do
    for j <- 0..(rows - 1), i <- 0..(cols - 1) do
      :math.sin(i * 0.37 + j * 1.3) * (1 + 0.3 * j) * (1 + rem(i, 17) / 5)
    end
  end

  defp groups(flat, group_size), do: Enum.chunk_every(flat, group_size)

  defp mm_t(x, w, k) do
    # x [M, K] times w [N, K] transposed, in Elixir
    for xr <- Enum.chunk_every(x, k),
        do: for(wr <- Enum.chunk_every(w, k), do: Enum.zip_with(xr, wr, &(&1 * &2)) |> Enum.sum())
  end

  describe "affine" do
    test "hand-computed 4-bit packing, scales and biases" do
      # w = -3.75 + 0.25 q with q = 0..15, 15..0: scale 0.25, bias -3.75, nibbles LSB first
      q = Enum.to_list(0..15) ++ Enum.to_list(15..0//-1)
      w = t(Enum.map(q, &(-3.75 + 0.25 * &1)), {:f, 32}, {1, 32})
      [wq, scales, biases] = N.quantize(s(), w, 32, 4)
      assert Emily.dtype(wq) == {:u, 32}
      assert Emily.shape(wq) == {1, 4}
      assert l(wq) == [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567]
      assert l(scales) == [0.25]
      assert l(biases) == [-3.75]
      assert l(N.dequantize(s(), wq, scales, biases, 32, 4, "affine", nil, {:f, 32})) == l(w)
    end

    test "hand-computed 8-bit packing: one byte per value, little-endian words" do
      # w = -63.75 + 0.25 q with q = [0, 255, 1..30]: spanning all 255 steps gives scale
      # 0.25 and bias -63.75 exactly
      q = [0, 255] ++ Enum.to_list(1..30)
      w = t(Enum.map(q, &(-63.75 + 0.25 * &1)), {:f, 32}, {1, 32})
      [wq, scales, biases] = N.quantize(s(), w, 32, 8)
      assert Emily.shape(wq) == {1, 8}
      assert hd(l(wq)) == 0 + (255 <<< 8) + (1 <<< 16) + (2 <<< 24)
      assert {l(scales), l(biases)} == {[0.25], [-63.75]}
      assert l(N.dequantize(s(), wq, scales, biases, 32, 8, "affine", nil, {:f, 32})) == l(w)
    end

    # MLX snaps zero onto the grid (the group's edge value is represented exactly), so
    # the bound is a full step, range / (2^bits - 1), rather than half of one.
    test "round trip within one step per group, bits 2..8, group sizes 32, 64, 128" do
      flat = data(4, 256)
      w = t(flat, {:f, 32}, {4, 256})

      for bits <- [2, 3, 4, 5, 6, 8], gs <- [32, 64, 128] do
        [wq, sc, bi] = N.quantize(s(), w, gs, bits)
        assert Emily.shape(wq) == {4, div(256 * bits, 32)}
        assert Emily.shape(sc) == {4, div(256, gs)}
        back = l(N.dequantize(s(), wq, sc, bi, gs, bits, "affine", nil, {:f, 32}))

        for {wg, dg} <- Enum.zip(groups(flat, gs), groups(back, gs)) do
          step = (Enum.max(wg) - Enum.min(wg)) / (2 ** bits - 1)
          err = Enum.zip_with(wg, dg, &abs(&1 - &2)) |> Enum.max()

          assert err <= step * 1.0001 + 1.0e-6,
                 "bits #{bits}, group #{gs}: error #{err} > step #{step}"
        end
      end
    end

    test "bf16 and f16 weights keep their dtype in scales and the dequantized result" do
      for dt <- [{:bf, 16}, {:f, 16}] do
        [wq, sc, bi] = N.quantize(s(), t(data(2, 64), dt, {2, 64}), 64, 4)
        assert {Emily.dtype(sc), Emily.dtype(bi)} == {dt, dt}
        assert Emily.dtype(N.dequantize(s(), wq, sc, bi, 64, 4, "affine", nil, dt)) == dt
      end
    end

    test "quantized_matmul equals dequantize + matmul, transposed or not" do
      {m, k, n} = {3, 128, 64}
      x = t(data(m, k) |> Enum.map(&(&1 / 3)), {:f, 32}, {m, k})

      for bits <- [2, 4, 8], gs <- [32, 128] do
        w = t(data(n, k), {:f, 32}, {n, k})
        [wq, sc, bi] = N.quantize(s(), w, gs, bits)
        dw = N.dequantize(s(), wq, sc, bi, gs, bits, "affine", nil, {:f, 32})
        y = N.quantized_matmul(s(), x, wq, sc, bi, true, gs, bits, "affine")
        assert Emily.shape(y) == {m, n}
        # Each error is bounded by the sum of the |x| |w| products: f32 rounding, but on
        # a GPU one group per row (gs 128) is a TF32 matmul (guards.h: MLX's kernel for
        # it is wrong there).
        u = if Emily.Stream.device(s()) == :gpu and gs >= k, do: 2.0 ** -10, else: 1.0e-5
        bound = mm_t(Enum.map(l(x), &abs/1), Enum.map(l(dw), &abs/1), k) |> List.flatten()

        for {a, e, b} <- Enum.zip([l(y), List.flatten(mm_t(l(x), l(dw), k)), bound]) do
          assert abs(a - e) <= u * b, "bits #{bits}, group #{gs}: #{a} against #{e}"
        end
      end

      # transpose false: w is [K, N], quantized along N. The reference is computed here:
      # a GPU's f32 matmul is TF32.
      w = t(data(k, n), {:f, 32}, {k, n})
      [wq, sc, bi] = N.quantize(s(), w, 64, 4)
      dw = N.dequantize(s(), wq, sc, bi, 64, 4, "affine", nil, {:f, 32})
      y = N.quantized_matmul(s(), x, wq, sc, bi, false, 64, 4, "affine")
      dw_t = l(dw) |> Enum.chunk_every(n) |> Enum.zip_with(& &1) |> List.flatten()
      assert_close(l(y), List.flatten(mm_t(l(x), dw_t, k)), 1.0e-4)
    end

    test "gather_qmm picks experts by index" do
      {e, n, k} = {3, 32, 64}
      w = t(data(e * n, k), {:f, 32}, {e, n, k})
      [wq, sc, bi] = N.quantize(s(), w, 32, 4)

      dw =
        l(N.dequantize(s(), wq, sc, bi, 32, 4, "affine", nil, {:f, 32}))
        |> Enum.chunk_every(n * k)

      # two tokens [2, 1, K], routed to experts 2 and 0
      xv = data(2, k) |> Enum.map(&(&1 / 4))
      x = t(xv, {:f, 32}, {2, 1, k})
      idx = t([2, 0], {:u, 32})
      y = N.gather_qmm(s(), x, wq, sc, bi, nil, idx, true, 32, 4, "affine", false)
      assert Emily.shape(y) == {2, 1, n}

      expected =
        for {xr, ex} <- Enum.zip(Enum.chunk_every(xv, k), [2, 0]),
            do: mm_t(xr, Enum.at(dw, ex), k)

      assert_close(l(y), List.flatten(expected), 1.0e-4)
      # sorted indices (a promise that enables a faster path) give the same products
      ys = N.gather_qmm(s(), x, wq, sc, bi, nil, t([0, 2], {:u, 32}), true, 32, 4, "affine", true)

      expected =
        for {xr, ex} <- Enum.zip(Enum.chunk_every(xv, k), [0, 2]),
            do: mm_t(xr, Enum.at(dw, ex), k)

      assert_close(l(ys), List.flatten(expected), 1.0e-4)
    end
  end

  describe "microscaling modes" do
    # e2m1 codes: 0 0.5 1 1.5 2 3 4 6 -> 0..7 (sign in bit 3)
    @e2m1 [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

    test "mxfp4 and nvfp4: exact e2m1 values, hand-computed codes and scales" do
      with_cpu(fn ->
        w = t(List.flatten(List.duplicate(@e2m1, 4)), {:f, 32}, {1, 32})
        # mxfp4: one E8M0 scale per 32 (2^0 = 127); nvfp4: one E4M3 scale per 16 (1.0 = 0x38)
        for {mode, gs, scales} <- [{"mxfp4", 32, [127]}, {"nvfp4", 16, [0x38, 0x38]}] do
          [wq, sc] = N.quantize_mode(s(), w, gs, 4, mode, nil)
          assert l(wq) == List.duplicate(0x76543210, 4)
          assert {Emily.dtype(sc), l(sc)} == {{:u, 8}, scales}
          assert l(N.dequantize(s(), wq, sc, nil, gs, 4, mode, nil, {:f, 32})) == l(w)
        end

        neg = t(List.flatten(List.duplicate(Enum.map(@e2m1, &(-&1)), 4)), {:f, 32}, {1, 32})
        [wq, _] = N.quantize_mode(s(), neg, 32, 4, "mxfp4", nil)
        # -0 encodes as +0
        assert l(wq) == List.duplicate(0xFEDCBA90, 4)
      end)
    end

    test "mxfp8: hand-computed E4M3 codes" do
      # 1 = 0x38, 2 = 0x40, 0.5 = 0x30, 448 = 0x7E, -3.5 = 0xC6, 2^-6 = 0x08, -448 = 0xFE, 240 = 0x77
      vals = [1.0, 2.0, 0.5, 448.0, -3.5, 0.015625, -448.0, 240.0]
      w = t(List.flatten(List.duplicate(vals, 4)), {:f, 32}, {1, 32})
      [wq, sc] = N.quantize_mode(s(), w, 32, 8, "mxfp8", nil)
      assert Enum.take(l(wq), 2) == [0x7E304038, 0x77FE08C6]
      assert l(sc) == [127]
      back = N.dequantize(s(), wq, sc, nil, 32, 8, "mxfp8", nil, {:f, 32})
      assert l(back) == l(w)
    end

    test "nvfp4's global scale (the tensor's amax) keeps tiny weights representable" do
      with_cpu(fn ->
        flat = Enum.map(data(2, 64), &(&1 * 1.0e-5))
        w = t(flat, {:f, 32}, {2, 64})
        amax = flat |> Enum.map(&abs/1) |> Enum.max()
        # without it, amax / 6 underflows E4M3: every scale is 0 and so is every value
        [wq, sc] = N.quantize_mode(s(), w, 16, 4, "nvfp4", nil)
        assert Enum.uniq(l(sc)) == [0]

        assert Enum.uniq(l(N.dequantize(s(), wq, sc, nil, 16, 4, "nvfp4", nil, {:f, 32}))) == [
                 0.0
               ]

        # with it, scales are amax_g / 6 * (448 * 6 / amax): the largest group gets 448 (0x7E)
        g = t([amax], {:f, 32}, {})
        [wq, sc] = N.quantize_mode(s(), w, 16, 4, "nvfp4", g)
        assert Enum.max(l(sc)) == 0x7E
        back = l(N.dequantize(s(), wq, sc, nil, 16, 4, "nvfp4", g, {:f, 32}))

        for {wg, dg} <- Enum.zip(groups(flat, 16), groups(back, 16)) do
          gmax = wg |> Enum.map(&abs/1) |> Enum.max()
          assert Enum.zip_with(wg, dg, &abs(&1 - &2)) |> Enum.max() <= gmax / 4
        end
      end)
    end

    test "the shared power-of-two scale rounds up, so nothing clips" do
      # amax 600: 600 / 448 needs 2^1 (byte 128); 600 / 2 = 300 -> nearest E4M3 288 -> 576
      w = t([600.0 | List.duplicate(1.0, 31)], {:f, 32}, {1, 32})
      [wq, sc] = N.quantize_mode(s(), w, 32, 8, "mxfp8", nil)
      assert l(sc) == [128]

      assert Enum.take(l(N.dequantize(s(), wq, sc, nil, 32, 8, "mxfp8", nil, {:f, 32})), 2) == [
               576.0,
               1.0
             ]

      # amax 8.4: 8.4 / 6 needs 2^1; 4.2 -> nearest e2m1 4 -> 8
      w = t([8.4 | List.duplicate(1.0, 31)], {:f, 32}, {1, 32})
      [wq, sc] = N.quantize_mode(s(), w, 32, 4, "mxfp4", nil)
      assert l(sc) == [128]

      assert Enum.take(l(N.dequantize(s(), wq, sc, nil, 32, 4, "mxfp4", nil, {:f, 32})), 2) == [
               8.0,
               1.0
             ]
    end

    # Bounds per group, amax = max |w| of the group. mxfp4: the scale is amax / 6 rounded
    # up to a power of two, so amax / scale is in (3, 6] and the error is at most one
    # scale unit (half the widest e2m1 gap, 4 to 6), <= amax / 4 (values above 4 units
    # need amax >= 4 units; below, gaps are <= 1 unit). nvfp4: the scale is amax / 6 in
    # E4M3 (within 1/16), the same bound holds. mxfp8: E4M3 has 3 mantissa bits, so an
    # element is off by at most 1/16 of itself, <= amax / 16.
    test "round trips within amax / 4 (fp4) and amax / 16 (fp8)" do
      flat = data(8, 256)
      w = t(flat, {:f, 32}, {8, 256})

      for {mode, gs, bits, frac} <- [
            {"mxfp4", 32, 4, 4},
            {"nvfp4", 16, 4, 4},
            {"mxfp8", 32, 8, 16}
          ] do
        [wq, sc] = N.quantize_mode(s(), w, gs, bits, mode, nil)
        back = l(N.dequantize(s(), wq, sc, nil, gs, bits, mode, nil, {:f, 32}))

        for {wg, dg} <- Enum.zip(groups(flat, gs), groups(back, gs)) do
          amax = wg |> Enum.map(&abs/1) |> Enum.max()
          err = Enum.zip_with(wg, dg, &abs(&1 - &2)) |> Enum.max()
          assert err <= amax / frac, "#{mode}: error #{err} > #{amax / frac}"
        end
      end
    end

    test "quantized_matmul in the fp modes equals dequantize + matmul" do
      {m, k, n} = {3, 128, 32}
      x = t(data(m, k) |> Enum.map(&(&1 / 3)), {:f, 32}, {m, k})
      w = t(data(n, k), {:f, 32}, {n, k})

      for {mode, gs, bits} <- [{"mxfp4", 32, 4}, {"nvfp4", 16, 4}, {"mxfp8", 32, 8}] do
        [wq, sc] = N.quantize_mode(s(), w, gs, bits, mode, nil)
        dw = N.dequantize(s(), wq, sc, nil, gs, bits, mode, nil, {:f, 32})
        y = N.quantized_matmul(s(), x, wq, sc, nil, true, gs, bits, mode)
        assert_close(l(y), List.flatten(mm_t(l(x), l(dw), k)), 1.0e-4)
      end
    end
  end

  test "bad bits, groups, modes and shapes raise Emily.Error; the stream survives" do
    w = t(data(2, 64), {:f, 32}, {2, 64})
    [wq, sc, bi] = N.quantize(s(), w, 32, 4)

    cases = [
      {"quantize", "bits", fn -> N.quantize(s(), w, 32, 7) end},
      {"quantize", "group size", fn -> N.quantize(s(), w, 48, 4) end},
      {"quantize", "divisible",
       fn -> N.quantize(s(), t(data(1, 48), {:f, 32}, {1, 48}), 32, 4) end},
      {"quantize", "floating",
       fn -> N.quantize(s(), t(List.duplicate(1, 64), {:s, 32}, {2, 32}), 32, 4) end},
      {"quantize", "at least 2", fn -> N.quantize(s(), t(data(1, 64)), 32, 4) end},
      {"quantize_mode", "mode", fn -> N.quantize_mode(s(), w, 32, 4, "int4", nil) end},
      {"quantize_mode", "group", fn -> N.quantize_mode(s(), w, 16, 4, "mxfp4", nil) end},
      {"quantize_mode", "the op table says 2",
       fn -> N.quantize_mode(s(), w, 32, 4, "affine", nil) end},
      {"dequantize", "dequantize",
       fn -> N.dequantize(s(), wq, bi, nil, 32, 4, "affine", nil, {:f, 32}) end},
      {"dequantize", "dequantize",
       fn -> N.dequantize(s(), wq, sc, bi, 64, 4, "affine", nil, {:f, 32}) end},
      {"quantized_matmul", "quantized_matmul",
       fn ->
         N.quantized_matmul(
           s(),
           t(data(1, 32), {:f, 32}, {1, 32}),
           wq,
           sc,
           bi,
           true,
           32,
           4,
           "affine"
         )
       end},
      {"gather_qmm", "gather_qmm",
       fn ->
         N.gather_qmm(
           s(),
           t(data(1, 64), {:f, 32}, {1, 64}),
           wq,
           sc,
           bi,
           nil,
           t([0.5]),
           true,
           32,
           4,
           "affine",
           false
         )
       end}
    ]

    for {name, pattern, fun} <- cases do
      e = eval_error(fun)

      assert e.message =~ name <> ":", e.message
      assert e.message =~ pattern, e.message
      assert_alive()
    end

    assert_raise ArgumentError, fn -> N.quantize(s(), w, "32", 4) end

    assert_raise ArgumentError, fn ->
      N.dequantize(s(), wq, sc, bi, 32, 4, :affine, nil, {:f, 32})
    end
  end
end
