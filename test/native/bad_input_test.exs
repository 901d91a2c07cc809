defmodule Emily.Native.BadInputTest do
  # Inputs MLX accepts and computes wrongly, or only for some types, and what the table's
  # rows make of them. Oracles: arithmetic by hand, :math, and Nx's documented rules.
  use Emily.TestCase, async: true

  import Bitwise

  describe "bools are 0 or 1, whatever bytes made them" do
    test "from_binary" do
      b = N.from_binary(s(), <<2, 255, 0, 1>>, {4}, :bool)
      assert l(b) == [true, true, false, true]
      assert l(N.logical_not(s(), b)) == [false, false, true, false]
      assert l(N.astype(s(), b, {:s, 32})) == [1, 1, 0, 1]
      assert l(N.sum(s(), b, [0], false)) == [3]
      assert Emily.to_binary(b) == <<1, 1, 0, 1>>
    end

    test "view as bool" do
      b = N.view(s(), t([2, 255, 0, 1], {:u, 8}), :bool)
      assert l(N.astype(s(), b, {:u, 8})) == [1, 1, 0, 1]
      assert l(N.logical_not(s(), b)) == [false, false, true, false]
      # Wider bytes: each byte is one bool (a u16 of 258 is the bytes 2, 1).
      assert l(N.astype(s(), N.view(s(), t([258, 0], {:u, 16}), :bool), {:u, 8})) == [1, 1, 0, 0]
      assert l(N.view(s(), t([true, false], :bool), :bool)) == [true, false]
    end
  end

  describe "integer mean" do
    test "accumulates without wrapping" do
      max32 = 2_147_483_647
      # The f32 nearest to 2147483647 is 2^31.
      assert l(N.mean(s(), t([max32, max32], {:s, 32}), [0], false)) == [2.0 ** 31]

      big = 1 <<< 62
      [m] = l(N.mean(s(), t([big, big, -3], {:s, 64}), [0], false))
      assert_close([m], [(2 * big - 3) / 3])

      max64 = (1 <<< 64) - 1
      assert_close(l(N.mean(s(), t([max64, max64], {:u, 64}), [0], false)), [max64 * 1.0])
      assert l(N.mean(s(), t([-7, -8, 3, 4], {:s, 8}, {2, 2}), [1], true)) == [-7.5, 3.5]
      assert Emily.dtype(N.mean(s(), t([1], {:s, 64}), [0], false)) == {:f, 32}
    end
  end

  test "f64 round with decimals rounds at f64 precision" do
    x = t([0.8123, 2.675, -2.5, 1.0e300, 1234.5678], {:f, 64})
    # NumPy's rule, x * 10^d rounded half to even and divided back: 2.675 * 100 is 267.5
    # in f64, so 2.68 (NumPy agrees).
    assert with_cpu(fn -> l(N.round(cpu(), x, 1)) end) == [0.8, 2.7, -2.5, 1.0e300, 1234.6]
    assert with_cpu(fn -> l(N.round(cpu(), x, 2)) end) == [0.81, 2.68, -2.5, 1.0e300, 1234.57]
    # Negative decimals round to tens, half to even.
    y = t([25.0, 35.0, -1234.5], {:f, 64})
    assert with_cpu(fn -> l(N.round(cpu(), y, -1)) end) == [20.0, 40.0, -1230.0]
    assert with_cpu(fn -> l(N.round(cpu(), y, 0)) end) == [25.0, 35.0, -1234.0]
  end

  describe "variance and standard deviation" do
    test "overflow only where the result does not fit" do
      assert l(N.std(s(), t([40000.0, -40000.0], {:f, 16}), [0], false, 0)) == [40000.0]
      assert l(N.var(s(), t([40000.0, -40000.0], {:f, 16}), [0], false, 0)) == [:infinity]

      assert l(N.std(s(), t([3.0e38, -3.0e38], {:bf, 16}), [0], false, 0)) ==
               l(t([3.0e38], {:bf, 16}))

      [sd] = l(N.std(s(), t([3.0e19, -3.0e19], {:f, 32}), [0], false, 0))
      assert_close([sd], [3.0e19])
      # 9e38 does not fit f32.
      assert l(N.var(s(), t([3.0e19, -3.0e19], {:f, 32}), [0], false, 0)) == [:infinity]
    end

    test "values, ddof, axes and types" do
      x = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], {:f, 32}, {2, 3})
      assert_close(l(N.var(s(), x, [1], true, 1)), [1.0, 1.0])
      assert Emily.shape(N.var(s(), x, [1], true, 1)) == {2, 1}
      assert_close(l(N.var(s(), x, [0, 1], false, 0)), [35 / 12])
      assert_close(l(N.std(s(), x, [-2], false, 0)), [1.5, 1.5, 1.5])
      # Integers: in float, without wrapping (x^2 of 2^20 overflows s32).
      assert_close(l(N.std(s(), t([1, 2, 3, 4], {:s, 32}), [0], false, 0)), [:math.sqrt(1.25)])

      assert_close(l(N.var(s(), t([1 <<< 20, -(1 <<< 20)], {:s, 32}), [0], false, 0)), [2.0 ** 40])

      assert Emily.dtype(N.var(s(), t([1, 2], {:s, 32}), [0], false, 0)) == {:f, 32}
      assert Emily.dtype(N.std(s(), t([1.0, 2.0], {:f, 16}), [0], false, 0)) == {:f, 16}
      # Cancellation: a large mean and a small spread.
      assert_close(l(N.var(s(), t([1.0e4 + 1, 1.0e4 - 1], {:f, 32}), [0], false, 0)), [1.0])
      assert l(N.var(s(), t([5.0, 5.0]), [0], false, 0)) == [0.0]
    end

    @tag :non_finite
    test "non-finite inputs" do
      assert l(N.var(s(), t([:nan, 1.0]), [0], false, 0)) == [:nan]
      assert l(N.std(s(), t([:infinity, 1.0]), [0], false, 0)) == [:nan]
    end
  end

  @tag :non_finite
  test "argmax_nan_last and argmin_nan_last: the first of equal values, the last NaN" do
    nan = N.divide(s(), t([0.0]), t([0.0]))
    x = N.reshape(s(), N.concatenate(s(), [t([1.0]), nan, nan, t([1.0])], 0), {2, 2})
    # Rows [1, NaN] and [NaN, 1]; columns [1, NaN] and [NaN, 1].
    for op <- [:argmax_nan_last, :argmin_nan_last] do
      assert l(apply(N, op, [s(), x, 1, false])) == [1, 0], "#{op}"
      assert l(apply(N, op, [s(), x, 0, true])) == [1, 0], "#{op}"
    end

    y = N.reshape(s(), N.concatenate(s(), [nan, nan, t([1.0])], 0), {1, 3})
    assert l(N.argmax_nan_last(s(), y, 1, false)) == [1]
    assert l(N.argmin_nan_last(s(), y, 1, false)) == [1]
    # NumPy's first NaN (argmax/argmin) and the last (the _last forms) are unchanged.
    assert l(N.argmax(s(), y, 1, false)) == [0]
    assert l(N.argmax_last(s(), y, 1, false)) == [1]

    # Without NaN: the first of equal values, for floats and integers.
    z = t([1.0, 3.0, 3.0, 1.0])
    assert l(N.argmax_nan_last(s(), z, 0, false)) == [1]
    assert l(N.argmin_nan_last(s(), z, 0, false)) == [0]
    assert l(N.argmax_nan_last(s(), t([1, 3, 3], {:s, 32}), 0, true)) == [1]
    assert Emily.dtype(N.argmax_nan_last(s(), z, 0, false)) == {:u, 32}
  end

  @tag :non_finite
  test "cholesky of a matrix that is not positive definite is NaN in the factor" do
    not_pd = t([-1.0, 0.0, 0.0, -1.0], {:f, 32}, {2, 2})
    assert l(N.cholesky(cpu(), not_pd, false)) == [:nan, 0.0, :nan, :nan]
    assert l(N.cholesky(cpu(), not_pd, true)) == [:nan, :nan, 0.0, :nan]
    # Each matrix of a batch on its own: [[1, 2], [2, 1]] fails at its second pivot.
    batch = t([1.0, 2.0, 2.0, 1.0, 4.0, 2.0, 2.0, 5.0], {:f, 32}, {2, 2, 2})
    assert l(N.cholesky(cpu(), batch, false)) == [:nan, 0.0, :nan, :nan, 2.0, 0.0, 1.0, 2.0]
    # Positive semi-definite with a zero last pivot completes (as in Nx).
    assert l(N.cholesky(cpu(), t([1.0, 1.0, 1.0, 1.0], {:f, 32}, {2, 2}), false)) == [
             1.0,
             0.0,
             1.0,
             0.0
           ]

    # A failed factor stays NaN through cholesky_inv (which takes the factor).
    inv = N.cholesky_inv(cpu(), N.cholesky(cpu(), not_pd, false), false)
    assert Enum.any?(l(inv), &(&1 == :nan))
  end

  describe "complex64 where MLX has no kernel" do
    defp c(list), do: t(list, {:c, 64})

    test "expm1, sigmoid and cbrt" do
      {x, y} = {1.0e-3, 2.0}
      e = :math.exp(x)
      assert_close(l(N.expm1(s(), c([{x, y}]))), [{e * :math.cos(y) - 1, e * :math.sin(y)}])
      # Near zero expm1 keeps its digits: (1e-7 + 1e-7i) -> about itself.
      [{re, im}] = l(N.expm1(s(), c([{1.0e-7, 1.0e-7}])))
      assert_close([re, im], [1.0e-7, 1.0e-7], 1.0e-4)

      # 1 / (1 + exp(-z)), z = 1 + 2i
      {er, ei} = {:math.exp(-1) * :math.cos(-2), :math.exp(-1) * :math.sin(-2)}
      d = (1 + er) * (1 + er) + ei * ei
      assert_close(l(N.sigmoid(s(), c([{1.0, 2.0}]))), [{(1 + er) / d, -ei / d}])

      # The principal root: |z|^(1/3) at a third of the phase (Nx's Complex.cbrt).
      r = 2.0

      assert_close(l(N.cbrt(s(), c([{-8.0, 0.0}, {0.0, 8.0}]))), [
        {r * :math.cos(:math.pi() / 3), r * :math.sin(:math.pi() / 3)},
        {r * :math.cos(:math.pi() / 6), r * :math.sin(:math.pi() / 6)}
      ])

      for op <- [:expm1, :sigmoid, :cbrt],
          do: assert(Emily.dtype(apply(N, op, [s(), c([{1.0, 0.0}])])) == {:c, 64})

      # Real inputs are unchanged.
      assert_close(l(N.cbrt(s(), t([-8.0, 27.0]))), [-2.0, 3.0])
    end

    # An infinite magnitude at a zero angle part is an infinite part and an exact zero,
    # as C99's cexp and Nx's Complex.cbrt give, not inf * 0 = NaN.
    @tag :non_finite
    test "expm1 and cbrt at infinite magnitudes" do
      assert [{:neg_infinity, :infinity}, {:infinity, +0.0}] =
               l(N.expm1(s(), c([{:infinity, 3.0}, {:infinity, 0.0}])))

      assert [{:infinity, +0.0}] = l(N.cbrt(s(), c([{:infinity, 3.0}])))
    end

    @tag :non_finite
    test "arctan2" do
      a = c([{1.0, 0.0}, {1.0, 1.0}])
      b = c([{-1.0, 0.0}, {1.0, 0.0}])
      assert [{angle, +0.0}, {:nan, +0.0}] = l(N.arctan2(s(), a, b))
      assert_close([angle], [:math.atan2(1.0, -1.0)])
      # Mixed with a real tensor.
      assert_close(l(N.arctan2(s(), c([{0.0, 0.0}]), t([-1.0]))), [{:math.pi(), 0.0}])
    end
  end

  test "cumprod, cummax and cummin of bool give bool (MLX's types)" do
    b = t([true, false, true], :bool)
    assert l(N.cumprod(s(), b, 0, false, true)) == [true, false, false]
    assert l(N.cummax(s(), b, 0, false, true)) == [true, true, true]
    assert l(N.cummin(s(), b, 0, false, true)) == [true, false, false]

    for op <- [:cumprod, :cummax, :cummin],
        do: assert(Emily.dtype(apply(N, op, [s(), b, 0, false, true])) == :bool)

    assert Emily.dtype(N.cumsum(s(), b, 0, false, true)) == {:s, 32}
  end
end
