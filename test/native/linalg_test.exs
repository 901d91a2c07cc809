defmodule Emily.Native.LinalgTest do
  use Emily.TestCase, async: true

  test "matmul f32" do
    a = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], {:f, 32}, {2, 3})
    b = t([7.0, 8.0, 9.0, 10.0, 11.0, 12.0], {:f, 32}, {3, 2})
    c = N.matmul(s(), a, b)
    assert Emily.shape(c) == {2, 2}
    assert l(c) == [58.0, 64.0, 139.0, 154.0]
  end

  test "batched matmul broadcasts batch dims" do
    a = t(Enum.map(1..8, &(&1 * 1.0)), {:f, 32}, {2, 2, 2})
    i = t([1.0, 0.0, 0.0, 1.0], {:f, 32}, {2, 2})
    assert l(N.matmul(s(), a, i)) == Enum.map(1..8, &(&1 * 1.0))
  end

  test "f16, bf16 matmul" do
    for dt <- [{:f, 16}, {:bf, 16}] do
      a = t([1.0, 2.0, 3.0, 4.0], dt, {2, 2})
      c = N.matmul(s(), a, a)
      assert Emily.dtype(c) == dt
      assert l(c) == [7.0, 10.0, 15.0, 22.0]
    end
  end

  test "f64 matmul on the CPU" do
    a = Emily.from_list([1.0, 2.0, 3.0, 4.0], {:f, 64}, shape: {2, 2}, device: :cpu)
    c = N.matmul(cpu(), a, a)
    assert Emily.dtype(c) == {:f, 64}
    assert l(c) == [7.0, 10.0, 15.0, 22.0]
  end

  @tag :gpu
  test "f64 on the GPU is a clear error, and the GPU stream goes on" do
    gpu = Emily.Stream.default(:gpu)
    a = Emily.from_list([1.0, 2.0], {:f, 64}, stream: gpu)

    assert_raise Emily.Error, ~r/float64 is not supported on the GPU/, fn ->
      l(N.multiply(gpu, a, a))
    end

    b = Emily.from_list([1.0, 2.0], {:f, 32}, stream: gpu)
    assert l(N.multiply(gpu, b, b)) == [1.0, 4.0]
  end

  test "a large matmul checked against Elixir arithmetic" do
    n = 128
    a = N.reshape(s(), N.arange(s(), 0, n * n, 1, {:f, 32}), {n, n})
    b = N.full(s(), {n, 1}, 1.0, {:f, 32})
    # Row i of a is i*n .. i*n + n - 1, so its sum is n*i*n + n(n-1)/2.
    expected = for i <- 0..(n - 1), do: n * i * n + div(n * (n - 1), 2) * 1.0
    assert_close(l(N.matmul(s(), a, b)), expected, 1.0e-6)
  end

  test "mismatched inner dims raise Emily.Error" do
    e =
      assert_raise Emily.Error, fn ->
        l(N.matmul(s(), t([1.0, 2.0], {:f, 32}, {1, 2}), t([1.0], {:f, 32}, {1, 1})))
      end

    assert e.message =~ "matmul:"
    assert e.message =~ "f32[1x2], f32[1x1]"
  end
end
