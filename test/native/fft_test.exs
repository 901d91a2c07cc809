defmodule Emily.Native.FFTTest do
  use Emily.TestCase, async: true

  defp c(list),
    do:
      Enum.map(list, fn
        {re, im} -> {re * 1.0, im * 1.0}
        x -> {x * 1.0, 0.0}
      end)

  defp assert_alive, do: assert(l(N.add(s(), t([1.0]), t([2.0]))) == [3.0])

  # Hand-computed transforms: for x = [1, 2, 3, 4], X[k] = sum_j x[j] e^(-2 pi i jk / 4):
  # X = [10, -2 + 2i, -2, -2 - 2i].
  describe "1-D" do
    test "fft, ifft" do
      x = t([1.0, 2.0, 3.0, 4.0])
      y = N.fft(s(), x, 4, 0)
      assert Emily.dtype(y) == {:c, 64}
      assert_close(l(y), c([10, {-2, 2}, -2, {-2, -2}]))
      assert_close(l(N.ifft(s(), y, 4, -1)), c([1, 2, 3, 4]))
    end

    test "n pads with zeros or crops" do
      # [1, 2, 0, 0]: X = [3, 1 - 2i, -1, 1 + 2i]
      assert_close(l(N.fft(s(), t([1.0, 2.0]), 4, 0)), c([3, {1, -2}, -1, {1, 2}]))
      # [1, 2] of [1, 2, 3, 4]: X = [3, -1]
      assert_close(l(N.fft(s(), t([1.0, 2.0, 3.0, 4.0]), 2, 0)), c([3, -1]))
    end

    test "empty inputs: zeros of the output shape (the CUDA kernels crash on them)" do
      empty = N.reshape(s(), t([]), {0, 3})
      y = N.fft(s(), empty, 5, -1)
      assert {Emily.shape(y), Emily.dtype(y)} == {{0, 5}, {:c, 64}}
      assert l(y) == []
      # Zero-padded to n: the transform of zeros.
      assert l(N.ifft(s(), t([]), 3, 0)) == c([0, 0, 0])
      assert l(N.rfft(s(), N.reshape(s(), t([]), {2, 0}), 4, 1)) == c([0, 0, 0, 0, 0, 0])
      assert l(N.irfft(s(), N.reshape(s(), t([]), {0, 2}), 4, 1)) == []
      assert Emily.shape(N.fft2(s(), empty, [2, 2], [0, 1])) == {2, 2}
      assert_raise Emily.Error, fn -> l(N.fft(s(), empty, 5, 4)) end
      assert_alive()
    end

    test "rfft keeps n / 2 + 1 bins; irfft inverts" do
      y = N.rfft(s(), t([1.0, 2.0, 3.0, 4.0]), 4, 0)
      assert Emily.shape(y) == {3}
      assert_close(l(y), c([10, {-2, 2}, -2]))
      z = N.irfft(s(), y, 4, 0)
      assert Emily.dtype(z) == {:f, 32}
      assert_close(l(z), [1.0, 2.0, 3.0, 4.0])
      # odd length: [1, 2, 3] -> [6, -1.5 + 0.866i]
      y3 = N.rfft(s(), t([1.0, 2.0, 3.0]), 3, 0)
      assert_close(l(y3), c([6, {-1.5, 0.8660254}]))
      assert_close(l(N.irfft(s(), y3, 3, 0)), [1.0, 2.0, 3.0])
    end

    test "along a chosen axis of a matrix" do
      # rows [1, 2] and [3, 4]; along axis 0: [4, 6] and [-2, -2]
      x = t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {2, 2})
      assert_close(l(N.fft(s(), x, 2, 0)), c([4, 6, -2, -2]))
      assert_close(l(N.fft(s(), x, 2, 1)), c([3, -1, 7, -1]))
    end

    test "rfft of a complex input transforms its real part (MLX casts)" do
      z = t([{1.0, 5.0}, {2.0, 6.0}, {3.0, 7.0}, {4.0, 8.0}], {:c, 64})
      assert_close(l(N.rfft(s(), z, 4, 0)), c([10, {-2, 2}, -2]))
    end

    test "integer and f64 inputs transform in complex64" do
      with_cpu(fn ->
        y = N.fft(s(), t([1, 2, 3, 4], {:s, 32}), 4, 0)
        assert Emily.dtype(y) == {:c, 64}
        assert_close(l(y), c([10, {-2, 2}, -2, {-2, -2}]))
        assert_close(l(N.fft(s(), t([1.0, 2.0], {:f, 64}), 2, 0)), c([3, -1]))
      end)
    end

    test "a complex input" do
      # x = [i, 0]: X = [i, i]
      x = t([{0.0, 1.0}, {0.0, 0.0}], {:c, 64})
      assert_close(l(N.fft(s(), x, 2, 0)), c([{0, 1}, {0, 1}]))
    end
  end

  describe "2-D and n-D" do
    test "fft2 and ifft2" do
      # [[1, 2], [3, 4]] -> [[10, -2], [-4, 0]]
      x = t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {2, 2})
      y = N.fft2(s(), x, {2, 2}, [0, 1])
      assert_close(l(y), c([10, -2, -4, 0]))
      assert_close(l(N.ifft2(s(), y, [2, 2], [-2, -1])), c([1, 2, 3, 4]))
    end

    test "fft2 with padding lengths" do
      # [[1, 2], [3, 4]] padded to 2x3 along the last axis: rows [1, 2, 0], [3, 4, 0]
      x = t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {2, 2})
      y = N.fft2(s(), x, {2, 3}, [0, 1])
      assert Emily.shape(y) == {2, 3}
      # column sums [4, 6, 0] then DFT-3: 10, 4 + 6w + 0, ... with w = e^(-2 pi i / 3)
      w = {-0.5, -0.8660254}
      w2 = {-0.5, 0.8660254}
      add = fn {a, b}, {x2, y2} -> {a + x2, b + y2} end
      scale = fn k, {a, b} -> {k * a, k * b} end
      row0 = [10, add.({4.0, 0.0}, scale.(6, w)), add.({4.0, 0.0}, scale.(6, w2))]
      # row differences [-2, -2, 0]
      row1 = [-4, add.({-2.0, 0.0}, scale.(-2, w)), add.({-2.0, 0.0}, scale.(-2, w2))]
      assert_close(l(y), c(row0 ++ row1))
    end

    test "rfft2 and irfft2" do
      x = t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {2, 2})
      y = N.rfft2(s(), x, {2, 2}, [0, 1])
      assert Emily.shape(y) == {2, 2}
      assert_close(l(y), c([10, -2, -4, 0]))
      assert_close(l(N.irfft2(s(), y, {2, 2}, [0, 1])), [1.0, 2.0, 3.0, 4.0])
    end

    test "fftn over three axes and rfftn / irfftn" do
      # the 2x2x2 DFT of a delta at the origin is all ones; of all ones, 8 at the origin
      delta = t([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], {:f, 32}, {2, 2, 2})
      assert_close(l(N.fftn(s(), delta, {2, 2, 2}, [0, 1, 2])), c(List.duplicate(1, 8)))
      ones = N.full(s(), {2, 2, 2}, 1.0, {:f, 32})
      assert_close(l(N.fftn(s(), ones, {2, 2, 2}, [0, 1, 2])), c([8, 0, 0, 0, 0, 0, 0, 0]))

      assert_close(
        l(N.ifftn(s(), N.fftn(s(), ones, {2, 2, 2}, [0, 1, 2]), {2, 2, 2}, [0, 1, 2])),
        c(List.duplicate(1, 8))
      )

      r = N.rfftn(s(), ones, {2, 2, 2}, [0, 1, 2])
      assert Emily.shape(r) == {2, 2, 2}
      assert_close(l(N.irfftn(s(), r, {2, 2, 2}, [0, 1, 2])), List.duplicate(1.0, 8))
    end

    test "fftshift and ifftshift" do
      x = t([0.0, 1.0, 2.0, 3.0, 4.0])
      assert l(N.fftshift(s(), x, [0])) == [3.0, 4.0, 0.0, 1.0, 2.0]
      assert l(N.ifftshift(s(), x, [0])) == [2.0, 3.0, 4.0, 0.0, 1.0]
    end
  end

  test "bad lengths and axes raise Emily.Error; the stream survives" do
    x = t([1.0, 2.0, 3.0, 4.0])
    z = N.fft(s(), x, 4, 0)

    cases = [
      {"fft", fn -> N.fft(s(), x, 0, 0) end},
      {"fft", fn -> N.fft(s(), x, 4, 1) end},
      {"ifft", fn -> N.ifft(s(), x, 4, 3) end},
      {"rfft", fn -> N.rfft(s(), x, 4, -2) end},
      {"irfft", fn -> N.irfft(s(), z, -2, 0) end},
      {"fft2", fn -> N.fft2(s(), x, {4, 4}, [0, 1]) end},
      {"ifft2", fn -> N.ifft2(s(), x, {4}, [0, 1]) end},
      {"rfft2", fn -> N.rfft2(s(), z, {2, 2}, [0, 1]) end},
      {"irfft2", fn -> N.irfft2(s(), z, {2, 2}, [0, 1]) end},
      {"fftn", fn -> N.fftn(s(), x, {4}, [0, 0]) end},
      {"ifftn", fn -> N.ifftn(s(), x, {4}, [5]) end},
      {"rfftn", fn -> N.rfftn(s(), x, {4, 4}, [0]) end},
      {"irfftn", fn -> N.irfftn(s(), z, {4}, [1]) end},
      {"fftshift", fn -> N.fftshift(s(), x, [2]) end},
      {"ifftshift", fn -> N.ifftshift(s(), x, [-3]) end}
    ]

    for {name, fun} <- cases do
      e = assert_raise Emily.Error, fn -> l(fun.()) end
      assert e.message =~ name <> ":", e.message
      assert_alive()
    end

    assert_raise ArgumentError, fn -> N.fft2(s(), x, {-1, 2}, [0, 1]) end
    assert_raise ArgumentError, fn -> N.fft(s(), x, 4.0, 0) end
  end
end
