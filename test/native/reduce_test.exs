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

  test "a bad axis raises Emily.Error", %{x: x} do
    e = assert_raise Emily.Error, fn -> l(N.sum(s(), x, [5], false)) end
    assert e.message =~ "sum:"
    assert e.message =~ "f32[2x3]"
  end
end
