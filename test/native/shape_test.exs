defmodule Emily.Native.ShapeTest do
  use Emily.TestCase, async: true

  setup do
    {:ok, x: t([0, 1, 2, 3, 4, 5], {:s, 32}, {2, 3})}
  end

  test "reshape / flatten", %{x: x} do
    assert Emily.shape(N.reshape(s(), x, {3, 2})) == {3, 2}
    assert l(N.reshape(s(), x, {3, 2})) == [0, 1, 2, 3, 4, 5]
    assert Emily.shape(N.flatten(s(), x, 0, -1)) == {6}
  end

  test "transpose", %{x: x} do
    y = N.transpose(s(), x, [1, 0])
    assert Emily.shape(y) == {3, 2}
    assert l(y) == [0, 3, 1, 4, 2, 5]
  end

  test "broadcast_to" do
    y = N.broadcast_to(s(), t([1, 2], {:s, 32}), {3, 2})
    assert l(y) == [1, 2, 1, 2, 1, 2]
  end

  test "squeeze / expand_dims", %{x: x} do
    y = N.expand_dims(s(), x, [0, 3])
    assert Emily.shape(y) == {1, 2, 3, 1}
    assert Emily.shape(N.squeeze(s(), y, [0, 3])) == {2, 3}
  end

  test "concatenate", %{x: x} do
    assert l(N.concatenate(s(), [x, x], 1)) == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert Emily.shape(N.concatenate(s(), [x, x, x], 0)) == {6, 3}
  end

  test "slice with strides", %{x: x} do
    assert l(N.slice(s(), x, [0, 1], [2, 3], [1, 1])) == [1, 2, 4, 5]
    assert l(N.slice(s(), x, [0, 0], [2, 3], [1, 2])) == [0, 2, 3, 5]
    assert l(N.slice(s(), x, [1, 0], [2, 3], [1, 1])) == [3, 4, 5]
  end

  test "errors name the op and shapes", %{x: x} do
    e = assert_raise Emily.Error, fn -> l(N.reshape(s(), x, {4, 2})) end
    assert e.message =~ "reshape:"
    assert e.message =~ "s32[2x3]"
    assert_raise Emily.Error, ~r/transpose/, fn -> l(N.transpose(s(), x, [0, 0])) end
    assert_raise Emily.Error, ~r/concatenate/, fn -> l(N.concatenate(s(), [x, t([1])], 0)) end
    assert_raise ArgumentError, fn -> N.concatenate(s(), [x, :nope], 0) end
    assert_raise ArgumentError, fn -> N.reshape(s(), x, {-1, 6}) end
  end
end
