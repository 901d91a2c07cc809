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

  test "a transposed matrix reads back as its transpose, for every element size" do
    # Read back, a transpose is copied row-contiguous (on a CPU by Emily's tiled copy,
    # split over the pool above 64K elements): tiles' edges, a split's, and the layouts
    # the copy leaves to MLX (3-D, a transpose of a transpose, a slice of one). On the
    # CPU stream, which has every type here (a GPU has no f64).
    with_cpu(fn ->
      for type <- [{:u, 8}, {:bf, 16}, {:s, 32}, {:f, 32}, {:f, 64}, {:c, 64}],
          {r, c} <- [{1, 7}, {3, 5}, {67, 131}, {600, 700}] do
        m =
          N.reshape(
            s(),
            N.astype(s(), N.arange(s(), 0.0, r * c * 1.0, 1.0, {:f, 32}), type),
            {r, c}
          )

        rows = m |> l() |> Enum.chunk_every(c)
        expected = rows |> Enum.zip_with(& &1) |> List.flatten()
        y = N.transpose(s(), m, [1, 0])
        Emily.eval(y)
        assert l(y) == expected, "#{inspect(type)} #{r}x#{c}"
        assert l(N.transpose(s(), y, [1, 0])) == List.flatten(rows)
      end

      x = N.reshape(s(), N.arange(s(), 0.0, 24.0, 1.0, {:f, 32}), {2, 3, 4})
      assert l(N.transpose(s(), x, [2, 1, 0])) |> Enum.take(4) == [0.0, 12.0, 4.0, 16.0]

      y =
        N.transpose(s(), N.reshape(s(), N.arange(s(), 0.0, 12.0, 1.0, {:f, 32}), {3, 4}), [1, 0])

      assert l(N.slice(s(), y, [1, 0], [3, 3], [1, 1])) == [1.0, 5.0, 9.0, 2.0, 6.0, 10.0]
    end)
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

  # The stream still evaluates after an error.
  defp alive!, do: assert(l(N.add(s(), t([1.0]), t([2.0]))) == [3.0])

  describe "pad (Nx semantics)" do
    test "constant lo/hi", %{x: x} do
      y = N.pad(s(), x, t([9], {:s, 32}, {}), [1, 0], [0, 2], [0, 0])
      assert Emily.shape(y) == {3, 5}
      assert l(y) == [9, 9, 9, 9, 9, 0, 1, 2, 9, 9, 3, 4, 5, 9, 9]
    end

    test "negative padding crops", %{x: x} do
      assert l(N.pad(s(), x, t([0], {:s, 32}, {}), [0, -1], [-1, 0], [0, 0])) == [1, 2]
      assert l(N.pad(s(), x, t([7], {:s, 32}, {}), [-1, 1], [0, -2], [0, 0])) == [7, 3]
    end

    test "interior padding, then edges" do
      v = t([1, 2, 3], {:s, 32})
      assert l(N.pad(s(), v, t([0], {:s, 32}, {}), [0], [0], [2])) == [1, 0, 0, 2, 0, 0, 3]
      assert l(N.pad(s(), v, t([0], {:s, 32}, {}), [1], [-1], [2])) == [0, 1, 0, 0, 2, 0, 0]
      assert l(N.pad(s(), v, t([0], {:s, 32}, {}), [-2], [1], [1])) == [2, 0, 3, 0]
      # Nx's doctest: a {2, 2} tensor, interior 1 on both axes, value 0.
      m = t([1, 2, 3, 4], {:s, 32}, {2, 2})
      y = N.pad(s(), m, t([0], {:s, 32}, {}), [0, 0], [0, 0], [1, 1])
      assert Emily.shape(y) == {3, 3}
      assert l(y) == [1, 0, 2, 0, 0, 0, 3, 0, 4]
    end

    test "the value is cast to the tensor's dtype; an empty interior list means none", %{x: x} do
      assert l(N.pad(s(), x, t([2.5]), [0, 1], [0, 0], [])) == [2, 0, 1, 2, 2, 3, 4, 5]
      f = N.pad(s(), t([1.0]), t([:neg_infinity]), [1], [1], [0])
      assert l(f) == [:neg_infinity, 1.0, :neg_infinity]
    end

    test "errors", %{x: x} do
      z = t([0], {:s, 32}, {})

      assert_raise Emily.Error, ~r/pad: padding -2, -2 leaves axis 0 with a negative size/, fn ->
        l(N.pad(s(), x, z, [-2, 0], [-2, 0], [0, 0]))
      end

      assert_raise Emily.Error, ~r/expected 2 low padding values, got 1/, fn ->
        l(N.pad(s(), x, z, [0], [0, 0], [0, 0]))
      end

      assert_raise Emily.Error, ~r/interior padding must be non-negative/, fn ->
        l(N.pad(s(), x, z, [0, 0], [0, 0], [0, -1]))
      end

      assert_raise Emily.Error, ~r/pad: .*outside the supported range/, fn ->
        l(N.pad(s(), x, z, [2_000_000_000, 0], [2_000_000_000, 0], [0, 0]))
      end

      assert_raise Emily.Error, ~r/interior padding makes axis 1 too large/, fn ->
        l(N.pad(s(), x, z, [0, 0], [0, 0], [0, 2_000_000_000]))
      end

      assert_raise Emily.Error, ~r/one element/, fn ->
        l(N.pad(s(), x, t([1, 2], {:s, 32}), [0, 0], [0, 0], [0, 0]))
      end

      alive!()
    end
  end

  describe "pad_mode" do
    test "edge, reflect, symmetric, constant" do
      v = t([1, 2, 3], {:s, 32})
      assert l(N.pad_mode(s(), v, [2], [2], "edge")) == [1, 1, 1, 2, 3, 3, 3]
      assert l(N.pad_mode(s(), v, [2], [2], "reflect")) == [3, 2, 1, 2, 3, 2, 1]
      assert l(N.pad_mode(s(), v, [2], [2], "symmetric")) == [2, 1, 1, 2, 3, 3, 2]
      assert l(N.pad_mode(s(), v, [1], [0], "constant")) == [0, 1, 2, 3]
      m = t([1, 2, 3, 4], {:s, 32}, {2, 2})
      assert l(N.pad_mode(s(), m, [1, 0], [0, 1], "edge")) == [1, 2, 2, 1, 2, 2, 3, 4, 4]
    end

    test "errors" do
      v = t([1, 2, 3], {:s, 32})

      assert_raise Emily.Error, ~r/unknown mode "wrap"/, fn ->
        l(N.pad_mode(s(), v, [1], [1], "wrap"))
      end

      assert_raise Emily.Error, ~r/non-negative/, fn ->
        l(N.pad_mode(s(), v, [-1], [1], "edge"))
      end

      assert_raise Emily.Error, ~r/cannot pad empty axis 0 in mode reflect/, fn ->
        l(N.pad_mode(s(), t([], {:s, 32}), [1], [1], "reflect"))
      end

      alive!()
    end
  end

  test "stack", %{x: x} do
    a = t([1, 2], {:s, 32})
    b = t([3, 4], {:s, 32})
    assert l(N.stack(s(), [a, b], 0)) == [1, 2, 3, 4]
    y = N.stack(s(), [a, b], 1)
    assert Emily.shape(y) == {2, 2}
    assert l(y) == [1, 3, 2, 4]
    assert Emily.shape(N.stack(s(), [x, x, x], -1)) == {2, 3, 3}
    assert_raise Emily.Error, ~r/stack/, fn -> l(N.stack(s(), [a, x], 0)) end
    assert_raise Emily.Error, ~r/stack/, fn -> l(N.stack(s(), [a, b], 2)) end
    alive!()
  end

  test "flip", %{x: x} do
    assert l(N.flip(s(), x, [0])) == [3, 4, 5, 0, 1, 2]
    assert l(N.flip(s(), x, [1])) == [2, 1, 0, 5, 4, 3]
    assert l(N.flip(s(), x, [0, 1])) == [5, 4, 3, 2, 1, 0]
    assert l(N.flip(s(), x, [])) == [0, 1, 2, 3, 4, 5]
    assert_raise Emily.Error, ~r/flip/, fn -> l(N.flip(s(), x, [2])) end
    alive!()
  end

  test "repeat and tile", %{x: x} do
    assert l(N.repeat(s(), x, 2, 1)) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert l(N.repeat(s(), x, 2, 0)) == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
    y = N.tile(s(), x, [2, 1])
    assert Emily.shape(y) == {4, 3}
    assert l(y) == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    assert l(N.tile(s(), t([1, 2], {:s, 32}), [2])) == [1, 2, 1, 2]
    assert_raise Emily.Error, ~r/repeat/, fn -> l(N.repeat(s(), x, -1, 0)) end
    assert_raise Emily.Error, ~r/repeat/, fn -> l(N.repeat(s(), x, 2, 3)) end
    assert_raise Emily.Error, ~r/tile/, fn -> l(N.tile(s(), x, [-1, 1])) end
    alive!()
  end

  describe "as_strided" do
    test "overlapping windows and broadcasts", %{x: x} do
      v = t(Enum.to_list(0..5), {:s, 32})
      w = N.as_strided(s(), v, {4, 3}, [1, 1], 0)
      assert l(w) == [0, 1, 2, 1, 2, 3, 2, 3, 4, 3, 4, 5]
      assert l(N.as_strided(s(), v, {2, 2}, [0, 2], 1)) == [1, 3, 1, 3]
      # Reversed, from the last element.
      assert l(N.as_strided(s(), v, {3}, [-2], 5)) == [5, 3, 1]
      # Strides count row-major elements, also of a transposed input.
      xt = N.transpose(s(), x, [1, 0])
      assert l(N.as_strided(s(), xt, {3}, [2], 0)) == [0, 1, 2]
    end

    test "a view reaching outside the tensor is an error" do
      v = t(Enum.to_list(0..5), {:s, 32})

      assert_raise Emily.Error,
                   ~r/as_strided: the view reaches elements 0 to 7, outside the tensor's 6/,
                   fn ->
                     l(N.as_strided(s(), v, {4, 3}, [1, 2], 0))
                   end

      assert_raise Emily.Error, ~r/reaches elements -1 to 1/, fn ->
        l(N.as_strided(s(), v, {2}, [-2], 1))
      end

      assert_raise Emily.Error, ~r/2 strides for 1 dimensions/, fn ->
        l(N.as_strided(s(), v, {2}, [1, 1], 0))
      end

      assert_raise Emily.Error, ~r/offset must be non-negative/, fn ->
        l(N.as_strided(s(), v, {1}, [1], -1))
      end

      alive!()
    end
  end

  describe "split" do
    test "into parts of given sizes", %{x: x} do
      [a, b] = N.split(s(), x, [1, 2], 1)
      assert Emily.shape(a) == {2, 1}
      assert l(a) == [0, 3]
      assert l(b) == [1, 2, 4, 5]
      [c, d, e] = N.split(s(), x, [1, 0, 1], 0)
      assert l(c) == [0, 1, 2]
      assert Emily.shape(d) == {0, 3}
      assert l(e) == [3, 4, 5]
      [whole] = N.split(s(), x, [3], -1)
      assert l(whole) == [0, 1, 2, 3, 4, 5]
    end

    test "errors", %{x: x} do
      [bad, _] = N.split(s(), x, [1, 1], 1)
      assert_raise Emily.Error, ~r/split: sizes sum to 2, axis 1 has 3/, fn -> l(bad) end
      [bad] = N.split(s(), x, [2], 2)
      assert_raise Emily.Error, ~r/split: axis 2 is out of range/, fn -> l(bad) end

      assert_raise ArgumentError, ~r/split: expected 1 to 65536 outputs, got 0/, fn ->
        N.split(s(), x, [], 0)
      end

      alive!()
    end
  end

  test "meshgrid" do
    a = t([1, 2, 3], {:s, 32})
    b = t([4, 5], {:s, 32})
    [gx, gy] = N.meshgrid(s(), [a, b], false, "ij")
    assert Emily.shape(gx) == {3, 2}
    assert l(gx) == [1, 1, 2, 2, 3, 3]
    assert l(gy) == [4, 5, 4, 5, 4, 5]
    [hx, hy] = N.meshgrid(s(), [a, b], false, "xy")
    assert Emily.shape(hx) == {2, 3}
    assert l(hx) == [1, 2, 3, 1, 2, 3]
    assert l(hy) == [4, 4, 4, 5, 5, 5]
    [sx, _] = N.meshgrid(s(), [a, b], true, "ij")
    assert Emily.shape(sx) == {3, 1}
    [bad, _] = N.meshgrid(s(), [a, b], false, "zz")
    assert_raise Emily.Error, ~r/meshgrid/, fn -> l(bad) end
    alive!()
  end
end
