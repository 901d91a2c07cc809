defmodule Emily.GuardsTest do
  # Inputs on which MLX's CPU kernels trap (SIGFPE, which would take the VM down) and the
  # guards that steer them away. Oracles: two's complement arithmetic by hand.
  use Emily.TestCase, async: true

  for {type, min} <- [{{:s, 32}, -2_147_483_648}, {{:s, 64}, -9_223_372_036_854_775_808}] do
    test "floor_divide and remainder of MIN by -1 wrap instead of trapping (#{inspect(type)})" do
      a = t([unquote(min), -7, 7, unquote(min), 9], unquote(Macro.escape(type)))
      b = t([-1, 2, -1, 3, -1], unquote(Macro.escape(type)))
      # MIN // -1 overflows: it wraps to MIN. floor(-7 / 2) = -4; floor(MIN / 3) rounds down.
      assert l(N.floor_divide(s(), a, b)) ==
               [unquote(min), -4, -7, Integer.floor_div(unquote(min), 3), -9]

      # MLX's remainder takes the divisor's sign: -7 mod 2 = 1; MIN mod 3 = 1 for both widths
      # (2^31 = 3 * 715827882 + 2 and 2^63 = 3 * 3074457345618258602 + 2).
      assert l(N.remainder(s(), a, b)) == [0, 1, 0, 1, 0]
    end
  end

  test "unsigned and float division are unchanged by the guard" do
    assert l(N.floor_divide(s(), t([7, 255], {:u, 8}), t([2, 255], {:u, 8}))) == [3, 1]
    assert l(N.floor_divide(s(), t([-7.0, 7.5]), t([2.0, -1.0]))) == [-4.0, -8.0]
    assert l(N.remainder(s(), t([-7.0]), t([-1.0]))) == [-0.0]
  end

  test "a zero slice stride is an Emily.Error, not a division by zero" do
    x = t([1.0, 2.0, 3.0])

    assert_raise Emily.Error, ~r/strides must be non-zero/, fn ->
      l(N.slice(s(), x, [0], [3], [0]))
    end

    assert l(N.slice(s(), x, [2], [-4], [-1])) == [3.0, 2.0, 1.0]

    # slice_update sizes its slice the same way (found by the fuzzer on a GPU build).
    assert_raise Emily.Error, ~r/strides must be non-zero/, fn ->
      l(
        N.slice_update(s(), t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {2, 2}), t([9.0]), [0, 0], [1, 1], [
          1,
          0
        ])
      )
    end

    assert l(N.slice_update(s(), x, t([9.0, 8.0]), [0], [3], [2])) == [9.0, 2.0, 8.0]
    assert l(N.add(s(), x, x)) == [2.0, 4.0, 6.0]
  end

  test "ints arguments outside 32 bits are refused, not wrapped" do
    x = t([1.0, 2.0])

    assert_raise ArgumentError, ~r/does not fit in 32 bits/, fn ->
      N.sum(s(), x, [2 ** 32], false)
    end

    assert_raise ArgumentError, ~r/does not fit in 32 bits/, fn ->
      N.slice(s(), x, [0], [2 ** 40], [1])
    end

    assert l(N.sum(s(), x, [0], false)) == [3.0]
  end

  # Each call below took the VM down (SIGFPE: MLX divides by a group count, a channel
  # count, a head count or an operand size) before its guard.
  describe "integer arguments and sizes MLX divides by" do
    test "conv groups of 0 or less are refused" do
      x = N.full(s(), {1, 4, 2}, 1.0, {:f, 32})
      w = N.full(s(), {2, 2, 1}, 1.0, {:f, 32})

      for groups <- [0, -1] do
        e = eval_error(fn -> N.conv_general(s(), x, w, [], [], [], [], [], groups, false) end)
        assert e.message =~ "groups must be >= 1"
      end

      # Nx's conv (feature and batch groups) likewise.
      assert eval_error(fn ->
               N.conv(
                 s(),
                 N.full(s(), {1, 2, 4}, 1.0, {:f, 32}),
                 w,
                 [],
                 [],
                 [],
                 [],
                 [],
                 0,
                 1,
                 [],
                 [],
                 []
               )
             end).message =~ "group sizes must be >= 1"
    end

    test "a convolution over no input channels is zeros (an empty sum)" do
      for {groups, xs, ws} <- [{1, {1, 4, 0}, {2, 2, 0}}, {2, {1, 4, 0}, {2, 2, 0}}] do
        y =
          N.conv_general(
            s(),
            N.full(s(), xs, 1.0, {:f, 32}),
            N.full(s(), ws, 1.0, {:f, 32}),
            [],
            [],
            [],
            [],
            [],
            groups,
            false
          )

        # 4 positions, kernel 2: 3 outputs of 2 channels.
        assert Emily.shape(y) == {1, 3, 2}
        assert l(y) == List.duplicate(0.0, 6)
      end

      y =
        N.conv_general(
          s(),
          N.full(s(), {1, 3, 3, 0}, 1.0, {:f, 32}),
          N.full(s(), {2, 2, 2, 0}, 1.0, {:f, 32}),
          [],
          [],
          [],
          [],
          [],
          1,
          false
        )

      assert Emily.shape(y) == {1, 2, 2, 2}
      assert l(y) == List.duplicate(0.0, 8)

      y =
        N.conv(
          s(),
          N.full(s(), {1, 0, 4}, 1.0, {:f, 32}),
          N.full(s(), {2, 0, 2}, 1.0, {:f, 32}),
          [],
          [],
          [],
          [],
          [],
          1,
          1,
          [],
          [],
          []
        )

      assert Emily.shape(y) == {1, 2, 3}
      assert l(y) == List.duplicate(0.0, 6)
    end

    test "quantized matmuls of empty operands give zeros or empty results" do
      f = fn shape, dtype -> N.full(s(), shape, 1.0, dtype) end
      # K = 0: every output is an empty sum.
      y =
        N.quantized_matmul(
          s(),
          f.({2, 0}, {:f, 32}),
          f.({3, 0}, {:u, 32}),
          f.({3, 0}, {:f, 32}),
          f.({3, 0}, {:f, 32}),
          true,
          64,
          4,
          "affine"
        )

      assert Emily.shape(y) == {2, 3}
      assert l(y) == List.duplicate(0.0, 6)

      [w, scales, biases] = N.quantize(s(), f.({4, 64}, {:f, 32}), 64, 4)

      assert Emily.shape(
               N.quantized_matmul(
                 s(),
                 f.({0, 64}, {:f, 32}),
                 w,
                 scales,
                 biases,
                 true,
                 64,
                 4,
                 "affine"
               )
             ) == {0, 4}

      assert l(
               N.quantized_matmul(
                 s(),
                 f.({0, 64}, {:f, 32}),
                 w,
                 scales,
                 biases,
                 true,
                 64,
                 4,
                 "affine"
               )
             ) == []

      [w, scales, biases] = N.quantize(s(), f.({0, 64}, {:f, 32}), 64, 4)

      assert l(
               N.quantized_matmul(
                 s(),
                 f.({2, 64}, {:f, 32}),
                 w,
                 scales,
                 biases,
                 true,
                 64,
                 4,
                 "affine"
               )
             ) == []

      y =
        N.gather_qmm(
          s(),
          f.({2, 0}, {:f, 32}),
          f.({3, 0}, {:u, 32}),
          f.({3, 0}, {:f, 32}),
          f.({3, 0}, {:f, 32}),
          nil,
          nil,
          true,
          64,
          4,
          "affine",
          false
        )

      assert l(y) == List.duplicate(0.0, 6)
    end

    test "attention over keys with no heads" do
      f = fn shape -> N.full(s(), shape, 1.0, {:f, 32}) end
      # Queries with heads: refused (MLX divides the query heads by the key heads).
      e =
        eval_error(fn ->
          N.scaled_dot_product_attention(
            s(),
            f.({1, 2, 2, 4}),
            f.({1, 0, 2, 4}),
            f.({1, 0, 2, 4}),
            1.0,
            "",
            nil,
            nil
          )
        end)

      assert e.message =~ "no heads"
      # No query heads either: an empty result of the query's batch and length, v's width.
      y =
        N.scaled_dot_product_attention(
          s(),
          f.({1, 0, 2, 4}),
          f.({1, 0, 2, 4}),
          f.({1, 0, 2, 3}),
          1.0,
          "",
          nil,
          nil
        )

      assert Emily.shape(y) == {1, 0, 2, 3}
      assert l(y) == []
    end

    test "gather_mm and gather_qmm clamp their batch indices" do
      # a: two 2x2 matrices [[1, 2], [3, 4]] and [[5, 6], [7, 8]]; index 5 reads the last.
      a = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], {:f, 32}, {2, 2, 2})
      b = N.full(s(), {2, 2}, 1.0, {:f, 32})
      assert l(N.gather_mm(s(), a, b, t([5], {:u, 32}), nil, false)) == [11.0, 11.0, 15.0, 15.0]
      assert l(N.gather_mm(s(), a, b, t([1], {:u, 32}), nil, false)) == [11.0, 11.0, 15.0, 15.0]
      assert l(N.gather_mm(s(), a, b, t([-3], {:s, 32}), nil, false)) == [3.0, 3.0, 7.0, 7.0]

      x = N.full(s(), {1, 64}, 1.0, {:f, 32})

      w =
        N.concatenate(
          s(),
          [N.full(s(), {1, 2, 64}, 1.0, {:f, 32}), N.full(s(), {1, 2, 64}, 2.0, {:f, 32})],
          0
        )

      [qw, scales, biases] = N.quantize(s(), w, 64, 4)

      far =
        l(
          N.gather_qmm(
            s(),
            x,
            qw,
            scales,
            biases,
            nil,
            t([7], {:u, 32}),
            true,
            64,
            4,
            "affine",
            false
          )
        )

      last =
        l(
          N.gather_qmm(
            s(),
            x,
            qw,
            scales,
            biases,
            nil,
            t([1], {:u, 32}),
            true,
            64,
            4,
            "affine",
            false
          )
        )

      assert far == last
      assert_close(last, [128.0, 128.0], 1.0e-2)
    end
  end

  describe "arguments that broke the VM without crashing it" do
    test "the NIF refuses to release a default stream" do
      for device <- Emily.devices() do
        stream = Emily.Stream.default(device)

        assert_raise ArgumentError, ~r/default stream and cannot be released/, fn ->
          N.stream_release(stream)
        end

        refute Emily.Stream.released?(stream)
        assert l(N.add(stream, t([1.0]), t([2.0]))) == [3.0]
      end

      # Any other stream is released as before; a released stream cannot be pinned.
      st = Emily.Stream.new(:cpu)
      assert N.stream_release(st) == :ok
      assert_raise ArgumentError, ~r/has been released/, fn -> N.stream_pin(st) end
      pinned = Emily.Stream.new(:cpu)
      assert N.stream_pin(pinned) == :ok
      assert_raise ArgumentError, ~r/cannot be released/, fn -> N.stream_release(pinned) end
    end

    test "a memory limit of 0 is refused by the NIF" do
      ref = make_ref()

      assert_raise ArgumentError, ~r/positive number of bytes, got 0/, fn ->
        N.set_memory_limit(ref, cpu(), 0)
      end

      assert l(N.add(s(), t([1.0]), t([1.0]))) == [2.0]
    end

    test "eigh and eigvalsh take uplo \"L\" or \"U\" only" do
      a = t([2.0, 1.0, 1.0, 2.0], {:f, 32}, {2, 2})

      for uplo <- ["X", "", "LL", "l"] do
        assert eval_error(fn -> N.eigh(cpu(), a, uplo) end).message =~ ~s(uplo must be "L" or "U")

        assert eval_error(fn -> N.eigvalsh(cpu(), a, uplo) end).message =~
                 ~s(uplo must be "L" or "U")
      end

      assert_close(l(N.eigvalsh(cpu(), a, "U")), [1.0, 3.0])
    end

    test "flip with a repeated axis is refused" do
      x = t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {2, 2})

      for axes <- [[0, 0], [1, -1]] do
        assert eval_error(fn -> N.flip(s(), x, axes) end).message =~ "is repeated"
      end

      assert l(N.flip(s(), x, [0, 1])) == [4.0, 3.0, 2.0, 1.0]
    end

    test "attention's \"array\" mask mode needs a mask" do
      q = N.full(s(), {1, 1, 2, 4}, 1.0, {:f, 32})

      e =
        eval_error(fn -> N.scaled_dot_product_attention(s(), q, q, q, 1.0, "array", nil, nil) end)

      assert e.message =~ ~s(mask_mode "array" needs a mask)
    end
  end
end
