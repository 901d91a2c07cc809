# The native path's programs without Nx: replays the programs bench/defn.exs lowered (kept
# with its `--keep=DIR`) through Emily.Program, beside Python MLX running the very same
# instructions (bench/defn.py), in one run. For machines without Nx, such as a GPU server
# running a bundle (README, "Running on a GPU server"):
#
#     mix run --no-deps-check bench/program.exs DIR [repeats] [--pairs=N]   (in a checkout)
#     bin/emily-run bench/program.exs DIR [repeats] [--pairs=N]             (in a bundle)
#
# Runs on the CPU device, as bench/defn.exs does. `repeats` > 1 alternates Emily and
# Python passes and keeps each figure's best. EMILY_PYTHONPATH names the folder holding
# the `mlx` package on Emily's libmlx; EMILY_BENCH_BLAS the OpenBLAS that Python preloads
# (default `libopenblas.so.0`), the library Emily's NIF links.
#
# Prints, per graph, the best mean time per run (outputs read back to the host) of
# `Program.eval/3` (the native path's call), `Program.run/3` + read, and the program
# compiled with mx::compile, beside Python eager and mx.compile; then the chain at two
# lengths split into a fixed cost per run and a cost per op; then `Program.eval` and
# mx::compile against Python in paired windows (Bench.paired/6; `--pairs=N`, default 30).
Code.require_file("support/bench.exs", __DIR__)
Code.require_file("support/programs.exs", __DIR__)

{pairs, argv} = Bench.pairs_option(System.argv())

{dir, repeats} =
  case argv do
    [dir] -> {dir, 1}
    [dir, n] -> {dir, String.to_integer(n)}
    _ -> raise "usage: bench/program.exs DIR [repeats] [--pairs=N] (DIR from defn.exs --keep=DIR)"
  end

defmodule Bench.Program do
  def emily_pass(g) do
    read = fn outs -> Enum.each(outs, &Emily.to_binary/1) end
    opts = [stream: g.stream]
    # (The timed calls capture only what they use: see Bench.isolated/1.)
    %{plain: plain, compiled: compiled, tensors: tensors} = g

    %{
      "Program.eval" =>
        Bench.best(fn -> read.(Emily.Program.eval(plain, tensors, opts)) end, g.reps),
      "Program.run + read" =>
        Bench.best(fn -> read.(Emily.Program.run(plain, tensors, opts)) end, g.reps),
      "mx::compile" =>
        Bench.best(fn -> read.(Emily.Program.eval(compiled, tensors, opts)) end, g.reps)
    }
  end

  # The largest difference between Emily's first output and Python's (written by defn.py).
  def diff(g, label) do
    [out | _] = Emily.Program.eval(g.plain, g.tensors, stream: g.stream)
    path = Path.join(g.dir, "#{Path.basename(g.out)}_#{label}_0.bin")
    py = Emily.from_binary(File.read!(path), Tuple.to_list(Emily.shape(out)), Emily.dtype(out))
    s = g.stream

    d =
      Emily.Native.abs(
        s,
        Emily.Native.subtract(
          s,
          Emily.Native.astype(s, out, {:f, 32}),
          Emily.Native.astype(s, py, {:f, 32})
        )
      )

    hd(
      Emily.to_list(
        Emily.Native.max(
          s,
          Emily.Native.reshape(s, d, [Tuple.product(Emily.shape(out))]),
          [0],
          false
        )
      )
    )
  end

  def fmt(us), do: :erlang.float_to_binary(us * 1.0, decimals: 1) <> " us"
  def r(x), do: :erlang.float_to_binary(x, decimals: 2)
end

graphs = Enum.map(Bench.Programs.load(dir), &Map.put(&1, :dir, dir))
paths = ["Program.eval", "Program.run + read", "mx::compile"]

passes =
  for _ <- 1..repeats do
    emily = Map.new(graphs, &{&1.name, Bench.Program.emily_pass(&1)})

    py =
      Bench.python(Path.join(__DIR__, "defn.py"), [Path.join(dir, "graphs.py")], [
        {"LD_PRELOAD", System.get_env("EMILY_BENCH_BLAS", "libopenblas.so.0")}
      ])

    {emily, py}
  end

best = fn get -> passes |> Enum.map(get) |> Enum.min() end

IO.puts(
  "MLX #{Emily.mlx_version()}, CPU device; #{:erlang.system_info(:logical_processors_available)} logical CPUs; load average #{File.read!("/proc/loadavg") |> String.split() |> Enum.take(3) |> Enum.join(" ")}; #{repeats} pass(es), best kept"
)

IO.puts(
  "Per run: best mean time, outputs read back; per op: / instructions. Ratios: Emily / Python.\n"
)

times =
  for g <- graphs, into: %{} do
    eager = best.(fn {_, py} -> py["#{g.name}_eager"] end)
    compiled = best.(fn {_, py} -> py["#{g.name}_compiled"] end)
    ops = length(g.instrs)

    IO.puts(
      "#{g.name}: #{ops} ops; max |diff| Emily vs Python: eager #{Bench.Program.diff(g, "eager")}, compiled #{Bench.Program.diff(g, "compiled")}"
    )

    IO.puts("| path | per run | per op | / Python eager | / Python compiled |")
    IO.puts("|---|---|---|---|---|")

    rows =
      for label <- paths do
        t = best.(fn {emily, _} -> emily[g.name][label] end)
        {"Emily " <> label, t}
      end ++ [{"Python MLX eager", eager}, {"Python MLX mx.compile", compiled}]

    for {label, t} <- rows do
      IO.puts(
        "| #{label} | #{Bench.Program.fmt(t)} | #{Bench.Program.fmt(t / ops)} | #{Bench.Program.r(t / eager)} | #{Bench.Program.r(t / compiled)} |"
      )
    end

    IO.puts("")
    {g.name, {ops, Map.new(rows)}}
  end

with {16, short} <- times["chain_of_16_sin_cos_1x8"],
     {256, long} <- times["chain_of_256_sin_cos_1x8"] do
  IO.puts("Chain of 16 and 256 ops: time per run = fixed + ops x per op")
  IO.puts("| path | fixed | per op | per op / Python eager's |")
  IO.puts("|---|---|---|---|")
  py_op = (long["Python MLX eager"] - short["Python MLX eager"]) / 240

  for {label, _} <- Enum.sort(short) do
    per_op = (long[label] - short[label]) / 240
    fixed = short[label] - 16 * per_op

    IO.puts(
      "| #{label} | #{Bench.Program.fmt(fixed)} | #{:erlang.float_to_binary(per_op, decimals: 2)} us | #{Bench.Program.r(per_op / py_op)} |"
    )
  end
end

# Paired windows (Bench.paired/6): the figures above keep each side's best window, which
# the host's load moves by tens of percent from pass to pass; here each Emily window is
# compared with a Python window run right beside it.
if pairs > 0 do
  rows =
    for g <- graphs,
        {label, program, py} <- [
          {"Program.eval", g.plain, "eager"},
          {"mx::compile", g.compiled, "compiled"}
        ] do
      %{tensors: tensors, stream: stream} = g

      read = fn ->
        Enum.each(Emily.Program.eval(program, tensors, stream: stream), &Emily.to_binary/1)
      end

      {[g.name, label, py], read, "#{g.name}_#{py}", 4 * g.reps}
    end

  blas = System.get_env("EMILY_BENCH_BLAS", "libopenblas.so.0")
  Bench.paired_table(Path.join(dir, "graphs.py"), blas, pairs, rows)
end
