# What the host language costs per op: the CPU time each side spends in its own code
# while it runs a graph, beside what MLX spends. Replays the programs bench/defn.exs
# lowered (kept with its `--keep=DIR`) through Emily.Program.eval/3, and the same
# instructions in Python MLX (bench/defn.py's server), each window under `perf record`
# (a CPU-clock sample every 200 us of CPU time, on every thread of the process), and
# sorts the samples by the library they fell in:
#
#   * host: Emily's own code (libemily: the program's replay, the NIFs; beam.smp: the
#     VM and the Elixir code) against Python's (the interpreter, MLX's Python binding,
#     numpy's reads);
#   * MLX: libmlx and the BLAS, LAPACK and libm it calls, the same on both sides;
#   * the rest: the C and C++ runtimes and the kernel, which host and MLX both call,
#     and anything else (numpy's own OpenBLAS, say).
#
#     ELIXIR_ERL_OPTIONS="+sbwt none +sbwtdcpu none +sbwtdio none" \
#       mix run --no-deps-check bench/overhead.exs DIR [runs] [--pairs=N] [--profiled=K]
#
# The schedulers' busy wait off: left on, the VM's idle schedulers spin while a graph
# runs (bench/README.md: this moves no time per run), and their spinning would count as
# host time. Needs `perf`, allowed to attach to this user's processes. `runs` per window,
# default 4 x the graph's reps; `--pairs` of unprofiled windows timed first (default 30),
# then `--profiled` windows of each side under perf (default 3; medians).
# EMILY_BENCH_BLAS as in bench/program.exs.
Code.require_file("support/bench.exs", __DIR__)
Code.require_file("support/programs.exs", __DIR__)

