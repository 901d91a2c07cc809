# Time per call (op + eval) of one op per family owned by the indexing, shape, window and
# sub-byte ops, on the default device. bench/native_index.py times the same MLX work from
# Python on the same libmlx.
#
#     mix run --no-deps-check bench/native_index.exs
#
# On a CPU with few cores, the BEAM's scheduler busy-waiting competes with MLX's stream
# thread; for figures that measure MLX rather than that contention, run with
#
#     ELIXIR_ERL_OPTIONS="+sbwt none +sbwtdcpu none +sbwtdio none" mix run ...
alias Emily.Native, as: N

defmodule Bench.NativeIndex do
  @moduledoc false

  # Median and best over `rounds` batches of the time per call, in microseconds. Each call is
  # followed by a garbage collection so that its output is freed at once, as Python's
  # reference counting frees it; MLX then reuses the buffer instead of faulting in a new one.
  def time(fun, iters, rounds \\ 7) do
    for _ <- 1..3, do: fun.()

    samples =
      for _ <- 1..rounds do
        {us, _} =
          :timer.tc(fn ->
            for _ <- 1..iters do
              fun.()
              :erlang.garbage_collect()
            end
          end)

        us / iters
      end

    samples = Enum.sort(samples)
    {Enum.at(samples, div(rounds, 2)), hd(samples)}
  end

  def report(name, shapes, {median, best}) do
    IO.puts(
      String.pad_trailing(name, 16) <>
        String.pad_trailing(shapes, 44) <>
        String.pad_leading(:erlang.float_to_binary(median, decimals: 1), 10) <>
        " us  (best batch #{:erlang.float_to_binary(best, decimals: 1)})"
    )
  end

  # A tensor of `shape` filled by the xorshift-free recipe `i * 7919 mod m`, evaluated.
  def tensor(shape, dtype, m) do
    n = Tuple.product(shape)
    t = Emily.from_list(Enum.map(0..(n - 1), &rem(&1 * 7919, m)), dtype, shape: shape)
    Emily.eval(t)
    t
  end
end

s = Emily.Stream.current()
IO.puts("Emily #{Emily.mlx_version()} on #{Emily.Stream.device(s)}, time per call (op + eval)")

# Indexing: take 4096 rows of an 8192x512 f32 table.
table = Bench.NativeIndex.tensor({8192, 512}, {:f, 32}, 1000)
rows = Bench.NativeIndex.tensor({4096}, {:s, 32}, 8192)
us = Bench.NativeIndex.time(fn -> Emily.eval(N.take(s, table, rows, 0)) end, 50)
Bench.NativeIndex.report("take", "f32[8192x512], s32[4096], axis 0", us)

# Indexing: scatter_add 4096 rows back (the gradient of take).
upd = Bench.NativeIndex.tensor({4096, 512}, {:f, 32}, 1000)
idx2 = N.reshape(s, rows, {4096, 1})
Emily.eval(idx2)
us = Bench.NativeIndex.time(fn -> Emily.eval(N.scatter_add(s, table, idx2, upd, [0])) end, 20)
Bench.NativeIndex.report("scatter_add", "f32[8192x512] += f32[4096x512] at rows", us)

# Shape: pad a 1024x1024 f32 by 1 on every side.
img = Bench.NativeIndex.tensor({1024, 1024}, {:f, 32}, 1000)
zero = Bench.NativeIndex.tensor({}, {:f, 32}, 1)
us = Bench.NativeIndex.time(fn -> Emily.eval(N.pad(s, img, zero, [1, 1], [1, 1], [0, 0])) end, 50)
Bench.NativeIndex.report("pad", "f32[1024x1024], lo/hi 1", us)

# Window: 3x3 max pool, stride 2, padding 1, NHWC.
x = Bench.NativeIndex.tensor({8, 64, 64, 32}, {:f, 32}, 1000)

us =
  Bench.NativeIndex.time(
    fn ->
      Emily.eval(N.window_max(s, x, [1, 3, 3, 1], [1, 2, 2, 1], [0, 1, 1, 0], [0, 1, 1, 0], []))
    end,
    20
  )

Bench.NativeIndex.report("window_max", "f32[8x64x64x32], 3x3 stride 2 pad 1", us)

# Types: unpack 2M signed 4-bit values from 1 MiB.
packed = Bench.NativeIndex.tensor({1_048_576}, {:u, 8}, 256)

us =
  Bench.NativeIndex.time(
    fn -> Emily.eval(N.unpack_bits(s, packed, 4, true, 2_097_152)) end,
    50
  )

Bench.NativeIndex.report("unpack_bits", "u8[1048576] -> s8[2097152] (s4)", us)
