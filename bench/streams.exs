# Throughput of N concurrent processes on 1, 2 and 4 CPU streams.
#
#     OPENBLAS_NUM_THREADS=1 MIX_ENV=test mix run --no-deps-check bench/streams.exs
#
# Workload: an MLP forward pass (x[32x256] @ W1[256x1024] + b1, relu, @ W2[1024x256] +
# b2, softmax; 34 MFLOP), then the result read back with to_binary (32 KiB). The weights
# are made on their own stream and evaluated once, then read by every stream (the shared-
# weights pattern). 8 processes run forward passes for a fixed time, spread round-robin
# over the streams; each forward runs either op by op (8 NIF calls) or as one Program.
#
# MLX's CPU kernels are single-threaded and BLAS parallelism is set by OpenBLAS:
# OPENBLAS_NUM_THREADS=1 makes each stream use one core, which is what streams are for
# (with more BLAS threads a single stream already takes every core).
#
# Each configuration runs BENCH_SECONDS at a time, interleaved with the others, for
# BENCH_ROUNDS rounds; the figures are the medians (a shared machine's load drifts on a
# scale of seconds, and interleaving spreads it evenly). The load average is printed.
#
# Options (env): BENCH_SECONDS (default 1), BENCH_ROUNDS (default 7), BENCH_PROCS
# (default 8), BENCH_STREAMS (default "1,2,4"), BENCH_MODES (default "ops,program").
Code.require_file("support/bench.exs", __DIR__)

alias Emily.Native, as: N

seconds = String.to_integer(System.get_env("BENCH_SECONDS", "1"))
rounds = String.to_integer(System.get_env("BENCH_ROUNDS", "7"))
procs = String.to_integer(System.get_env("BENCH_PROCS", "8"))

stream_counts =
  System.get_env("BENCH_STREAMS", "1,2,4") |> String.split(",") |> Enum.map(&String.to_integer/1)

modes =
  System.get_env("BENCH_MODES", "ops,program") |> String.split(",") |> Enum.map(&String.to_atom/1)

{batch, d_in, d_hidden, d_out} = {32, 256, 1024, 256}
flops = 2 * batch * d_in * d_hidden + 2 * batch * d_hidden * d_out

rand = fn n, scale -> for _ <- 1..n, do: (:rand.uniform() - 0.5) * scale end
:rand.seed(:exsss, {1, 2, 3})
wst = Emily.Stream.new(:cpu)

[w1, b1, w2, b2] =
  weights = [
    Emily.from_list(rand.(d_in * d_hidden, 0.1), {:f, 32}, shape: {d_in, d_hidden}, stream: wst),
    Emily.from_list(rand.(d_hidden, 0.1), {:f, 32}, shape: {d_hidden}, stream: wst),
    Emily.from_list(rand.(d_hidden * d_out, 0.1), {:f, 32}, shape: {d_hidden, d_out}, stream: wst),
    Emily.from_list(rand.(d_out, 0.1), {:f, 32}, shape: {d_out}, stream: wst)
  ]

Emily.eval(weights)

forward_ops = fn st, x ->
  h = N.add(st, N.matmul(st, x, w1), b1)
  h = N.maximum(st, h, N.full(st, {}, 0.0, {:f, 32}))
  y = N.add(st, N.matmul(st, h, w2), b2)
  N.softmax(st, y, [1], false)
end

program =
  Emily.Program.new(
    [
      {:matmul, [0, 1]},
      {:add, [5, 2]},
      {:full, [{}, 0.0, {:f, 32}]},
      {:maximum, [6, 7]},
      {:matmul, [8, 3]},
      {:add, [9, 4]},
      {:softmax, [10, [1], false]}
    ],
    inputs: 5,
    compile: true
  )

forward_program = fn st, x -> hd(Emily.Program.run(program, [x, w1, b1, w2, b2], stream: st)) end

