defmodule Emily.Native.KernelsTest do
  use Emily.TestCase, async: true

  # On an x86-64 CPU with AVX2 and FMA, f32 exp, erf, sigmoid, gelu_erf, silu and softmax
  # (and bf16 silu) on a CPU stream run Emily's vector kernels (cpp/kernels.cc), which
  # compute MLX's own formulas eight lanes at a time and the last `rem(n, 8)` elements
  # through MLX's scalar code. So a value's result must be the same bits whether it falls in a lane or in
  # that tail, and gelu_erf's those of the five MLX ops it stands for. The norms
  # (cpp/norm.cc) must give the bits of MLX's composition of them.

  # f32 bit patterns: a sweep of [-100, 100], the ranges' edges and IEEE's special values,
  # and the floats around x = ln(2) / 2, where `x * log2(e)` comes within an ulp of one
  # half (MLX rounds `floor(y + 0.5)` in double there).
  defp inputs do
    sweep = for i <- 0..4000, do: f32_bits(-100 + i * 0.05 + :math.sin(i) * 0.01)

    edges =
      Enum.map(
        [0.0, 88.0, 88.00001, -88.0, -88.00001, 87.99, -87.99, 1.0e30, -1.0e30, 1.0e-40, 0.5],
        &f32_bits/1
      )

    specials = [0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x80000001]
    half = f32_bits(:math.log(2) / 2)
    around = for d <- -300..300, do: half + d

    sweep ++ edges ++ specials ++ around
  end

  defp f32_bits(x) do
    <<bits::unsigned-32>> = <<x::float-32>>
    bits
  end

  defp tensor(bits) do
    bin = for b <- bits, into: <<>>, do: <<b::unsigned-32-little>>
    Emily.from_binary(bin, {length(bits)}, {:f, 32}, stream: cpu())
  end

  defp words(t), do: for(<<w::unsigned-32-little <- Emily.to_binary(t)>>, do: w)

  # A result as its bit patterns, NaNs as one (MLX propagates the input's payload).
  defp canonical(words) do
    for w <- words do
      nan? = Bitwise.band(w, 0x7F800000) == 0x7F800000 and Bitwise.band(w, 0x007FFFFF) != 0
      if nan?, do: :nan, else: w
    end
  end

  for {name, fun} <- [exp: :exp, erf: :erf, sigmoid: :sigmoid] do
    test "#{name}: the vector lanes give MLX's scalar results, bit for bit" do
      bits = inputs()
      lanes = canonical(words(apply(N, unquote(fun), [cpu(), tensor(bits)])))

      # Chunks of 7 never fill a lane: each is computed by MLX's scalar code.
      scalar =
        bits
        |> Enum.chunk_every(7)
        |> Enum.flat_map(&words(apply(N, unquote(fun), [cpu(), tensor(&1)])))
        |> canonical()

      mismatches =
        for {{a, b}, i} <- Enum.with_index(Enum.zip(lanes, scalar)), a != b, do: {i, a, b}

      assert mismatches == [], "first differences: #{inspect(Enum.take(mismatches, 5))}"
      assert length(lanes) == length(bits)
    end
  end

  defp scalar(v, type), do: Emily.from_list([v], type, shape: {}, stream: cpu())

  # Axon's gelu as its five ops.
  defp gelu_ops(x, c, type) do
    q = N.erf(cpu(), N.divide(cpu(), x, scalar(c, type)))
    N.divide(cpu(), N.multiply(cpu(), N.add(cpu(), q, scalar(1.0, type)), x), scalar(2.0, type))
  end

  test "gelu_erf: its five ops' values, bit for bit, in f32 (the kernel) and bf16" do
    c = :math.sqrt(2)
    x = tensor(inputs())
    assert canonical(words(N.gelu_erf(cpu(), x, c))) == canonical(words(gelu_ops(x, c, {:f, 32})))

    xb = N.astype(cpu(), N.slice(cpu(), x, [0], [4001], [1]), {:bf, 16})

    assert Emily.to_binary(N.gelu_erf(cpu(), xb, c)) ==
             Emily.to_binary(gelu_ops(xb, c, {:bf, 16}))
  end

  # Axon's silu, and a gated unit's `by * silu(x)`, as their ops.
  defp silu_ops(x, by) do
    t = N.multiply(cpu(), N.sigmoid(cpu(), x), x)
    if by, do: N.multiply(cpu(), by, t), else: t
  end

  test "silu: its ops' values, bit for bit, plain and gated, in f32 and bf16" do
    bits = inputs()
    x = tensor(bits)
    by = tensor(Enum.reverse(bits))

    for factor <- [nil, by] do
      assert canonical(words(N.silu(cpu(), x, factor))) == canonical(words(silu_ops(x, factor)))
    end

    # bf16 (on x86-64, the kernel too): the sweep, edges and special values rounded.
    {xb, byb} = {N.astype(cpu(), x, {:bf, 16}), N.astype(cpu(), by, {:bf, 16})}

    for factor <- [nil, byb] do
      assert Emily.to_binary(N.silu(cpu(), xb, factor)) == Emily.to_binary(silu_ops(xb, factor))
    end
  end

  test "silu: a factor of another shape or type is refused, and the worker goes on" do
    x = Emily.from_list([1.0, 2.0, 3.0], {:f, 32}, stream: cpu())
    short = Emily.from_list([1.0, 2.0], {:f, 32}, stream: cpu())
    other = N.astype(cpu(), x, {:bf, 16})

    for by <- [short, other] do
      assert_raise Emily.Error, ~r/silu.*the factor must have x's shape and type/, fn ->
        Emily.to_binary(N.silu(cpu(), x, by))
      end
    end

    assert Emily.to_list(N.silu(cpu(), x, nil)) == Emily.to_list(silu_ops(x, nil))
  end

  # On a GPU, silu is MLX's compiled form of its ops: one fused kernel of the same
  # per-element functions, so the same values as the ops run one by one there.
  @tag :gpu
  test "silu on a GPU: its ops' values, plain and gated, in f32, bf16 and f16" do
    gpu = Emily.Stream.default(:gpu)
    bits = Enum.take(inputs(), 4001)

    on = fn t, type ->
      t
      |> Emily.to_binary()
      |> Emily.from_binary({4001}, {:f, 32}, stream: gpu)
      |> then(&N.astype(gpu, &1, type))
    end

    ops = fn x, by ->
      t = N.multiply(gpu, N.sigmoid(gpu, x), x)
      if by, do: N.multiply(gpu, by, t), else: t
    end

    for type <- [{:f, 32}, {:bf, 16}, {:f, 16}] do
      x = on.(tensor(bits), type)
      by = on.(tensor(Enum.reverse(bits)), type)

      for factor <- [nil, by] do
        assert Emily.to_binary(N.silu(gpu, x, factor)) == Emily.to_binary(ops.(x, factor)),
               "#{inspect(type)}, gated: #{factor != nil}"
      end
    end
  end

  # gelu_erf on a GPU likewise: MLX's compiled form of its five ops, the divisor an
  # input of the compiled function (two divisors through one trace).
  @tag :gpu
  test "gelu_erf on a GPU: its five ops' values, in f32, bf16 and f16, for two divisors" do
    gpu = Emily.Stream.default(:gpu)
    bits = Enum.take(inputs(), 4001)

    ops = fn x, c, type ->
      q = N.erf(gpu, N.divide(gpu, x, Emily.from_list([c], type, shape: {}, stream: gpu)))
      one = Emily.from_list([1.0], type, shape: {}, stream: gpu)
      two = Emily.from_list([2.0], type, shape: {}, stream: gpu)
      N.divide(gpu, N.multiply(gpu, N.add(gpu, q, one), x), two)
    end

    for type <- [{:f, 32}, {:bf, 16}, {:f, 16}], c <- [:math.sqrt(2), 1.5] do
      x =
        tensor(bits)
        |> Emily.to_binary()
        |> Emily.from_binary({4001}, {:f, 32}, stream: gpu)
        |> then(&N.astype(gpu, &1, type))

      assert Emily.to_binary(N.gelu_erf(gpu, x, c)) == Emily.to_binary(ops.(x, c, type)),
             "#{inspect(type)}, c = #{c}"
    end
  end

  test "strided and broadcast inputs give the values of their dense copies" do
    x = N.reshape(cpu(), tensor(Enum.take(inputs(), 120)), {10, 12})
    transposed = N.transpose(cpu(), x, [1, 0])
    dense = tensor(words(transposed)) |> then(&N.reshape(cpu(), &1, {12, 10}))
    row = N.slice(cpu(), x, [3, 0], [4, 12], [1, 1])
    broadcast = N.broadcast_to(cpu(), row, {5, 12})

    for fun <- [:exp, :erf, :sigmoid, :gelu_erf, :silu] do
      args = %{gelu_erf: [1.5], silu: [nil]} |> Map.get(fun, [])

      assert canonical(words(apply(N, fun, [cpu(), transposed] ++ args))) ==
               canonical(words(apply(N, fun, [cpu(), dense] ++ args)))

      one = canonical(words(apply(N, fun, [cpu(), row] ++ args)))

      assert canonical(words(apply(N, fun, [cpu(), broadcast] ++ args))) ==
               List.flatten(List.duplicate(one, 5))
    end
  end

  # MLX's softmax of one row: its maximum, exp of each difference, their sum in order in
  # f32, the sum's reciprocal, each exp times it. The exps are Emily's (bit-exact, above);
  # f64 arithmetic rounded to f32 is f32 arithmetic for one addition, product or quotient.
  defp softmax_oracle(row_bits) do
    row = Emily.to_list(tensor(row_bits))
    max = Enum.max(row)
    diffs = Enum.map(row, &f32(&1 - max))
    exps = Emily.to_list(N.exp(cpu(), Emily.from_list(diffs, {:f, 32}, stream: cpu())))
    sum = Enum.reduce(exps, 0.0, &f32(&2 + &1))
    norm = f32(1 / sum)
    Enum.map(exps, &f32(&1 * norm))
  end

  defp f32(x) do
    <<y::float-32>> = <<x::float-32>>
    y
  end

  test "softmax over the last axis: MLX's order of operations, to the bit" do
    # Rows of 37: four full lanes of the max and the exps, and a tail of 5.
    bits = Enum.take(inputs(), 3 * 37)
    x = N.reshape(cpu(), tensor(bits), {3, 37})
    out = Emily.to_list(N.softmax(cpu(), x, [1], true))
    expect = bits |> Enum.chunk_every(37) |> Enum.flat_map(&softmax_oracle/1)
    assert out == expect

    # A transposed input is made row-contiguous first; the other axis is MLX's softmax.
    xt = N.transpose(cpu(), N.reshape(cpu(), tensor(bits), {37, 3}), [1, 0])
    dense = Emily.from_list(Emily.to_list(xt), {:f, 32}, shape: {3, 37}, stream: cpu())
    assert l(N.softmax(cpu(), xt, [-1], false)) == l(N.softmax(cpu(), dense, [-1], false))
    assert_close([Enum.sum(l(N.softmax(cpu(), xt, [0], true)))], [37.0])
  end

  test "softmax rows with NaN or all -inf are NaN, as MLX's" do
    nan = 0x7FC00000
    ninf = 0xFF800000
    row = Enum.take(inputs(), 9)
    x = N.reshape(cpu(), tensor([nan | tl(row)] ++ List.duplicate(ninf, 9)), {2, 9})
    assert l(N.softmax(cpu(), x, [1], true)) == List.duplicate(:nan, 18)
  end

  # A pass over at least 64K elements is split over the pool's threads, in ranges whose
  # lengths are multiples of the lanes: each element gets the bits of one pass over it.
  test "passes split over the threads give the bits of small unsplit passes" do
    bits = inputs()
    reps = div(200_000, length(bits)) + 1
    big = tensor(List.flatten(List.duplicate(bits, reps)) ++ Enum.take(bits, 3))

    for {fun, args} <- [exp: [], erf: [], sigmoid: [], gelu_erf: [1.5], silu: [nil]] do
      one = canonical(words(apply(N, fun, [cpu(), tensor(bits)] ++ args)))
      whole = canonical(words(apply(N, fun, [cpu(), big] ++ args)))
      assert whole == List.flatten(List.duplicate(one, reps)) ++ Enum.take(one, 3), "#{fun}"
    end

    rows = N.reshape(cpu(), N.slice(cpu(), big, [0], [4096 * 37], [1]), {4096, 37})
    split = canonical(words(N.softmax(cpu(), rows, [1], true)))

    each =
      canonical(words(N.softmax(cpu(), N.slice(cpu(), rows, [0, 0], [8, 37], [1, 1]), [1], true)))

    assert Enum.take(split, 8 * 37) == each
  end

  # MLX's layer and RMS norms on a CPU stream, as mlx/fast.cpp composes them.
  defp norm_ops(x, w, b, eps, center?) do
    m = elem(Emily.shape(x), tuple_size(Emily.shape(x)) - 1)
    axis = tuple_size(Emily.shape(x)) - 1
    mean = &N.multiply(cpu(), N.sum(cpu(), &1, [axis], true), scalar(1 / m, {:f, 32}))
    xc = if center?, do: N.subtract(cpu(), x, mean.(x)), else: x
    var = mean.(N.square(cpu(), xc))
    y = N.multiply(cpu(), xc, N.rsqrt(cpu(), N.add(cpu(), var, scalar(eps, {:f, 32}))))
    y = if w, do: N.multiply(cpu(), y, w), else: y
    if b, do: N.add(cpu(), y, b), else: y
  end

  defp normal(shape, seed) do
    N.normal(cpu(), N.key(cpu(), seed), 3.0, 2.0, shape, {:f, 32})
  end

  test "layer_norm and rms_norm: MLX's composition, to the bit" do
    # 29 rows: three groups of eight in the lanes, five one at a time; rows of 773
    # (96 lanes and a tail of 5) and of 3; a row of 70_000 is split over the threads.
    for {shape, seed} <- [{{29, 773}, 1}, {{2, 3, 3}, 2}, {{1, 70_000}, 3}, {{300, 256}, 4}] do
      x = normal(shape, seed)
      m = elem(shape, tuple_size(shape) - 1)
      w = normal({m}, seed + 10)
      b = normal({m}, seed + 20)

      for {wt, bt} <- [{nil, nil}, {w, nil}, {nil, b}, {w, b}], eps <- [1.0e-5, 0.5] do
        label = "#{inspect(shape)} weight: #{wt != nil} bias: #{bt != nil} eps: #{eps}"

        assert words(N.layer_norm(cpu(), x, wt, bt, eps)) ==
                 words(norm_ops(x, wt, bt, eps, true)),
               "layer_norm " <> label

        if bt == nil do
          assert words(N.rms_norm(cpu(), x, wt, eps)) == words(norm_ops(x, wt, nil, eps, false)),
                 "rms_norm " <> label
        end
      end
    end
  end

  test "layer_norm and rms_norm: strided input, non-finite values, bf16 and bad operands" do
    x = normal({16, 24}, 5)
    w = normal({16}, 6)
    xt = N.transpose(cpu(), x, [1, 0])
    assert words(N.layer_norm(cpu(), xt, w, w, 1.0e-5)) == words(norm_ops(xt, w, w, 1.0e-5, true))
    assert words(N.rms_norm(cpu(), xt, w, 1.0e-5)) == words(norm_ops(xt, w, nil, 1.0e-5, false))

    special = tensor([0x7FC00000, 0x7F800000, 0xFF800000] ++ Enum.take(inputs(), 13))
    special = N.reshape(cpu(), N.concatenate(cpu(), [special, special], 0), {2, 16})

    assert canonical(words(N.layer_norm(cpu(), special, nil, nil, 0.0))) ==
             canonical(words(norm_ops(special, nil, nil, 0.0, true)))

    # bf16 is MLX's own call (its composition widens to f32 and rounds once).
    xb = N.astype(cpu(), x, {:bf, 16})
    assert Emily.dtype(N.layer_norm(cpu(), xb, nil, nil, 1.0e-5)) == {:bf, 16}

    assert_raise Emily.Error, ~r/layer_norm.*weight must have the same size/, fn ->
      Emily.to_binary(N.layer_norm(cpu(), x, normal({5}, 7), nil, 1.0e-5))
    end

    assert_raise Emily.Error, ~r/rms_norm.*must have 1 dimension/, fn ->
      Emily.to_binary(N.rms_norm(cpu(), x, x, 1.0e-5))
    end

    assert words(N.rms_norm(cpu(), x, nil, 1.0e-5)) == words(norm_ops(x, nil, nil, 1.0e-5, false))
  end
end
