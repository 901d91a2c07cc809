defmodule Emily.Native.CreationTest do
  use Emily.TestCase, async: true

  test "full" do
    assert l(N.full(s(), {2, 2}, 7, {:s, 32})) == [7, 7, 7, 7]
    assert l(N.full(s(), {2}, -1.5, {:f, 16})) == [-1.5, -1.5]
    assert l(N.full(s(), {1}, :infinity, {:f, 32})) == [:infinity]
    assert l(N.full(s(), {1}, :nan, {:bf, 16})) == [:nan]
    assert l(N.full(s(), {3}, 1, :bool)) == [true, true, true]
    assert Emily.shape(N.full(s(), {}, 3, {:u, 8})) == {}
    assert l(N.full(s(), {2}, 2.0, {:c, 64})) == [{2.0, 0.0}, {2.0, 0.0}]
  end

  test "arange" do
    assert l(N.arange(s(), 0, 5, 1, {:s, 32})) == [0, 1, 2, 3, 4]
    assert l(N.arange(s(), 1, 2, 0.25, {:f, 32})) == [1.0, 1.25, 1.5, 1.75]
    assert l(N.arange(s(), 10, 0, -3, {:s, 64})) == [10, 7, 4, 1]
    assert l(N.arange(s(), 0, 0, 1, {:f, 32})) == []
  end

  test "eye" do
    assert l(N.eye(s(), 2, 3, 0, {:f, 32})) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert l(N.eye(s(), 3, 3, 1, {:s, 32})) == [0, 1, 0, 0, 0, 1, 0, 0, 0]
    assert l(N.eye(s(), 2, 2, -1, :bool)) == [false, false, true, false]
  end

  test "errors" do
    assert_raise ArgumentError, fn -> N.full(s(), {2}, "x", {:f, 32}) end
    assert_raise ArgumentError, fn -> N.full(s(), {2}, 1, {:f, 7}) end
    assert_raise ArgumentError, fn -> N.eye(s(), 2.0, 2, 0, {:f, 32}) end

    assert_raise Emily.Error, ~r/eye: .*(must be|greater|non-negative|negative)/i, fn ->
      l(N.eye(s(), -2, 2, 0, {:f, 32}))
    end
  end

  test "an output larger than the memory limit is refused, not allocated" do
    # MLX itself would crash the process on this allocation.
    huge = N.full(s(), {1_000_000, 1_000_000}, 0, {:f, 32})
    assert_raise Emily.Error, ~r/full: .*above the memory limit/, fn -> Emily.eval(huge) end
    tiled = N.tile(s(), t([1.0]), [1_000_000, 1_000_000])
    assert_raise Emily.Error, ~r/above the memory limit/, fn -> Emily.eval(tiled) end
    assert l(N.full(s(), {2}, 1, {:s, 32})) == [1, 1]
  end

  test "integer arguments that do not fit in 32 bits are refused" do
    assert_raise ArgumentError, ~r/shape dimensions/, fn ->
      N.reshape(s(), t([1.0]), {2 ** 33})
    end

    assert_raise ArgumentError, ~r/does not fit in 32 bits/, fn ->
      N.transpose(s(), t([1.0]), [2 ** 33])
    end
  end
end
