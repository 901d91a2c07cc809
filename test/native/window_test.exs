defmodule Emily.Native.WindowTest do
  use Emily.TestCase, async: true

  setup do
    # [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    {:ok, x: t(Enum.map(1..9, &(&1 * 1.0)), {:f, 32}, {3, 3})}
  end

  defp alive!, do: assert(l(N.add(s(), t([1.0]), t([2.0]))) == [3.0])

  describe "window reductions" do
    test "2x2 windows, stride 1", %{x: x} do
      y = N.window_sum(s(), x, [2, 2], [], [], [], [])
      assert Emily.shape(y) == {2, 2}
      assert l(y) == [12.0, 16.0, 24.0, 28.0]

      assert l(N.window_product(s(), x, [2, 2], [1, 1], [0, 0], [0, 0], [1, 1])) ==
               [40.0, 180.0, 1120.0, 2160.0]

      assert l(N.window_max(s(), x, [2, 2], [], [], [], [])) == [5.0, 6.0, 8.0, 9.0]
      assert l(N.window_min(s(), x, [2, 2], [], [], [], [])) == [1.0, 2.0, 4.0, 5.0]
    end

    test "padding and strides; padding is the reduction's identity", %{x: x} do
      # Padded with a row and a column in front, 2x2 windows at stride 2.
      assert l(N.window_sum(s(), x, [2, 2], [2, 2], [1, 1], [0, 0], [])) ==
               [1.0, 5.0, 11.0, 28.0]

      # Max pads with -inf: all-negative windows are not lifted to 0.
      neg = N.negative(s(), x)

      assert l(N.window_max(s(), neg, [2, 2], [2, 2], [1, 1], [0, 0], [])) ==
               [-1.0, -2.0, -4.0, -5.0]

      assert l(N.window_min(s(), x, [2, 2], [2, 2], [1, 1], [0, 0], [])) == [1.0, 2.0, 4.0, 5.0]

      # A window that holds only padding gives the identity.
      assert l(N.window_max(s(), t([5.0]), [1], [], [1], [0], [])) == [:neg_infinity, 5.0]
      assert l(N.window_min(s(), t([5.0]), [1], [], [0], [1], [])) == [5.0, :infinity]

      # Product pads with 1.
      v = t([1, 2, 3, 4], {:s, 32})
      assert l(N.window_product(s(), v, [3], [], [1], [1], [])) == [2, 6, 24, 12]
    end

    test "negative padding crops" do
      v = t([1, 2, 3, 4], {:s, 32})
      assert l(N.window_sum(s(), v, [2], [], [-1], [0], [])) == [5, 7]
    end

    test "window dilations" do
      v = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
      # Dilation 2: each window reads v[i] and v[i + 2].
      assert l(N.window_sum(s(), v, [2], [], [], [], [2])) == [4.0, 6.0, 8.0, 10.0]
      assert l(N.window_sum(s(), v, [2], [2], [], [], [2])) == [4.0, 8.0]
      assert l(N.window_max(s(), v, [3], [], [], [], [2])) == [5.0, 6.0]
    end

    test "long windows (over 32 elements on an axis)" do
      v = t(Enum.to_list(1..40), {:s, 32})
      # sum(1..33) = 561; each step right adds 33.
      assert l(N.window_sum(s(), v, [33], [], [], [], [])) == Enum.map(0..7, &(561 + 33 * &1))
      assert l(N.window_sum(s(), v, [33], [3], [], [], [])) == [561, 660, 759]
      assert l(N.window_max(s(), v, [35], [], [], [], [])) == [35, 36, 37, 38, 39, 40]
      # Dilation 1 and 2 mixed over two axes: a {2, 40} tensor, rows 1..40 and 41..80.
      m = t(Enum.to_list(1..80), {:s, 32}, {2, 40})
      # Window {2, 20} with dilation 2 on axis 1: columns 0, 2, ..., 38 of both rows.
      # sum = sum of odd numbers 1..39 (400) + the same + 40 * 20 = 1600.
      assert l(N.window_sum(s(), m, [2, 20], [], [], [], [1, 2])) == [1600, 1640]
      assert l(N.window_min(s(), m, [2, 40], [], [], [], [])) == [1]
    end

    test "the dtype is kept (sums wrap like Nx); integer identities" do
      y = N.window_sum(s(), t([200, 100, 1], {:u, 8}), [2], [], [], [], [])
      assert Emily.dtype(y) == {:u, 8}
      assert l(y) == [44, 101]
      assert l(N.window_max(s(), t([3, 1, 2], {:u, 8}), [2], [], [1], [0], [])) == [3, 3, 2]
      assert l(N.window_min(s(), t([-3, 1], {:s, 8}), [2], [], [0], [1], [])) == [-3, 1]
      assert l(N.window_max(s(), t([-3, -1], {:s, 64}), [2], [], [1], [0], [])) == [-3, -1]
    end

    test "errors", %{x: x} do
      assert_raise Emily.Error, ~r/window_sum: a window of extent 4 does not fit axis 0/, fn ->
        l(N.window_sum(s(), x, [4, 1], [], [], [], []))
      end

      assert_raise Emily.Error, ~r/window_max: a window of extent 5 does not fit/, fn ->
        l(N.window_max(s(), x, [3, 3], [], [], [], [2, 1]))
      end

      assert_raise Emily.Error, ~r/expected 2 window dimensions, got 1/, fn ->
        l(N.window_min(s(), x, [2], [], [], [], []))
      end

      # Extents past 32-bit sizes are measured, not wrapped.
      assert_raise Emily.Error, ~r/a window of extent 4000000000000000001 does not fit/, fn ->
        l(N.window_sum(s(), x, [2_000_000_001, 1], [], [], [], [2_000_000_000, 1]))
      end

      assert_raise Emily.Error, ~r/strides must be positive/, fn ->
        l(N.window_product(s(), x, [2, 2], [0, 1], [], [], []))
      end

      assert_raise Emily.Error, ~r/expected 2 low paddings, got 1/, fn ->
        l(N.window_sum(s(), x, [2, 2], [], [1], [], []))
      end

      assert_raise ArgumentError, fn -> N.window_sum(s(), x, :nope, [], [], [], []) end
      alive!()
    end
  end

  describe "window_scatter_max / window_scatter_min" do
    setup do
      # Nx's doctest tensors.
      a =
        t(
          [7, 2, 5, 3, 10, 2, 3, 8, 9, 3, 4, 2, 1, 5, 7, 5, 6, 1, 0, 6, 2, 7, 2, 8],
          {:s, 32},
          {4, 6}
        )

      b = t([7, 2, 5, 3, 8, 3, 8, 9, 3, 4, 1, 5, 7, 5, 6, 0, 6, 2, 10, 2], {:s, 32}, {4, 5})
      {:ok, a: a, b: b, src: t([2, 6, 3, 1], {:s, 32}, {2, 2}), zero: t([0], {:s, 32}, {})}
    end

    test "max: each window's source lands on its max", %{a: a, src: src, zero: zero} do
      y = N.window_scatter_max(s(), a, src, zero, [2, 3], [2, 3], [0, 0], [0, 0])
      assert Emily.shape(y) == {4, 6}

      assert l(y) ==
               [0, 0, 0, 0, 6, 0] ++
                 [0, 0, 2, 0, 0, 0] ++ [0, 0, 3, 0, 0, 0] ++ [0, 0, 0, 0, 0, 1]
    end

    test "max: overlapping windows add up", %{b: b, src: src, zero: zero} do
      y = N.window_scatter_max(s(), b, src, zero, [2, 3], [2, 2], [0, 0], [0, 0])
      assert l(y) == [0, 0, 0, 0, 0] ++ [0, 0, 8, 0, 0] ++ [0, 0, 3, 0, 0] ++ [0, 0, 0, 1, 0]
    end

    test "min: ties go to the last position in the window", %{a: a, b: b, src: src, zero: zero} do
      y = N.window_scatter_min(s(), a, src, zero, [2, 3], [2, 3], [0, 0], [0, 0])

      assert l(y) ==
               [0, 2, 0, 0, 0, 0] ++
                 [0, 0, 0, 0, 0, 6] ++ [0, 0, 0, 0, 0, 1] ++ [3, 0, 0, 0, 0, 0]

      y = N.window_scatter_min(s(), b, src, zero, [2, 3], [2, 2], [0, 0], [0, 0])
      assert l(y) == [0, 2, 0, 0, 0] ++ [0, 0, 0, 6, 0] ++ [0, 0, 0, 0, 0] ++ [3, 0, 0, 0, 1]
    end

    test "init fills untouched positions and starts the sums; dtypes promote", %{a: a, src: src} do
      y =
        N.window_scatter_max(s(), a, src, t([0.5], {:f, 32}, {}), [2, 3], [2, 3], [0, 0], [0, 0])

      assert Emily.dtype(y) == {:f, 32}
      assert Enum.take(l(y), 6) == [0.5, 0.5, 0.5, 0.5, 6.5, 0.5]
    end

    test "padding is never selected" do
      # Windows [pad, -1] and [-3, -2]: -1 and -2 are selected even though every element
      # is below the init value.
      v = t([-1.0, -3.0, -2.0])
      src = t([10.0, 20.0])

      assert l(N.window_scatter_max(s(), v, src, t([0.0]), [2], [2], [1], [0])) == [
               10.0,
               0.0,
               20.0
             ]

      # [1, -inf] and [-inf, pad]: the element ties the padding and still wins.
      w = t([1.0, :neg_infinity])
      assert l(N.window_scatter_max(s(), w, src, t([0.0]), [2], [1], [0], [1])) == [10.0, 20.0]
      u = t([1.0, :infinity])
      assert l(N.window_scatter_min(s(), u, src, t([0.0]), [2], [1], [0], [1])) == [10.0, 20.0]
    end

    test "errors", %{a: a, src: src, zero: zero} do
      assert_raise Emily.Error, ~r/source has shape \{2, 2\}, the windows \{3, 4\}/, fn ->
        l(N.window_scatter_max(s(), a, src, zero, [2, 3], [1, 1], [0, 0], [0, 0]))
      end

      assert_raise Emily.Error, ~r/padding must be non-negative/, fn ->
        l(N.window_scatter_min(s(), a, src, zero, [2, 3], [2, 3], [-1, 0], [0, 0]))
      end

      assert_raise Emily.Error, ~r/init value must hold one element/, fn ->
        l(N.window_scatter_min(s(), a, src, src, [2, 3], [2, 3], [0, 0], [0, 0]))
      end

      assert_raise Emily.Error, ~r/expected 2 window dimensions/, fn ->
        l(N.window_scatter_max(s(), a, src, zero, [2], [2, 3], [0, 0], [0, 0]))
      end

      alive!()
    end
  end
end
