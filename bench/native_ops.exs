# Time per call of one op per numeric family (unary, binary, reduce, scan, sort) on the
# CPU, each call building the op and evaluating it (Emily.eval waits for the result).
# bench/native_ops.py times the same ops and shapes with Python MLX on the same libmlx.
#
#     mix run --no-deps-check bench/native_ops.exs
#
# Prints one line per op and shape: the median and mean time per call in microseconds.
#
# After each timed call the process is garbage-collected (untimed), which drops the
# output tensor at once, as Python's reference counting does: MLX then reuses its
# buffer. Without it, outputs of large calls wait for the next GC, MLX allocates fresh
# memory for each call, and a 4 MiB elementwise op pays ~1-2 ms in page faults. Pass
# `--no-gc` to measure that case.
alias Emily.Native, as: N

defmodule Bench do
  @min_seconds 1.0
  @max_calls 20_000

  # Median and mean microseconds per call of `fun`, after a warm-up.
  def time(fun, gc?) do
    for _ <- 1..10, do: fun.()

    deadline =
      System.monotonic_time() +
        System.convert_time_unit(round(@min_seconds * 1000), :millisecond, :native)

    samples = loop(fun, gc?, deadline, [], 0)
    sorted = Enum.sort(samples)
    median = Enum.at(sorted, div(length(sorted), 2))
    mean = Enum.sum(samples) / length(samples)
    {median, mean, length(samples)}
  end

  defp loop(fun, gc?, deadline, acc, n) do
    t0 = System.monotonic_time()
    fun.()
    dt = System.convert_time_unit(System.monotonic_time() - t0, :native, :nanosecond) / 1000
    if gc?, do: :erlang.garbage_collect()

    if n + 1 >= @max_calls or System.monotonic_time() > deadline,
      do: [dt | acc],
      else: loop(fun, gc?, deadline, [dt | acc], n + 1)
  end

  # Uniform floats in [-1, 1) from a fixed seed, as a float32 tensor.
  def random(shape, stream) do
    :rand.seed(:exsss, {1, 2, 3})
    n = Tuple.product(shape)
    bin = for _ <- 1..n, into: <<>>, do: <<:rand.uniform() * 2 - 1::float-32-native>>
    Emily.from_binary(bin, shape, {:f, 32}, stream: stream)
  end
end

gc? = "--no-gc" not in System.argv()
s = Emily.Stream.default(:cpu)

ops = [
  {"exp", fn x, _y -> N.exp(s, x) end},
  {"add", fn x, y -> N.add(s, x, y) end},
  {"sum(axis=1)", fn x, _y -> N.sum(s, x, [1], false) end},
  {"cumsum(axis=1)", fn x, _y -> N.cumsum(s, x, 1, false, true) end},
  {"argsort(axis=1)", fn x, _y -> N.argsort(s, x, 1, false) end}
]

IO.puts(
  "Emily #{Application.spec(:emily, :vsn)} on MLX #{Emily.mlx_version()}, CPU stream" <>
    if(gc?, do: "", else: " (no GC between calls)")
)

IO.puts(
  String.pad_trailing("op", 18) <>
    String.pad_trailing("shape", 12) <> "median us   mean us   calls"
)

for shape <- [{16, 64}, {1024, 1024}] do
  x = Bench.random(shape, s)
  y = N.multiply(s, x, x)
  Emily.eval([x, y])

  for {name, fun} <- ops do
    {median, mean, calls} = Bench.time(fn -> Emily.eval(fun.(x, y)) end, gc?)

    IO.puts(
      String.pad_trailing(name, 18) <>
        String.pad_trailing("#{elem(shape, 0)}x#{elem(shape, 1)}", 12) <>
        String.pad_leading(:erlang.float_to_binary(median, decimals: 1), 9) <>
        String.pad_leading(:erlang.float_to_binary(mean, decimals: 1), 10) <>
        String.pad_leading(Integer.to_string(calls), 8)
    )
  end
end
