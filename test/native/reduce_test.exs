defmodule Emily.Native.ReduceTest do
  use Emily.TestCase, async: true

  setup do
    # [[1, 2, 3], [4, 5, 6]]
    {:ok, x: t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], {:f, 32}, {2, 3})}
  end

  test "sum / prod / mean over axes, with and without keepdims", %{x: x} do
    assert l(N.sum(s(), x, [0, 1], false)) == [21.0]
    assert l(N.sum(s(), x, [0], false)) == [5.0, 7.0, 9.0]
    assert Emily.shape(N.sum(s(), x, [1], true)) == {2, 1}
    assert l(N.sum(s(), x, [1], true)) == [6.0, 15.0]
    assert l(N.prod(s(), x, [1], false)) == [6.0, 120.0]
    assert l(N.mean(s(), x, [0], false)) == [2.5, 3.5, 4.5]
    assert l(N.sum(s(), x, [], false)) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
  end

  test "max / min / all / any", %{x: x} do
    assert l(N.max(s(), x, [1], false)) == [3.0, 6.0]
    assert l(N.min(s(), x, [0], false)) == [1.0, 2.0, 3.0]
    b = t([true, false, true, true], :bool, {2, 2})
    assert l(N.all(s(), b, [1], false)) == [false, true]
    assert l(N.any(s(), b, [0], false)) == [true, true]
  end

  test "var / std with ddof", %{x: x} do
    assert_close(l(N.var(s(), x, [1], false, 0)), [0.666666667, 0.666666667])
    assert_close(l(N.var(s(), x, [1], false, 1)), [1.0, 1.0])
    assert_close(l(N.std(s(), x, [0], false, 0)), [1.5, 1.5, 1.5])
  end

  test "argmax / argmin return the first index on ties" do
    y = t([3, 1, 3, 1, 2, 1], {:s, 32}, {2, 3})
    # [[3, 1, 3], [1, 2, 1]]
    assert l(N.argmax(s(), y, 1, false)) == [0, 1]
    assert l(N.argmin(s(), y, 1, false)) == [1, 0]
    assert Emily.dtype(N.argmax(s(), y, 0, false)) == {:u, 32}
  end

  test "logsumexp and softmax", %{x: x} do
    assert_close(l(N.logsumexp(s(), x, [1], false)), [3.407605964, 6.407605964])
    assert_close(l(N.softmax(s(), t([0.0, 0.0, :neg_infinity]), [0], false)), [0.5, 0.5, 0.0])
  end

  test "integer sums keep integers" do
    assert l(N.sum(s(), t([1, 2, 3], {:s, 32}), [0], false)) == [6]
  end

  test "argmax_last / argmin_last return the last index on ties" do
    y = t([3, 1, 3, 1, 2, 1], {:s, 32}, {2, 3})
    # [[3, 1, 3], [1, 2, 1]]
    assert l(N.argmax_last(s(), y, 1, false)) == [2, 1]
    assert l(N.argmin_last(s(), y, 1, false)) == [1, 2]
    assert l(N.argmax_last(s(), y, -1, false)) == [2, 1]
    assert l(N.argmax_last(s(), y, 0, false)) == [0, 1, 0]
    assert l(N.argmin_last(s(), y, 0, false)) == [1, 0, 1]
    assert Emily.shape(N.argmax_last(s(), y, 1, true)) == {2, 1}
    assert Emily.dtype(N.argmin_last(s(), y, 0, false)) == {:u, 32}
    # Without ties both agree.
    assert l(N.argmax_last(s(), t([1.0, 5.0, 2.0]), 0, false)) == [1]
  end

  test "argmax / argmin count NaN as the extreme, first or last NaN" do
    x = t([1.0, :nan, 3.0, :nan, 0.0])
    assert l(N.argmax(s(), x, 0, false)) == [1]
    assert l(N.argmax_last(s(), x, 0, false)) == [3]
    assert l(N.argmin(s(), x, 0, false)) == [1]
    assert l(N.argmin_last(s(), x, 0, false)) == [3]
  end

  test "reductions over several and negative axes with keepdims" do
    # shape {2, 2, 2}: [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]
    z = t(Enum.map(1..8, &(&1 * 1.0)), {:f, 32}, {2, 2, 2})
    assert l(N.sum(s(), z, [0, 2], false)) == [14.0, 22.0]
    assert Emily.shape(N.sum(s(), z, [0, 2], true)) == {1, 2, 1}
    assert l(N.sum(s(), z, [-1], false)) == [3.0, 7.0, 11.0, 15.0]
    assert l(N.prod(s(), z, [1, 2], false)) == [24.0, 1680.0]
    assert l(N.max(s(), z, [0, 1], true)) == [7.0, 8.0]
    assert Emily.shape(N.max(s(), z, [0, 1], true)) == {1, 1, 2}
    assert l(N.min(s(), z, [-2, -1], false)) == [1.0, 5.0]
    assert l(N.mean(s(), z, [0, 1, 2], false)) == [4.5]
    assert_close(l(N.var(s(), z, [0, 1, 2], false, 0)), [5.25])
    assert_close(l(N.std(s(), z, [0, 1, 2], true, 1)), [2.449489742783178])
    assert_close(l(N.logsumexp(s(), z, [1, 2], false)), [4.440189698561196, 8.440189698561195])
  end

  test "result types and special values" do
    assert l(N.sum(s(), t([true, true, false], :bool), [0], false)) == [2]
    assert Emily.dtype(N.sum(s(), t([true], :bool), [0], false)) == {:s, 32}
    assert l(N.sum(s(), t([200, 100], {:u, 8}), [0], false)) == [300]
    assert Emily.dtype(N.sum(s(), t([1], {:u, 8}), [0], false)) == {:u, 32}
    assert Emily.dtype(N.sum(s(), t([1], {:s, 64}), [0], false)) == {:s, 64}
    assert Emily.dtype(N.mean(s(), t([1, 2], {:s, 32}), [0], false)) == {:f, 32}
    assert l(N.mean(s(), t([1, 2], {:s, 32}), [0], false)) == [1.5]
    assert l(N.prod(s(), t([-2, 3, 4], {:s, 64}), [0], false)) == [-24]
    assert l(N.max(s(), t([1.0, :nan, 3.0]), [0], false)) == [:nan]
    assert l(N.min(s(), t([1.0, :nan, 3.0]), [0], false)) == [:nan]
    assert l(N.max(s(), t([-3, -1], {:s, 8}), [0], false)) == [-1]
    assert l(N.all(s(), t([1.0, 0.0, 2.0]), [0], false)) == [false]
    assert l(N.any(s(), t([0, 0, 3], {:s, 32}), [0], false)) == [true]
    assert l(N.logsumexp(s(), t([:neg_infinity, :neg_infinity]), [0], false)) == [:neg_infinity]
    assert_close(l(N.logsumexp(s(), t([1000.0, 1000.0]), [0], false)), [1000.6931471805599])
    assert_close(l(N.sum(s(), t([0.5, 0.25], {:bf, 16}), [0], false)), [0.75])
  end

  test "softmax over several axes and precise" do
    # [[0, 0], [0, ln 3]]: over both axes the weights are 1, 1, 1, 3 out of 6.
    x = t([0.0, 0.0, 0.0, 1.0986122886681098], {:f, 32}, {2, 2})
    assert_close(l(N.softmax(s(), x, [0, 1], false)), [1 / 6, 1 / 6, 1 / 6, 0.5])
    assert_close(l(N.softmax(s(), x, [1], true)), [0.5, 0.5, 0.25, 0.75])
    assert_close(l(N.softmax(s(), t([1000.0, 1000.0], {:f, 16}), [0], true)), [0.5, 0.5], 1.0e-3)
  end

  test "every reduce op raises ArgumentError on a non-tensor argument" do
    for row <- family_rows(["reduce"]) do
      assert_raise ArgumentError, fn -> apply(N, row.name, [s() | bad_args(row)]) end
    end

    assert l(N.sum(s(), t([1.0, 2.0]), [0], false)) == [3.0]
  end

  test "every reduce op raises Emily.Error on an axis out of range", %{x: x} do
    for row <- family_rows(["reduce"]) do
      args =
        Enum.map(row.args, fn
          {_, "tensor"} -> x
          {_, "ints"} -> [2]
          {:axis, "int"} -> 2
          {:ddof, "int"} -> 0
          {_, "bool"} -> false
        end)

      e = assert_raise Emily.Error, fn -> l(apply(N, row.name, [s() | args])) end
      assert e.message =~ "#{row.name}:", "#{row.name}: #{e.message}"
      assert e.message =~ "f32[2x3]", "#{row.name}: #{e.message}"
    end

    assert l(N.sum(s(), t([1.0, 2.0]), [0], false)) == [3.0]
  end

  test "a bad axis raises Emily.Error", %{x: x} do
    e = assert_raise Emily.Error, fn -> l(N.sum(s(), x, [5], false)) end
    assert e.message =~ "sum:"
    assert e.message =~ "f32[2x3]"
  end
end