run = fn n_streams, mode ->
  streams = for _ <- 1..n_streams, do: Emily.Stream.new(:cpu)
  forward = if mode == :ops, do: forward_ops, else: forward_program
  parent = self()
  deadline = System.monotonic_time(:millisecond) + seconds * 1000

  tasks =
    for p <- 1..procs do
      Task.async(fn ->
        st = Enum.at(streams, rem(p, n_streams))
        x = Emily.from_list(rand.(batch * d_in, 1.0), {:f, 32}, shape: {batch, d_in}, stream: st)
        # Warm-up (and, for programs, compile on this stream).
        Emily.to_binary(forward.(st, x))
        send(parent, :ready)
        receive do: (:go -> :ok)

        Stream.repeatedly(fn -> Emily.to_binary(forward.(st, x)) end)
        |> Enum.reduce_while(0, fn _, n ->
          if System.monotonic_time(:millisecond) < deadline,
            do: {:cont, n + 1},
            else: {:halt, n + 1}
        end)
      end)
    end

  for _ <- tasks, do: receive(do: (:ready -> :ok))
  t0 = System.monotonic_time(:microsecond)
  for t <- tasks, do: send(t.pid, :go)
  counts = Task.await_many(tasks, (seconds + 60) * 1000)
  elapsed = (System.monotonic_time(:microsecond) - t0) / 1.0e6
  total = Enum.sum(counts)
  {total / elapsed, counts}
end

IO.puts("""
Emily #{Application.spec(:emily, :vsn)}, MLX #{Emily.mlx_version()}, #{System.schedulers_online()} schedulers, \
#{:erlang.system_info(:logical_processors_available)} logical CPUs, OPENBLAS_NUM_THREADS=#{System.get_env("OPENBLAS_NUM_THREADS", "(unset)")}
MLP forward #{batch}x#{d_in} -> #{d_hidden} -> #{d_out} (#{Float.round(flops / 1.0e6, 1)} MFLOP) + to_binary; \
#{procs} processes; #{rounds} rounds of #{seconds} s per point, medians
""")

load = fn -> File.read!("/proc/loadavg") |> String.split() |> hd() end

# The parallelism the host gives this VM right now: the work 2 busy Erlang processes
# get done in BENCH_SECONDS, over what 1 gets done. On an idle 2-core machine it is 2.0;
# on a shared one it bounds what 2 streams can reach.
spin = fn n ->
  deadline = System.monotonic_time(:millisecond) + seconds * 1000

  loop = fn loop, k ->
    if rem(k, 10_000) == 0 and System.monotonic_time(:millisecond) >= deadline,
      do: k,
      else: loop.(loop, k + 1)
  end

  1..n
  |> Enum.map(fn _ -> Task.async(fn -> loop.(loop, 1) end) end)
  |> Task.await_many(:infinity)
  |> Enum.sum()
end

configs = [{:host, 1}, {:host, 2}] ++ for mode <- modes, n <- stream_counts, do: {mode, n}

samples =
  Enum.reduce(1..rounds, %{}, fn _, acc ->
    Enum.reduce(configs, acc, fn config = {mode, n}, acc ->
      rate = if mode == :host, do: spin.(n) / seconds, else: elem(run.(n, mode), 0)
      Map.update(acc, config, [rate], &[rate | &1])
    end)
  end)

host = Enum.zip_with(samples[{:host, 2}], samples[{:host, 1}], &(&1 / &2))

IO.puts(
  "host parallelism (2 busy Erlang processes over 1, same round): median " <>
    "#{Float.round(Bench.median(host), 2)}x, range #{Float.round(Enum.min(host), 2)}..#{Float.round(Enum.max(host), 2)}x"
)

for mode <- modes do
  [first | _] = stream_counts
  base = samples[{mode, first}]

  for n <- stream_counts do
    rates = samples[{mode, n}]
    ratios = Enum.zip_with(rates, base, &(&1 / &2))

    IO.puts(
      "#{String.pad_trailing(to_string(mode), 8)} #{n} stream(s): #{Float.round(Bench.median(rates), 1)} forwards/s " <>
        "(#{Float.round(Bench.median(rates) * flops / 1.0e9, 2)} GFLOP/s); vs #{first} stream(s) in the same round: " <>
        "median #{Float.round(Bench.median(ratios), 2)}x, range #{Float.round(Enum.min(ratios), 2)}..#{Float.round(Enum.max(ratios), 2)}x"
    )
  end
end

IO.puts("load average (1 min) at the end: #{load.()}")
