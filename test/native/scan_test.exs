defmodule Emily.Native.ScanTest do
  use Emily.TestCase, async: true

  setup do
    # [[1, 2, 3], [4, 5, 6]]
    {:ok, x: t([1, 2, 3, 4, 5, 6], {:s, 32}, {2, 3})}
  end

  test "cumsum forward, reverse, inclusive and exclusive, along any axis", %{x: x} do
    assert l(N.cumsum(s(), x, 1, false, true)) == [1, 3, 6, 4, 9, 15]
    assert l(N.cumsum(s(), x, -1, false, true)) == [1, 3, 6, 4, 9, 15]
    assert l(N.cumsum(s(), x, 1, false, false)) == [0, 1, 3, 0, 4, 9]
    assert l(N.cumsum(s(), x, 1, true, true)) == [6, 5, 3, 15, 11, 6]
    assert l(N.cumsum(s(), x, 1, true, false)) == [5, 3, 0, 11, 6, 0]
    assert l(N.cumsum(s(), x, 0, false, true)) == [1, 2, 3, 5, 7, 9]
    assert l(N.cumsum(s(), x, 0, true, true)) == [5, 7, 9, 4, 5, 6]
    assert l(N.cumsum(s(), x, -2, true, false)) == [4, 5, 6, 0, 0, 0]
    assert Emily.shape(N.cumsum(s(), x, 0, false, true)) == {2, 3}
  end

  test "cumprod", %{x: x} do
    assert l(N.cumprod(s(), x, 1, false, true)) == [1, 2, 6, 4, 20, 120]
    assert l(N.cumprod(s(), x, 1, false, false)) == [1, 1, 2, 1, 4, 20]
    assert l(N.cumprod(s(), x, 1, true, true)) == [6, 6, 3, 120, 30, 6]
    assert l(N.cumprod(s(), x, 0, false, true)) == [1, 2, 3, 4, 10, 18]
    assert_close(l(N.cumprod(s(), t([0.5, 0.5, 4.0]), 0, true, false)), [2.0, 4.0, 1.0])
  end

  test "cummax and cummin, with the type's extreme as the exclusive identity" do
    a = t([3, 1, 4, 1, 5], {:s, 32})
    assert l(N.cummax(s(), a, 0, false, true)) == [3, 3, 4, 4, 5]
    assert l(N.cummax(s(), a, 0, true, true)) == [5, 5, 5, 5, 5]
    assert l(N.cummin(s(), a, 0, false, true)) == [3, 1, 1, 1, 1]
    assert l(N.cummin(s(), a, 0, true, true)) == [1, 1, 1, 1, 5]
    assert l(N.cummax(s(), a, 0, false, false)) == [-2_147_483_648, 3, 3, 4, 4]
    assert l(N.cummin(s(), a, 0, false, false)) == [2_147_483_647, 3, 1, 1, 1]
    assert l(N.cummax(s(), t([3.0, 1.0]), 0, false, false)) == [:neg_infinity, 3.0]
    assert l(N.cummin(s(), t([3.0, 1.0]), 0, true, false)) == [1.0, :infinity]
    assert l(N.cummax(s(), t([2, 7], {:u, 8}), 0, false, false)) == [0, 2]
  end

  test "NaN propagates from where it appears" do
    x = t([1.0, :nan, 3.0])
    assert l(N.cummax(s(), x, 0, false, true)) == [1.0, :nan, :nan]
    assert l(N.cummin(s(), x, 0, false, true)) == [1.0, :nan, :nan]
    assert l(N.cumsum(s(), x, 0, true, true)) == [:nan, :nan, 3.0]

    # MLX's own half-precision cummax/cummin give [1, 0, 2, inf, ...] here.
    for type <- [{:f, 16}, {:bf, 16}] do
      h = t([1.0, :nan, 2.0, :infinity, :neg_infinity], type)
      assert l(N.cummax(s(), h, 0, false, true)) == [1.0, :nan, :nan, :nan, :nan]

      assert l(N.cummin(s(), h, 0, true, true)) == [
               :nan,
               :nan,
               :neg_infinity,
               :neg_infinity,
               :neg_infinity
             ]

      assert l(N.cummax(s(), h, 0, false, false)) == [:neg_infinity, 1.0, :nan, :nan, :nan]
      assert Emily.dtype(N.cummin(s(), h, 0, false, true)) == type
    end
  end

  test "logcumsumexp" do
    ln2 = 0.6931471805599453
    ln3 = 1.0986122886681098
    x = t([0.0, 0.0, 0.0])
    assert_close(l(N.logcumsumexp(s(), x, 0, false, true)), [0.0, ln2, ln3])
    assert_close(l(N.logcumsumexp(s(), x, 0, true, true)), [ln3, ln2, 0.0])
    assert_close(l(N.logcumsumexp(s(), x, 0, false, false)), [:neg_infinity, 0.0, ln2])

    assert_close(l(N.logcumsumexp(s(), t([1000.0, 1000.0]), 0, false, true)), [
      1000.0,
      1000.0 + ln2
    ])

    assert_close(l(N.logcumsumexp(s(), t([0.0, :neg_infinity]), 0, false, true)), [0.0, 0.0])
  end

  test "result types" do
    assert l(N.cumsum(s(), t([true, true, false], :bool), 0, false, true)) == [1, 2, 2]
    assert Emily.dtype(N.cumsum(s(), t([true], :bool), 0, false, true)) == {:s, 32}
    # 8-bit integers are not widened: 200 + 100 wraps in u8.
    assert l(N.cumsum(s(), t([200, 100], {:u, 8}), 0, false, true)) == [200, 44]
    assert Emily.dtype(N.cumprod(s(), t([1.0], {:bf, 16}), 0, false, true)) == {:bf, 16}
    assert_close(l(N.cumsum(s(), t([0.5, 0.25], {:f, 16}), 0, false, true)), [0.5, 0.75])
  end

  test "every scan op raises ArgumentError on a non-tensor argument" do
    for row <- family_rows(["scan"]) do
      assert_raise ArgumentError, fn -> apply(N, row.name, [s() | bad_args(row)]) end
    end

    assert l(N.cumsum(s(), t([1.0, 2.0]), 0, false, true)) == [1.0, 3.0]
  end

  test "every scan op raises Emily.Error on an axis out of range", %{x: x} do
    for row <- family_rows(["scan"]), axis <- [2, -3] do
      e = assert_raise Emily.Error, fn -> l(apply(N, row.name, [s(), x, axis, false, true])) end
      assert e.message =~ "#{row.name}:", "#{row.name}: #{e.message}"
      assert e.message =~ "s32[2x3]", "#{row.name}: #{e.message}"
    end

    e =
      assert_raise Emily.Error, fn -> l(N.cumsum(s(), t([1.0], {:f, 32}, {}), 0, false, true)) end

    assert e.message =~ "cumsum:"
    assert l(N.cumsum(s(), t([1.0, 2.0]), 0, false, true)) == [1.0, 3.0]
  end
end