defmodule Bench.Overhead do
  @period_ns 200_000

  # The VM's JIT-compiled code lives in an anonymous `memfd:vmem` mapping.
  @host_emily ~r/^(beam\.smp|libemily\.so|memfd:vmem)/
  @mlx ~r/^(libmlx|libopenblas|libblas|liblapack|libgfortran|libquadmath|libm\.so)/
  @host_python ~r/(^libpython|^python3|cpython-.*\.so$|^libnumpy|^_multiarray)/

  @doc """
  Runs `fun` with `perf record` attached to OS process `os_pid`; returns `fun`'s result
  and the CPU microseconds sampled in each library.
  """
  def record(os_pid, fun) do
    file =
      Path.join(System.tmp_dir!(), "emily_bench_overhead_#{System.unique_integer([:positive])}")

    perf = System.find_executable("perf") || raise "bench/overhead.exs needs perf"

    port =
      Port.open({:spawn_executable, perf}, [
        :exit_status,
        :stderr_to_stdout,
        args: ~w(record -q -e cpu-clock -c #{@period_ns} -p #{os_pid} -o #{file})
      ])

    {:os_pid, perf_pid} = Port.info(port, :os_pid)
    # perf attaches to every thread of the process, which takes it a moment.
    Process.sleep(500)
    result = fun.()
    {_, 0} = System.cmd("kill", ["-INT", "#{perf_pid}"])

    receive do
      {^port, {:exit_status, _}} -> :ok
    end

    {out, 0} = System.cmd(perf, ~w(script -F ip,dso -i #{file}), stderr_to_stdout: false)
    File.rm(file)

    by_dso =
      out
      |> String.split("\n", trim: true)
      # Each line: `ADDRESS (PATH)`.
      |> Enum.frequencies_by(fn line ->
        [_, path] = Regex.run(~r/\((.*)\)\s*$/, line)
        Path.basename(path)
      end)
      |> Map.new(fn {dso, n} -> {dso, n * @period_ns / 1000} end)

    {result, by_dso}
  end

  @doc "Sorts `by_dso` into `%{host:, mlx:, rest:}` microseconds, for Emily or Python."
  def split(by_dso, side) do
    Enum.reduce(by_dso, %{host: 0.0, mlx: 0.0, rest: 0.0}, fn {dso, us}, acc ->
      kind =
        cond do
          dso =~ @mlx -> :mlx
          side == :emily and dso =~ @host_emily -> :host
          side == :python and dso =~ @host_python -> :host
          true -> :rest
        end

      Map.update!(acc, kind, &(&1 + us))
    end)
  end
end

{pairs, argv} = Bench.pairs_option(System.argv())
{profiled, argv} = Bench.int_option(argv, "profiled", 3)

{runs, dir} =
  case argv do
    [dir] -> {nil, dir}
    [dir, n] -> {String.to_integer(n), dir}
    _ -> raise "usage: bench/overhead.exs DIR [runs] [--pairs=N] (DIR from defn.exs --keep=DIR)"
  end

graphs = Bench.Programs.load(dir)
blas = System.get_env("EMILY_BENCH_BLAS", "libopenblas.so.0")

server =
  Bench.python_server(Path.join(__DIR__, "defn.py"), [Path.join(dir, "graphs.py")], [
    {"LD_PRELOAD", blas}
  ])

{:os_pid, python_pid} = Port.info(server, :os_pid)
own_pid = String.to_integer(System.pid())

IO.puts("""
MLX #{Emily.mlx_version()}, CPU device; #{:erlang.system_info(:logical_processors_available)} logical CPUs; load average #{File.read!("/proc/loadavg") |> String.split() |> Enum.take(3) |> Enum.join(" ")}

Each graph's eager program: Emily.Program.eval/3 and a read of each output; Python, the
same mx calls, mx.eval and np.asarray. Time per op: the wall time per run / ops, medians
of #{pairs} paired windows without the profiler (Bench.paired/6). Then #{profiled} windows of
each side under perf, alternated (medians): the CPU time per run in the host's own code
(and per op), in MLX, and in the rest: the C and C++ runtimes, the kernel and anything
else (both hosts' spinning waits included).
| graph | ops | time per op: Emily / Python | host per op: Emily / Python | host per run: Emily / Python | MLX per run: Emily / Python | the rest per run: Emily / Python |
|---|---|---|---|---|---|---|\
""")

us = fn x -> :erlang.float_to_binary(x * 1.0, decimals: 1) <> " us" end
us2 = fn x -> :erlang.float_to_binary(x * 1.0, decimals: 2) <> " us" end
both = fn e, p, f -> "#{f.(e)} / #{f.(p)}" end

for g <- graphs do
  n = runs || 4 * g.reps
  ops = length(g.instrs)
  %{plain: plain, tensors: tensors, stream: s} = g
  read = fn -> Enum.each(Emily.Program.eval(plain, tensors, stream: s), &Emily.to_binary/1) end
  name = "#{g.name}_eager"
  timed = Bench.paired(read, server, name, n, pairs)

  # `profiled` windows of each side, alternated; each figure is the median over them.
  # One call before each window on both sides (the Python server runs one untimed).
  windows =
    for _ <- 1..profiled do
      {_, emily} =
        Bench.Overhead.record(own_pid, fn ->
          Bench.isolated(fn -> Enum.each(0..n, fn _ -> read.() end) end)
        end)

      {_, python} =
        Bench.Overhead.record(python_pid, fn -> Bench.python_window(server, name, n, 0) end)

      {Bench.Overhead.split(emily, :emily), Bench.Overhead.split(python, :python)}
    end

  median = fn side, k -> Bench.median(Enum.map(windows, &(elem(&1, side)[k] / (n + 1)))) end

  e = Map.new([:host, :mlx, :rest], &{&1, median.(0, &1)})
  p = Map.new([:host, :mlx, :rest], &{&1, median.(1, &1)})

  IO.puts(
    "| #{g.name} | #{ops} | #{both.(timed.emily / ops, timed.python / ops, us2)} | " <>
      "#{both.(e.host / ops, p.host / ops, us2)} | #{both.(e.host, p.host, us)} | " <>
      "#{both.(e.mlx, p.mlx, us)} | #{both.(e.rest, p.rest, us)} |"
  )
end

Port.close(server)
