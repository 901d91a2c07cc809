defmodule Emily.Native.ConvTest do
  use Emily.TestCase, async: true

  # --- plain Elixir oracles --------------------------------------------------------

  # Nx's conv on Nx layouts (input [N, C, S...], kernel [O, C / fg, S...]), written from
  # the definition: every output element sums x * k over the kernel window, reading the
  # input through its (virtual) padding and dilation. Returns {flat list, shape}.
  defp ref_conv(x, xs, k, ks, opts) do
    [n, _c | sp] = Tuple.to_list(xs)
    [o, i | kk] = Tuple.to_list(ks)
    d = length(sp)
    strides = opts[:strides] || List.duplicate(1, d)
    lo = opts[:lo] || List.duplicate(0, d)
    hi = opts[:hi] || List.duplicate(0, d)
    idil = opts[:idil] || List.duplicate(1, d)
    kdil = opts[:kdil] || List.duplicate(1, d)
    fg = opts[:fg] || 1
    bg = opts[:bg] || 1

    out_sp =
      Enum.zip_with([sp, kk, strides, lo, hi, idil, kdil], fn [s, kd, st, l, h, id, kdl] ->
        padded = (s - 1) * id + 1 + l + h
        span = (kd - 1) * kdl + 1
        div(padded - span, st) + 1
      end)

    xt = List.to_tuple(x)
    kt = List.to_tuple(k)
    nb = div(n, bg)

    values =
      for b <- 0..(nb - 1), oo <- 0..(o - 1), p <- cartesian(Enum.map(out_sp, &range/1)) do
        {batch, chan0} =
          if bg > 1,
            do: {div(oo, div(o, bg)) * nb + b, 0},
            else: {b, div(oo, div(o, fg)) * i}

        for ii <- 0..(i - 1), kp <- cartesian(Enum.map(kk, &range/1)), reduce: 0 do
          acc ->
            q =
              Enum.zip_with([p, kp, strides, kdil, lo], fn [pd, kd, st, kdl, l] ->
                pd * st + kd * kdl - l
              end)

            inside =
              Enum.zip_with([q, idil, sp], fn [qd, id, s] ->
                qd >= 0 and rem(qd, id) == 0 and div(qd, id) < s
              end)

            if Enum.all?(inside) do
              xi = flat([batch, chan0 + ii | Enum.zip_with(q, idil, &div/2)], xs)
              ki = flat([oo, ii | kp], ks)
              acc + elem(xt, xi) * elem(kt, ki)
            else
              acc
            end
        end
      end

    {values, List.to_tuple([nb, o | out_sp])}
  end

  defp range(0), do: []
  defp range(n), do: Enum.to_list(0..(n - 1))
  defp cartesian([]), do: [[]]
  defp cartesian([r | rest]), do: for(x <- r, tail <- cartesian(rest), do: [x | tail])

  defp flat(idx, shape) do
    Enum.zip(idx, Tuple.to_list(shape)) |> Enum.reduce(0, fn {i, d}, acc -> acc * d + i end)
  end

  # Transposes a flat row-major list: result axis j is input axis perm[j].
  defp transpose_flat(list, shape, perm) do
    dims = Tuple.to_list(shape)
    new_dims = Enum.map(perm, &Enum.at(dims, &1))
    tup = List.to_tuple(list)

    values =
      for idx <- cartesian(Enum.map(new_dims, &range/1)) do
        src = Enum.zip(perm, idx) |> Enum.sort() |> Enum.map(&elem(&1, 1))
        elem(tup, flat(src, shape))
      end

    {values, List.to_tuple(new_dims)}
  end

  defp seq(n, f \\ fn i -> rem(i * 7 + 2, 13) - 6 end), do: for(i <- 0..(n - 1), do: f.(i) * 1.0)

  defp conv(x, k, opts \\ []) do
    rank = tuple_size(Emily.shape(x))
    sp = rank - 2

    N.conv(
      s(),
      x,
      k,
      opts[:strides] || [],
      opts[:lo] || List.duplicate(0, sp),
      opts[:hi] || List.duplicate(0, sp),
      opts[:idil] || [],
      opts[:kdil] || [],
      opts[:fg] || 1,
      opts[:bg] || 1,
      opts[:iperm] || [],
      opts[:kperm] || [],
      opts[:operm] || []
    )
  end

  defp assert_alive, do: assert(l(N.add(s(), t([1.0]), t([2.0]))) == [3.0])

  # --- hand-computed cases -----------------------------------------------------------

  describe "conv (Nx layout), hand-computed" do
    setup do
      {:ok, x: t([1.0, 2.0, 3.0, 4.0, 5.0], {:f, 32}, {1, 1, 5})}
    end

    test "valid, padded and strided 1-D", %{x: x} do
      k = t([1.0, 0.0, -1.0], {:f, 32}, {1, 1, 3})
      y = conv(x, k)
      assert Emily.shape(y) == {1, 1, 3}
      assert l(y) == [-2.0, -2.0, -2.0]
      assert l(conv(x, k, lo: [1], hi: [1])) == [-2.0, -2.0, -2.0, -2.0, 4.0]
      assert l(conv(x, k, strides: [2])) == [-2.0, -2.0]
      assert l(conv(x, k, lo: [2], hi: [0], strides: [3])) == [-1.0, -2.0]
    end

    test "kernel and input dilation", %{x: x} do
      # kernel [1, -1] dilated by 2 spans 3: x[i] - x[i + 2]
      assert l(conv(x, t([1.0, -1.0], {:f, 32}, {1, 1, 2}), kdil: [2])) == [-2.0, -2.0, -2.0]
      # input dilated by 2: [1, 0, 2, 0, 3, 0, 4, 0, 5]
      y = conv(x, t([1.0, 1.0], {:f, 32}, {1, 1, 2}), idil: [2])
      assert l(y) == [1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0, 5.0]
    end

    test "negative padding crops, also with input dilation" do
      x = t(Enum.map(1..8, &(&1 * 1.0)), {:f, 32}, {1, 1, 8})
      k = t([1.0, 10.0], {:f, 32}, {1, 1, 2})
      # x dilated by 2, first element cropped: [0, 2, 0, 3, ..., 0, 8]
      y = conv(x, k, idil: [2], lo: [-1], hi: [0])
      assert l(y) == [20.0, 2.0, 30.0, 3.0, 40.0, 4.0, 50.0, 5.0, 60.0, 6.0, 70.0, 7.0, 80.0]
      # [4, 5, 6, 7, 8] with stride 2
      assert l(conv(x, k, lo: [-3], hi: [0], strides: [2])) == [54.0, 76.0]
      # cropping three of the dilated input and padding one at the end
      # [0, 3, 0, ..., 0, 8, 0] with stride 2 -> windows (0, 3), (0, 4), ..., (0, 8)
      y = conv(x, k, idil: [2], lo: [-3], hi: [1], strides: [2])
      assert l(y) == [30.0, 40.0, 50.0, 60.0, 70.0, 80.0]
    end

    test "2-D window sums" do
      x = t(Enum.map(1..9, &(&1 * 1.0)), {:f, 32}, {1, 1, 3, 3})
      y = conv(x, N.full(s(), {1, 1, 2, 2}, 1.0, {:f, 32}))
      assert Emily.shape(y) == {1, 1, 2, 2}
      assert l(y) == [12.0, 16.0, 24.0, 28.0]
    end

    test "feature groups" do
      # channel 0 [1, 2, 3] with [1, 1]; channel 1 [10, 20, 30] with [1, -1]
      x = t([1.0, 2.0, 3.0, 10.0, 20.0, 30.0], {:f, 32}, {1, 2, 3})
      k = t([1.0, 1.0, 1.0, -1.0], {:f, 32}, {2, 1, 2})
      assert l(conv(x, k, fg: 2)) == [3.0, 5.0, -10.0, -10.0]
    end

    test "batch groups" do
      # batch 0 [1, 2, 3] feeds output feature 0 ([1, 1]); batch 1 feeds feature 1 ([1, -1])
      x = t([1.0, 2.0, 3.0, 10.0, 20.0, 30.0], {:f, 32}, {2, 1, 3})
      k = t([1.0, 1.0, 1.0, -1.0], {:f, 32}, {2, 1, 2})
      y = conv(x, k, bg: 2)
      assert Emily.shape(y) == {1, 2, 2}
      assert l(y) == [3.0, 5.0, -10.0, -10.0]
    end

    test "permutations: channels-last input and output" do
      # [N, S, C] = [1, 3, 2]: channel 0 = [1, 2, 3], channel 1 = [10, 20, 30]
      x = t([1.0, 10.0, 2.0, 20.0, 3.0, 30.0], {:f, 32}, {1, 3, 2})
      # kernel [S, I, O] = [2, 2, 1]: taps [1, 1] on channel 0, [0, 1] on channel 1
      k = t([1.0, 0.0, 1.0, 1.0], {:f, 32}, {2, 2, 1})
      y = conv(x, k, iperm: [0, 2, 1], kperm: [2, 1, 0], operm: [0, 2, 1])
      assert Emily.shape(y) == {1, 2, 1}
      # x0[j] + x0[j+1] + x1[j+1]
      assert l(y) == [23.0, 35.0]
    end
  end

  # --- against the Elixir oracle ---------------------------------------------------------

  describe "conv (Nx layout) against the Elixir oracle" do
    test "strides, padding, dilations, groups in 1, 2 and 3 spatial dimensions" do
      cases = [
        {{2, 3, 7}, {4, 3, 3}, strides: [2], lo: [1], hi: [2], idil: [1], kdil: [2]},
        {{1, 2, 5}, {2, 2, 2}, idil: [3], lo: [-2], hi: [-1]},
        {{1, 4, 6}, {6, 2, 2}, fg: 2, idil: [2], lo: [-1], hi: [1], strides: [3]},
        {{4, 2, 5}, {6, 2, 3}, bg: 2, lo: [1], hi: [0]},
        {{2, 2, 5, 4}, {3, 2, 2, 3}, strides: [2, 1], lo: [1, 0], hi: [0, 2], kdil: [1, 2]},
        {{1, 2, 4, 4}, {4, 1, 2, 2}, fg: 2, idil: [2, 1], lo: [-1, 1], hi: [0, -1]},
        {{6, 1, 3, 3}, {3, 1, 2, 2}, bg: 3, strides: [1, 2]},
        {{1, 2, 4, 3, 3}, {2, 2, 2, 2, 2}, lo: [1, 0, 0], hi: [0, 1, 0], strides: [2, 1, 1]},
        {{1, 4, 3, 3, 3}, {4, 2, 2, 2, 2}, fg: 2, kdil: [1, 1, 2], idil: [1, 2, 1]}
      ]

      for {xs, ks, opts} <- cases do
        xv = seq(Tuple.product(xs))
        kv = seq(Tuple.product(ks), fn i -> rem(i * 5 + 1, 7) - 3 end)
        {expected, eshape} = ref_conv(xv, xs, kv, ks, opts)
        y = conv(t(xv, {:f, 32}, xs), t(kv, {:f, 32}, ks), opts)
        assert Emily.shape(y) == eshape, inspect({xs, ks, opts})
        assert l(y) == expected, inspect({xs, ks, opts})
      end
    end

    test "input, kernel and output permutations" do
      xs = {2, 3, 4, 5}
      ks = {4, 3, 2, 2}
      xv = seq(Tuple.product(xs))
      kv = seq(Tuple.product(ks), fn i -> rem(i, 5) - 2 end)
      opts = [strides: [1, 2], lo: [1, 0], hi: [0, 1]]
      {expected, eshape} = ref_conv(xv, xs, kv, ks, opts)

      # Store x as [H, N, W, C] and k as [W, H, I, O]; ask for the output as [N, H, W, O].
      # Nx's input_permutation p means: the conv reads transpose(x, p).
      x_layout = [2, 0, 3, 1]
      k_layout = [3, 2, 1, 0]
      {xp, xps} = transpose_flat(xv, xs, x_layout)
      {kp, kps} = transpose_flat(kv, ks, k_layout)
      iperm = inverse(x_layout)
      kperm = inverse(k_layout)
      operm = [0, 3, 1, 2]

      y =
        conv(
          t(xp, {:f, 32}, xps),
          t(kp, {:f, 32}, kps),
          opts ++ [iperm: iperm, kperm: kperm, operm: operm]
        )

      # Nx lays the result out so that transpose(result, operm) is [N, O, H, W]
      {want, wshape} = transpose_flat(expected, eshape, inverse(operm))
      assert Emily.shape(y) == wshape
      assert l(y) == want
    end

    test "f16, bf16 and f64" do
      with_cpu(fn ->
        xv = seq(12)
        kv = [1.0, -1.0, 0.5, 2.0]
        {expected, _} = ref_conv(xv, {1, 2, 6}, kv, {2, 1, 2}, fg: 2)

        for dt <- [{:f, 16}, {:bf, 16}, {:f, 64}] do
          y = conv(t(xv, dt, {1, 2, 6}), t(kv, dt, {2, 1, 2}), fg: 2)
          assert Emily.dtype(y) == dt
          assert l(y) == expected
        end
      end)
    end
  end

  defp inverse(perm), do: perm |> Enum.with_index() |> Enum.sort() |> Enum.map(&elem(&1, 1))

  describe "conv_general (MLX layout)" do
    test "matches the oracle on channels-last data, with flip and groups" do
      xs = {2, 4, 5, 4}
      ks = {6, 2, 3, 2}
      xv = seq(Tuple.product(xs))
      kv = seq(Tuple.product(ks), fn i -> rem(i * 3, 5) - 2 end)
      opts = [strides: [2, 1], lo: [1, -1], hi: [0, 1], idil: [1, 2], kdil: [2, 1], fg: 2]
      {expected, eshape} = ref_conv(xv, xs, kv, ks, opts)

      {xl, xls} = transpose_flat(xv, xs, [0, 2, 3, 1])
      {kl, kls} = transpose_flat(kv, ks, [0, 2, 3, 1])

      # Channels-last input and kernel; `flip` chooses correlation or convolution.
      conv = fn flip ->
        N.conv_general(
          s(),
          t(xl, {:f, 32}, xls),
          t(kl, {:f, 32}, kls),
          [2, 1],
          [1, -1],
          [0, 1],
          [2, 1],
          [1, 2],
          2,
          flip
        )
      end

      y = conv.(false)

      {want, wshape} = transpose_flat(expected, eshape, [0, 2, 3, 1])
      assert Emily.shape(y) == wshape
      assert l(y) == want

      # flip: a true convolution is a correlation with the spatially reversed kernel
      kr =
        for o <- 0..5,
            i <- 0..1,
            a <- 2..0//-1,
            b <- 1..0//-1,
            do: Enum.at(kv, flat([o, i, a, b], ks))

      {expected, _} = ref_conv(xv, xs, kr, ks, opts)
      {want, _} = transpose_flat(expected, eshape, [0, 2, 3, 1])

      y = conv.(true)

      assert l(y) == want
    end

    test "empty option lists mean MLX's defaults" do
      x = t([1.0, 2.0, 3.0], {:f, 32}, {1, 3, 1})
      k = t([1.0, 1.0], {:f, 32}, {1, 2, 1})
      assert l(N.conv_general(s(), x, k, [], [], [], [], [], 1, false)) == [3.0, 5.0]
    end
  end

  describe "errors" do
    test "bad dtypes, shapes, groups and permutations raise Emily.Error; the stream survives" do
      x = t(seq(6), {:f, 32}, {1, 2, 3})
      k = t([1.0, 1.0, 1.0, 1.0], {:f, 32}, {2, 1, 2})
      xi = t([1, 2, 3], {:s, 32}, {1, 1, 3})
      ki = t([1, 1], {:s, 32}, {1, 1, 2})

      cases = [
        {"floating point", fn -> conv(xi, ki) end},
        {"conv", fn -> conv(x, t([1.0, 1.0, 1.0], {:f, 32}, {1, 3, 1})) end},
        {"groups", fn -> conv(x, k, fg: 3) end},
        {"does not divide the batch", fn -> conv(x, k, bg: 2) end},
        {"cannot both", fn -> conv(x, k, fg: 2, bg: 2) end},
        {"input permutation", fn -> conv(x, k, iperm: [0, 0, 1]) end},
        {"output permutation", fn -> conv(x, k, fg: 2, operm: [0, 1]) end},
        {"has 2 entries for 1 spatial", fn -> conv(x, k, fg: 2, strides: [1, 1]) end},
        {"same rank", fn -> conv(x, t([1.0], {:f, 32}, {1, 1})) end},
        {"spatial dimensions",
         fn ->
           conv(t([1.0], {:f, 32}, {1, 1, 1, 1, 1, 1}), t([1.0], {:f, 32}, {1, 1, 1, 1, 1, 1}))
         end},
        {"rank >= 3",
         fn -> N.conv_general(s(), t([1.0]), t([1.0]), [], [], [], [], [], 1, false) end}
      ]

      for {pattern, fun} <- cases do
        e = assert_raise Emily.Error, fn -> l(fun.()) end
        assert e.message =~ "conv", e.message
        assert e.message =~ pattern, e.message
        assert_alive()
      end
    end

    test "bad Elixir arguments raise ArgumentError" do
      x = t(seq(3), {:f, 32}, {1, 1, 3})

      assert_raise ArgumentError, fn ->
        N.conv_general(s(), x, x, [1.5], [], [], [], [], 1, false)
      end

      assert_raise ArgumentError, fn ->
        N.conv(s(), x, x, [], [0], [0], [], [], :two, 1, [], [], [])
      end
    end
  end
end
