defmodule Emily.Native.SortTest do
  use Emily.TestCase, async: true

  # Ties (3.0 twice, 1.0 twice, -0.0 == 0.0, NaN twice) and infinities.
  @values [3.0, 1.0, :nan, 3.0, :neg_infinity, 1.0, -0.0, 0.0, :infinity, :nan]

  test "ascending: stable, NaN last" do
    x = t(@values)
    assert l(N.argsort(s(), x, 0, false)) == [4, 6, 7, 1, 5, 0, 3, 8, 2, 9]

    assert l(N.sort(s(), x, 0, false)) ==
             [:neg_infinity, -0.0, 0.0, 1.0, 1.0, 3.0, 3.0, :infinity, :nan, :nan]

    assert Emily.dtype(N.argsort(s(), x, 0, false)) == {:u, 32}
  end

  test "descending: stable (ties keep input order), NaN first" do
    x = t(@values)
    assert l(N.argsort(s(), x, 0, true)) == [2, 9, 8, 0, 3, 1, 5, 6, 7, 4]

    assert l(N.sort(s(), x, 0, true)) ==
             [:nan, :nan, :infinity, 3.0, 3.0, 1.0, 1.0, -0.0, 0.0, :neg_infinity]
  end

  test "along either axis of a matrix, negative axes, integer types" do
    # [[3, 1, 2], [1, 3, 3]]
    m = t([3, 1, 2, 1, 3, 3], {:s, 32}, {2, 3})
    assert l(N.sort(s(), m, 1, false)) == [1, 2, 3, 1, 3, 3]
    assert l(N.sort(s(), m, -1, true)) == [3, 2, 1, 3, 3, 1]
    assert l(N.argsort(s(), m, 1, false)) == [1, 2, 0, 0, 1, 2]
    assert l(N.argsort(s(), m, 1, true)) == [0, 2, 1, 1, 2, 0]
    assert l(N.argsort(s(), m, 0, false)) == [1, 0, 0, 0, 1, 1]
    assert l(N.argsort(s(), m, -2, true)) == [0, 1, 1, 1, 0, 0]
    assert l(N.sort(s(), m, 0, true)) == [3, 3, 3, 1, 1, 2]

    assert l(N.sort(s(), t([255, 0, 128], {:u, 8}), 0, true)) == [255, 128, 0]
    big = 9_223_372_036_854_775_807
    assert l(N.argsort(s(), t([big, -big, 0], {:s, 64}), 0, true)) == [0, 2, 1]
    assert l(N.sort(s(), t([1.5, -2.0, 0.5], {:bf, 16}), 0, false)) == [-2.0, 0.5, 1.5]
  end

  test "stability holds on a long axis with few distinct keys" do
    n = 3000
    keys = for i <- 0..(n - 1), do: rem(i * 7919, 5) * 1.0
    x = t(keys)

    for desc <- [false, true] do
      idx = l(N.argsort(s(), x, 0, desc))
      assert Enum.sort(idx) == Enum.to_list(0..(n - 1))
      pairs = Enum.map(idx, &{Enum.at(keys, &1), &1})

      for [{k1, i1}, {k2, i2}] <- Enum.chunk_every(pairs, 2, 1, :discard) do
        if desc, do: assert(k1 >= k2), else: assert(k1 <= k2)
        if k1 == k2, do: assert(i1 < i2)
      end
    end
  end

  test "topk: the k largest, in no particular order" do
    x = t([3, 1, 4, 1, 5, 9, 2, 6], {:s, 32})
    assert Enum.sort(l(N.topk(s(), x, 3, 0))) == [5, 6, 9]
    m = t([3, 1, 4, 1, 5, 9], {:s, 32}, {2, 3})
    top = N.topk(s(), m, 2, 1)
    assert Emily.shape(top) == {2, 2}
    [a, b, c, d] = l(top)
    assert Enum.sort([a, b]) == [3, 4]
    assert Enum.sort([c, d]) == [5, 9]
  end

  test "topk_sorted: largest first, ties by lower index, NaN largest" do
    x = t([3, 1, 4, 1, 5, 9, 2, 6], {:s, 32})
    [v, i] = N.topk_sorted(s(), x, 3, 0)
    assert l(v) == [9, 6, 5]
    assert l(i) == [5, 7, 4]

    [v, i] = N.topk_sorted(s(), t([1, 3, 3, 2, 3], {:s, 32}), 2, 0)
    assert l(v) == [3, 3]
    assert l(i) == [1, 2]

    [v, i] = N.topk_sorted(s(), t([:nan, :neg_infinity, :infinity, 0.0]), 3, 0)
    assert l(v) == [:nan, :infinity, 0.0]
    assert l(i) == [0, 2, 3]

    m = t([3, 1, 4, 1, 5, 9], {:s, 32}, {2, 3})
    [v, i] = N.topk_sorted(s(), m, 1, 0)
    assert Emily.shape(v) == {1, 3}
    assert l(v) == [3, 5, 9]
    assert l(i) == [0, 1, 1]
    [v, _] = N.topk_sorted(s(), m, 0, 1)
    assert Emily.shape(v) == {2, 0}
  end

  test "partition and argpartition put the kth element in place" do
    x = t([5, 1, 4, 2, 3, 9, 0], {:s, 32})

    for kth <- [0, 2, 3, 6, -1] do
      k = if kth < 0, do: 7 + kth, else: kth
      p = l(N.partition(s(), x, kth, 0))
      assert Enum.at(p, k) == Enum.at([0, 1, 2, 3, 4, 5, 9], k)
      assert Enum.all?(Enum.take(p, k), &(&1 <= Enum.at(p, k)))
      assert Enum.all?(Enum.drop(p, k + 1), &(&1 >= Enum.at(p, k)))

      ip = l(N.argpartition(s(), x, kth, 0))
      assert Enum.sort(ip) == Enum.to_list(0..6)
      assert Enum.map(ip, &Enum.at([5, 1, 4, 2, 3, 9, 0], &1)) |> Enum.at(k) == Enum.at(p, k)
    end

    m = t([3.0, 1.0, 2.0, 0.0, -1.0, 5.0], {:f, 32}, {2, 3})
    assert l(N.partition(s(), m, 0, 0)) == [0.0, -1.0, 2.0, 3.0, 1.0, 5.0]
  end

  test "searchsorted" do
    sorted = t([1, 2, 2, 3], {:s, 32})
    v = t([2, 0, 5, 3], {:s, 32})
    assert l(N.searchsorted(s(), sorted, v, "left")) == [1, 0, 4, 3]
    assert l(N.searchsorted(s(), sorted, v, "right")) == [3, 0, 4, 4]
    assert l(N.searchsorted(s(), t([1.0, 2.0]), t([1.5, :nan]), "left")) == [1, 2]
  end

  test "every sort op raises ArgumentError on a non-tensor argument" do
    for row <- family_rows(["sort"]) do
      assert_raise ArgumentError, fn -> apply(N, row.name, [s() | bad_args(row)]) end
    end

    assert l(N.sort(s(), t([2.0, 1.0]), 0, false)) == [1.0, 2.0]
  end

  test "bad axis, k, kth and side raise Emily.Error" do
    m = t([3, 1, 4, 1, 5, 9], {:s, 32}, {2, 3})

    bad = [
      sort: [m, 2, false],
      sort: [m, -3, true],
      argsort: [m, 2, false],
      argsort: [m, 5, true],
      topk: [m, 4, 1],
      topk: [m, 1, 2],
      topk_sorted: [m, 4, 1],
      topk_sorted: [m, -1, 1],
      topk_sorted: [m, 1, 3],
      partition: [m, 3, 1],
      partition: [m, 0, 2],
      argpartition: [m, -4, 1],
      searchsorted: [m, t([1], {:s, 32}), "left"],
      searchsorted: [t([1, 2], {:s, 32}), t([1], {:s, 32}), "middle"]
    ]

    for {op, args} <- bad do
      e =
        assert_raise Emily.Error, fn ->
          case apply(N, op, [s() | args]) do
            [v, i] -> l(v) && l(i)
            v -> l(v)
          end
        end

      assert e.message =~ "#{op}:", "#{op}: #{e.message}"
    end

    assert l(N.sort(s(), t([2.0, 1.0]), 0, false)) == [1.0, 2.0]
  end
end
