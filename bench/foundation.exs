# Foundation figures: Emily beside Python MLX on the same libmlx, and numpy, in one run.
#
#     mix run --no-deps-check bench/foundation.exs [matmul_size]
#
# Runs Emily's side here, then bench/foundation.py with PYTHONPATH=$EMILY_CACHE/current
# (the tree scripts/setup installed: Python MLX over the very libmlx Emily links), and
# prints each figure beside its reference as a ratio.
alias Emily.Native, as: N

size = String.to_integer(List.first(System.argv()) || "2048")

Code.require_file("support/bench.exs", __DIR__)

s = Emily.Stream.default(:cpu)
x = N.full(s, {}, 0.0, {:f, 32})
one = N.full(s, {}, 1.0, {:f, 32})
Emily.eval([x, one])

chain = fn ->
  y = Enum.reduce(1..100, x, fn _, acc -> N.add(s, acc, one) end)
  Emily.eval(y)
end

lazy = fn -> Enum.each(1..100, fn _ -> N.add(s, x, one) end) end
small = fn -> Emily.to_binary(N.add(s, x, one)) end

a = N.full(s, {size, size}, 1.0, {:f, 32})
b = N.full(s, {size, size}, 1.0, {:f, 32})
Emily.eval([a, b])
matmul = fn -> Emily.eval(N.matmul(s, a, b)) end

emily = %{
  "chain_add_per_op" => Bench.best(chain, 50) / 100,
  "lazy_node" => Bench.best(lazy, 50) / 100,
  "small_op_eval_read" => Bench.best(small, 500),
  "matmul_f32" => Bench.best(matmul, 3, 3)
}

py = Bench.python(Path.join(__DIR__, "foundation.py"), [to_string(size)])

gflops = fn us -> 2 * size ** 3 / us / 1000 end
fmt = fn x -> :erlang.float_to_binary(x * 1.0, decimals: 2) end

IO.puts("""
| figure | Emily | reference | ratio (Emily / reference) |
|---|---|---|---|
| 100 chained adds + one eval, per op | #{fmt.(emily["chain_add_per_op"])} us | Python MLX #{fmt.(py["chain_add_per_op"])} us | #{fmt.(emily["chain_add_per_op"] / py["chain_add_per_op"])} |
| lazy op node (x + 1, no eval) | #{fmt.(emily["lazy_node"])} us | Python MLX #{fmt.(py["lazy_node"])} us | #{fmt.(emily["lazy_node"] / py["lazy_node"])} |
| one add + eval + read back | #{fmt.(emily["small_op_eval_read"])} us | Python MLX #{fmt.(py["small_op_eval_read"])} us | #{fmt.(emily["small_op_eval_read"] / py["small_op_eval_read"])} |
| f32 matmul #{size}^3 | #{fmt.(gflops.(emily["matmul_f32"]))} GFLOP/s | numpy #{fmt.(gflops.(py["numpy_matmul_f32"]))} GFLOP/s; Python MLX (wheel BLAS) #{fmt.(gflops.(py["matmul_f32"]))} GFLOP/s | #{fmt.(py["numpy_matmul_f32"] / emily["matmul_f32"])} (vs numpy) |
""")
