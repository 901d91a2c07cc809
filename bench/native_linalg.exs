# Products, linear algebra, FFT, random, fast kernels and quantization: Emily beside
# Python MLX on the same libmlx, one op per family (two for products and linalg).
#
#     mix run --no-deps-check bench/native_linalg.exs [repeats]
#
# On a shared machine, `repeats` > 1 alternates the Emily and Python passes that many
# times and keeps each op's best time, so that load spikes hit both sides alike.
#
# Times are the best mean per call (graph built on the CPU stream, evaluated, no read
# back). Python MLX runs bench/native_linalg.py with PYTHONPATH=$EMILY_CACHE/current,
# twice: as the wheel ships it (reference BLAS/LAPACK) and with OpenBLAS preloaded, which
# is what Emily links ahead of libmlx. The last column compares with the latter.
alias Emily.Native, as: N

repeats = String.to_integer(List.first(System.argv()) || "1")

Code.require_file("support/bench.exs", __DIR__)

s = Emily.Stream.default(:cpu)

# The same deterministic data as the Python side: sin(0.37 i), reshaped.
arr = fn shape ->
  n = Tuple.product(shape)

  N.reshape(
    s,
    N.sin(s, N.multiply(s, N.arange(s, 0, n, 1, {:f, 32}), N.full(s, {}, 0.37, {:f, 32}))),
    shape
  )
end

a = arr.({512, 512})
b = arr.({512, 512})
ai = N.astype(s, N.multiply(s, arr.({256, 256}), N.full(s, {}, 10.0, {:f, 32})), {:s, 32})
bi = N.astype(s, N.multiply(s, arr.({256, 256}), N.full(s, {}, 10.0, {:f, 32})), {:s, 32})
x = arr.({8, 32, 32, 32})
w = arr.({64, 3, 3, 32})
# Nx layouts of the same convolution, for N.conv
x_nx = N.transpose(s, x, [0, 3, 1, 2])
w_nx = N.transpose(s, w, [0, 3, 1, 2])
m = arr.({256, 256})

spd =
  N.add(
    s,
    N.matmul(s, m, N.transpose(s, m, [1, 0])),
    N.multiply(s, N.eye(s, 256, 256, 0, {:f, 32}), N.full(s, {}, 256.0, {:f, 32}))
  )

f = arr.({64, 4096})
q = arr.({1, 8, 256, 64})
kv = arr.({1, 8, 256, 64})
wq = N.quantize(s, arr.({2048, 2048}), 64, 4)
xq = arr.({8, 2048})
key = N.key(s, 0)
Emily.eval([a, b, ai, bi, x, w, x_nx, w_nx, spd, f, q, kv, xq, key | wq])
[wqw, wqs, wqb] = wq

run = fn op -> fn -> Emily.eval(List.wrap(op.())) end end

ops = [
  {"dot_f32_512", "dot f32 512^3 (N.dot)", fn -> N.dot(s, a, [1], [], b, [0], []) end, 5},
  {"dot_s32_256", "dot s32 256^3 (multiply + sum)", fn -> N.dot(s, ai, [1], [], bi, [0], []) end,
   3},
  {"conv2d_3x3_8x32x32x32_64", "conv_general 3x3, 8x32x32x32 -> 64",
   fn -> N.conv_general(s, x, w, [], [1, 1], [1, 1], [], [], 1, false) end, 3},
  {"qr_256", "qr 256", fn -> N.qr(s, spd) end, 5},
  {"eigh_256", "eigh 256", fn -> N.eigh(s, spd, "L") end, 3},
  {"rfft_64x4096", "rfft 64 x 4096", fn -> N.rfft(s, f, 4096, -1) end, 10},
  {"normal_1m", "random normal 2^20 f32", fn -> N.normal(s, key, 0, 1, {1_048_576}, {:f, 32}) end,
   10},
  {"sdpa_causal_8x256x64", "sdpa causal 8 heads, L 256, D 64",
   fn -> N.scaled_dot_product_attention(s, q, kv, kv, 0.125, "causal", nil, nil) end, 5},
  {"quantized_matmul_4bit_8x2048x2048", "quantized_matmul 4-bit g64, 8 x 2048 x 2048",
   fn -> N.quantized_matmul(s, xq, wqw, wqs, wqb, true, 64, 4, "affine") end, 5}
]

emily_pass = fn ->
  times = for {name, _, op, reps} <- ops, into: %{}, do: {name, Bench.best(run.(op), reps)}

  # Nx-layout conv (transposes in and out around conv_general): no Python counterpart.
  nx_conv =
    Bench.best(
      run.(fn -> N.conv(s, x_nx, w_nx, [], [1, 1], [1, 1], [], [], 1, 1, [], [], []) end),
      3
    )

  Map.put(times, "nx_conv", nx_conv)
end

python = fn env -> Bench.python(Path.join(__DIR__, "native_linalg.py"), [], env) end

min_merge = fn maps -> Enum.reduce(maps, &Map.merge(&1, &2, fn _, a, b -> min(a, b) end)) end

passes =
  for _ <- 1..repeats do
    {emily_pass.(), python.([]), python.([{"LD_PRELOAD", "libopenblas.so.0"}])}
  end

emily = min_merge.(Enum.map(passes, &elem(&1, 0)))
stock = min_merge.(Enum.map(passes, &elem(&1, 1)))
openblas = min_merge.(Enum.map(passes, &elem(&1, 2)))
nx_conv = emily["nx_conv"]

fmt = fn us -> :erlang.float_to_binary(us * 1.0, decimals: 1) end

rows =
  for {name, label, _, _} <- ops do
    e = emily[name]

    "| #{label} | #{fmt.(e)} | #{fmt.(openblas[name])} | #{fmt.(stock[name])} | " <>
      :erlang.float_to_binary(e / openblas[name], decimals: 2) <> " |"
  end

IO.puts("""
| op (CPU stream) | Emily us | Python MLX + OpenBLAS us | Python MLX stock us | Emily / Python (OpenBLAS) |
|---|---|---|---|---|
#{Enum.join(rows, "\n")}
| conv (Nx layout, transposes in and out), same conv | #{fmt.(nx_conv)} | | | |
""")
