defmodule Emily.Native.RandomTest do
  use Emily.TestCase, async: true
  import Bitwise

  # --- oracle: threefry2x32 (20 rounds), MLX's counter-based generator ----------------

  @m32 0xFFFFFFFF
  defp rotl(x, r), do: (x <<< r ||| x >>> (32 - r)) &&& @m32

  defp threefry({k0, k1}, {c0, c1}) do
    ks = {k0, k1, bxor(bxor(k0, k1), 0x1BD11BDA)}
    x = {c0 + k0 &&& @m32, c1 + k1 &&& @m32}

    Enum.reduce(0..4, x, fn i, acc ->
      rots = if rem(i, 2) == 0, do: [13, 15, 26, 6], else: [17, 29, 16, 24]

      {a, b} =
        Enum.reduce(rots, acc, fn r, {a, b} ->
          a = a + b &&& @m32
          {a, bxor(rotl(b, r), a)}
        end)

      {a + elem(ks, rem(i + 1, 3)) &&& @m32, b + elem(ks, rem(i + 2, 3)) + i + 1 &&& @m32}
    end)
  end

  # The n u32 words MLX draws from one key: word i and word half + odd + i come from one
  # hash of the counter pair (i, half + odd + i); an odd count's middle word from (half, 0).
  defp mlx_bits(key, n) do
    half = div(n, 2)
    odd = rem(n, 2)

    pairs =
      for i <- 0..(half - 1)//1 do
        {a, b} = threefry(key, {i, half + odd + i})
        [{i, a}, {half + odd + i, b}]
      end

    middle = if odd == 1, do: [{half, elem(threefry(key, {half, 0}), 0)}], else: []
    (List.flatten(pairs) ++ middle) |> Enum.sort() |> Enum.map(&elem(&1, 1))
  end

  # x rounded to the nearest f32
  defp f32(x) do
    <<y::float-32>> = <<x::float-32>>
    y
  end

  # --- statistics helpers --------------------------------------------------------------

  defp mean(xs), do: Enum.sum(xs) / length(xs)

  defp var(xs) do
    m = mean(xs)
    Enum.reduce(xs, 0.0, fn x, acc -> acc + (x - m) * (x - m) end) / length(xs)
  end

  defp assert_within(value, expected, tol, what) do
    assert abs(value - expected) <= tol,
           "#{what}: #{value} is not within #{tol} of #{expected}"
  end

  defp assert_alive, do: assert(l(N.add(s(), t([1.0]), t([2.0]))) == [3.0])

  @n 100_000

  test "the threefry oracle matches the Random123 known answers" do
    assert threefry({0, 0}, {0, 0}) == {0x6B200159, 0x99BA4EFE}
    assert threefry({@m32, @m32}, {@m32, @m32}) == {0x1CB996FC, 0xBB002BE7}

    assert threefry({0x13198A2E, 0x03707344}, {0x243F6A88, 0x85A308D3}) ==
             {0xC4923A9C, 0x483DF7A0}
  end

  describe "keys" do
    test "key(seed) holds the seed's high and low words" do
      k = N.key(s(), 42)
      assert Emily.dtype(k) == {:u, 32}
      assert l(k) == [0, 42]
      assert l(N.key(s(), 0x1_0000_0002)) == [1, 2]
      # seeds are taken modulo 2^64
      assert l(N.key(s(), -1)) == [@m32, @m32]
    end

    test "split matches threefry on the key" do
      k = N.key(s(), 42)
      keys = N.key_split(s(), k, 3)
      assert Emily.shape(keys) == {3, 2}
      assert l(keys) == mlx_bits({0, 42}, 6)

      k2 = N.key_split(s(), N.key(s(), 7), 2)
      assert l(k2) == mlx_bits({0, 7}, 4)
    end

    test "split keys differ from each other and from the parent" do
      keys = N.key_split(s(), N.key(s(), 1), 4) |> l() |> Enum.chunk_every(2)
      assert length(Enum.uniq([[0, 1] | keys])) == 5
    end

    test "bits of every width" do
      k = N.key(s(), 3)
      assert l(N.bits(s(), k, {5}, 4)) == mlx_bits({0, 3}, 5)
      assert l(N.bits(s(), k, {4}, 4)) == mlx_bits({0, 3}, 4)
      b16 = N.bits(s(), k, {4}, 2)
      assert Emily.dtype(b16) == {:u, 16}
      # four u16 are two u32 words, little-endian
      words = mlx_bits({0, 3}, 2)
      assert l(b16) == Enum.flat_map(words, &[&1 &&& 0xFFFF, &1 >>> 16])
      assert Emily.dtype(N.bits(s(), k, {3}, 1)) == {:u, 8}
    end
  end

  describe "distributions" do
    test "uniform's values are threefry bits over 2^32, in f32" do
      k = N.key(s(), 42)
      u = N.uniform(s(), k, 0, 1, {4}, {:f, 32})
      assert Emily.dtype(u) == {:f, 32}

      expected =
        for w <- mlx_bits({0, 42}, 4), do: min(f32(w * 1.0) / 4_294_967_296, f32(1 - 2.0 ** -24))

      assert l(u) == expected
    end

    test "the same key gives the same numbers" do
      k = N.key(s(), 5)

      for fun <- [
            fn -> N.uniform(s(), k, 0, 1, {64}, {:f, 32}) end,
            fn -> N.normal(s(), k, 0, 1, {64}, {:f, 32}) end,
            fn -> N.randint(s(), k, 0, 100, {64}, {:s, 32}) end,
            fn -> N.gumbel(s(), k, {64}, {:f, 32}) end
          ] do
        assert l(fun.()) == l(fun.())
      end

      [a, b] = N.key_split(s(), k, 2) |> l() |> Enum.chunk_every(2) |> Enum.map(&t(&1, {:u, 32}))

      refute l(N.uniform(s(), a, 0, 1, {16}, {:f, 32})) ==
               l(N.uniform(s(), b, 0, 1, {16}, {:f, 32}))
    end

    test "shapes and dtypes" do
      with_cpu(fn ->
        k = N.key(s(), 9)
        assert Emily.shape(N.uniform(s(), k, 0, 1, {2, 3}, {:bf, 16})) == {2, 3}
        assert Emily.dtype(N.uniform(s(), k, 0, 1, {2}, {:bf, 16})) == {:bf, 16}
        assert Emily.dtype(N.uniform(s(), k, 0, 1, {2}, {:f, 16})) == {:f, 16}
        assert Emily.dtype(N.normal(s(), k, 0, 1, {2}, {:f, 64})) == {:f, 64}
        assert Emily.dtype(N.randint(s(), k, 0, 200, {2}, {:u, 8})) == {:u, 8}
        assert Emily.dtype(N.randint(s(), k, -5, 5, {2}, {:s, 64})) == {:s, 64}
        assert Emily.dtype(N.bernoulli(s(), k, t([0.5]), {4})) == :bool
        assert Emily.shape(N.truncated_normal(s(), k, -1, 1, {1, 2, 3}, {:f, 32})) == {1, 2, 3}
        assert Emily.shape(N.laplace(s(), k, 0, 1, {7}, {:f, 16})) == {7}
        c = N.categorical(s(), k, t([0.0, 1.0, 0.0, 1.0, 2.0, 3.0], {:f, 32}, {2, 3}), 1, 5)
        assert {Emily.shape(c), Emily.dtype(c)} == {{2, 5}, {:u, 32}}
      end)
    end

    # Bounds below are over 100k samples of a fixed key, each at least 5 standard errors
    # of the estimate wide, so a correct generator passes and a wrong law does not.
    test "uniform on [2, 5): range, mean 3.5 +- 0.02, variance 0.75 +- 0.02" do
      xs = l(N.uniform(s(), N.key(s(), 11), 2, 5, {@n}, {:f, 32}))
      assert Enum.all?(xs, &(&1 >= 2.0 and &1 < 5.0))
      assert_within(mean(xs), 3.5, 0.02, "mean")
      assert_within(var(xs), 0.75, 0.02, "variance")
    end

    test "normal(1, 2): mean 1 +- 0.03, variance 4 +- 0.1, 95% within 1.96 sd +- 0.005" do
      xs = l(N.normal(s(), N.key(s(), 12), 1, 2, {@n}, {:f, 32}))
      assert_within(mean(xs), 1.0, 0.03, "mean")
      assert_within(var(xs), 4.0, 0.1, "variance")
      inside = Enum.count(xs, &(abs(&1 - 1.0) < 1.96 * 2)) / @n
      assert_within(inside, 0.95, 0.005, "within 1.96 sd")
    end

    test "randint on [-3, 7): integers in range, each value 0.1 +- 0.01" do
      xs = l(N.randint(s(), N.key(s(), 13), -3, 7, {@n}, {:s, 32}))
      assert Enum.all?(xs, &(is_integer(&1) and &1 >= -3 and &1 < 7))
      freqs = Enum.frequencies(xs)
      assert Map.keys(freqs) |> Enum.sort() == Enum.to_list(-3..6)
      for {_, c} <- freqs, do: assert_within(c / @n, 0.1, 0.01, "frequency")
    end

    test "bernoulli: rate 0.3 +- 0.01; p 0 and 1 are certain" do
      xs = l(N.bernoulli(s(), N.key(s(), 14), t([0.3]), {@n}))
      assert_within(Enum.count(xs, & &1) / @n, 0.3, 0.01, "rate")
      assert l(N.bernoulli(s(), N.key(s(), 14), t([0.0, 1.0]), {2})) == [false, true]
    end

    test "truncated_normal on [-1, 2]: in bounds, mean 0.2296 +- 0.01" do
      xs = l(N.truncated_normal(s(), N.key(s(), 15), -1, 2, {@n}, {:f, 32}))
      assert Enum.all?(xs, &(&1 >= -1.0 and &1 <= 2.0))
      # (phi(-1) - phi(2)) / (Phi(2) - Phi(-1)) = (0.2419707 - 0.0539910) / 0.8185946
      assert_within(mean(xs), 0.2296357, 0.01, "mean")
    end

    test "gumbel: mean Euler's gamma +- 0.02, variance pi^2/6 +- 0.08" do
      xs = l(N.gumbel(s(), N.key(s(), 16), {@n}, {:f, 32}))
      assert_within(mean(xs), 0.5772157, 0.02, "mean")
      assert_within(var(xs), :math.pi() ** 2 / 6, 0.08, "variance")
    end

    test "laplace(0, 1): mean 0 +- 0.03, variance 2 +- 0.1" do
      xs = l(N.laplace(s(), N.key(s(), 17), 0, 1, {@n}, {:f, 32}))
      assert_within(mean(xs), 0.0, 0.03, "mean")
      assert_within(var(xs), 2.0, 0.1, "variance")
    end

    test "categorical: frequencies follow softmax(logits) +- 0.01" do
      p = [0.1, 0.2, 0.7]
      logits = t(Enum.map(p, &:math.log/1))
      xs = l(N.categorical(s(), N.key(s(), 18), logits, 0, @n))
      freqs = Enum.frequencies(xs)

      for {pi, i} <- Enum.with_index(p) do
        assert_within(Map.get(freqs, i, 0) / @n, pi, 0.01, "class #{i}")
      end

      # -inf logits are never drawn
      ys = l(N.categorical(s(), N.key(s(), 19), t([:neg_infinity, 0.0, :neg_infinity]), 0, 1000))
      assert Enum.uniq(ys) == [1]
    end

    test "permutation shuffles along an axis" do
      xs = l(N.permutation(s(), N.key(s(), 20), N.arange(s(), 0, 100, 1, {:s, 32}), 0))
      assert Enum.sort(xs) == Enum.to_list(0..99)
      refute xs == Enum.to_list(0..99)
      # rows move whole
      m = t([1, 1, 2, 2, 3, 3], {:s, 32}, {3, 2})
      rows = l(N.permutation(s(), N.key(s(), 21), m, 0)) |> Enum.chunk_every(2)
      assert Enum.sort(rows) == [[1, 1], [2, 2], [3, 3]]
    end
  end

  test "bad keys, dtypes, shapes and axes raise Emily.Error; the stream survives" do
    k = N.key(s(), 42)
    bad_key = t([1, 2, 3], {:u, 32})
    float_key = t([1.0, 2.0])

    cases = [
      {"key_split", "key type uint32", fn -> N.key_split(s(), float_key, 2) end},
      {"key_split", "Negative", fn -> N.key_split(s(), k, -1) end},
      {"bits", "Bit width", fn -> N.bits(s(), k, {2}, 3) end},
      {"uniform", "floating point", fn -> N.uniform(s(), k, 0, 1, {2}, {:s, 32}) end},
      {"uniform", "key shape", fn -> N.uniform(s(), bad_key, 0, 1, {2}, {:f, 32}) end},
      {"normal", "floating point", fn -> N.normal(s(), k, 0, 1, {2}, {:s, 32}) end},
      {"randint", "integer dtypes", fn -> N.randint(s(), k, 0, 10, {2}, {:f, 32}) end},
      {"bernoulli", "float type", fn -> N.bernoulli(s(), k, t([1], {:s, 32}), {2}) end},
      {"bernoulli", "broadcast", fn -> N.bernoulli(s(), k, t([0.1, 0.2, 0.3]), {2}) end},
      {"truncated_normal", "floating point",
       fn -> N.truncated_normal(s(), k, -1, 1, {2}, {:s, 32}) end},
      {"gumbel", "floating point", fn -> N.gumbel(s(), k, {2}, {:s, 32}) end},
      {"laplace", "floating point", fn -> N.laplace(s(), k, 0, 1, {2}, {:s, 32}) end},
      {"categorical", "Invalid axis", fn -> N.categorical(s(), k, t([1.0, 2.0]), 3, 2) end},
      {"permutation", "permutation", fn -> N.permutation(s(), k, t([1.0, 2.0]), 2) end}
    ]

    for {name, pattern, fun} <- cases do
      e = assert_raise Emily.Error, fn -> l(fun.()) end
      assert e.message =~ name <> ":", e.message
      assert e.message =~ pattern, e.message
      assert_alive()
    end

    assert_raise ArgumentError, fn -> N.key(s(), 1.5) end
    assert_raise ArgumentError, fn -> N.uniform(s(), k, 0, 1, {-2}, {:f, 32}) end
    assert_raise ArgumentError, fn -> N.normal(s(), k, 0, 1, {2}, :f32) end
  end
end
