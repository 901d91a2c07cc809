# What one op costs, three ways in one run: a chain of 16 and of 256 alternating sin/cos
# on a 1x8 float32 tensor (kernel time negligible), through Emily.Program.eval/3 (the
# native path's call), Python MLX (bench/chain.py) and MLX's C++ API with no host language
# at all (bench/chain.cc, built here with the system's C++ compiler), all on the same
# libmlx, on the CPU device. The two lengths split a run's time into a fixed part and a
# part per op. Nx-free:
#
#     mix run --no-deps-check bench/chain.exs [rounds]
#     mix run --no-deps-check bench/chain.exs --loop=N   # Emily's 256-op chain, N runs, for a profiler
#
# Each round runs the three sides one after another (best of five windows each), the
# order rotated from round to round; the table gives each figure's median over rounds
# and the per-round ratios to Python's. MLX is found as the NIF's build finds it
# (`EMILY_MLX_DIR`, else `$EMILY_CACHE/current`); Python's `mlx` package in
# `EMILY_PYTHONPATH` (default `$EMILY_CACHE/current`); both external programs preload
# `EMILY_BENCH_BLAS` (default `libopenblas.so.0`), as the NIF links OpenBLAS.
Code.require_file("support/bench.exs", __DIR__)

{rounds, loop} =
  case System.argv() do
    [] -> {5, nil}
    ["--loop=" <> n] -> {0, String.to_integer(n)}
    [n] -> {String.to_integer(n), nil}
  end

# The input bench/chain.cc and bench/chain.py use: 0.0, 0.1, ..., 0.7.
input = fn s ->
  bin = for i <- 0..7, into: <<>>, do: <<0.1 * i::float-32-native>>
  x = Emily.from_binary(bin, {1, 8}, {:f, 32}, stream: s)
  Emily.eval([x])
  x
end

# One run as the native path makes it: the program evaluated, its output read.
run = fn p, x, s -> Enum.each(Emily.Program.eval(p, [x], stream: s), &Emily.to_binary/1) end

chain = fn n -> for i <- 1..n, do: {if(rem(i, 2) == 0, do: :cos, else: :sin), [i - 1]} end

if loop do
  s = Emily.Stream.default(:cpu)
  x = input.(s)
  p = Emily.Program.new(chain.(256), inputs: 1)
  {us, _} = :timer.tc(fn -> Enum.each(1..loop, fn _ -> run.(p, x, s) end) end)
  IO.puts("Emily.Program.eval, 256-op chain: #{Float.round(us / loop, 1)} us a run")
  System.halt(0)
end

cache = System.get_env("EMILY_CACHE", Path.expand("~/.cache/emily"))
mlx = System.get_env("EMILY_MLX_DIR", Path.join(cache, "current"))
blas = System.get_env("EMILY_BENCH_BLAS", "libopenblas.so.0")
lengths = [16, 256]
reps = %{16 => 2000, 256 => 500}

exe = Path.join(System.tmp_dir!(), "emily_bench_chain_#{System.unique_integer([:positive])}")

case System.cmd(
       System.get_env("CXX", "c++"),
       ~w(-O2 -std=c++20 -I#{mlx}/mlx/include #{Path.join(__DIR__, "chain.cc")} -o #{exe}) ++
         ~w(-L#{mlx}/mlx/lib -lmlx -Wl,-rpath,#{mlx}/mlx/lib),
       stderr_to_stdout: true
     ) do
  {_, 0} -> :ok
  {out, _} -> raise "bench/chain.cc did not build against the MLX in #{mlx}:\n#{out}"
end

# Each external side prints `n mean_us` for the length it is given.
external = fn run ->
  Map.new(lengths, fn n -> {n, run.(["#{reps[n]}", "#{n}"])["#{n}"]} end)
end

cpp = fn args ->
  {out, 0} = System.cmd(exe, args, env: [{"LD_PRELOAD", blas}])

  for line <- String.split(out, "\n", trim: true), into: %{} do
    [n, us] = String.split(line)
    {n, String.to_float(us)}
  end
end

python = &Bench.python(Path.join(__DIR__, "chain.py"), &1, [{"LD_PRELOAD", blas}])

sides = %{
  "C++" => fn -> external.(cpp) end,
  "Python" => fn -> external.(python) end,
  "Emily" => fn ->
    s = Emily.Stream.default(:cpu)
    x = input.(s)

    Map.new(lengths, fn n ->
      p = Emily.Program.new(chain.(n), inputs: 1)
      {n, Bench.best(fn -> run.(p, x, s) end, reps[n])}
    end)
  end
}

names = ["Emily", "Python", "C++"]

fit = fn t ->
  per_op = (t[256] - t[16]) / 240
  %{16 => t[16], 256 => t[256], per_op: per_op, fixed: t[16] - 16 * per_op}
end

results =
  for r <- 1..rounds do
    order = Enum.take(Stream.drop(Stream.cycle(names), rem(r, 3)), 3)
    res = Map.new(order, fn name -> {name, fit.(sides[name].())} end)

    IO.puts(
      "round #{r}: " <>
        Enum.map_join(names, "; ", fn n ->
          "#{n} per op #{Float.round(res[n].per_op, 3)} us, fixed #{Float.round(res[n].fixed, 1)} us"
        end)
    )

    res
  end

File.rm(exe)
fmt = fn x -> :erlang.float_to_binary(x / 1, decimals: 2) end

IO.puts("""

MLX #{Emily.mlx_version()}, CPU device; #{:erlang.system_info(:logical_processors_available)} logical CPUs; load average #{File.read!("/proc/loadavg") |> String.split() |> Enum.take(3) |> Enum.join(" ")}; #{rounds} rounds, medians

| side | 16 ops | 256 ops | fixed per run | per op | per op / Python's (range) |
|---|---|---|---|---|---|\
""")

for name <- names do
  get = fn k -> Bench.median(Enum.map(results, & &1[name][k])) end
  ratios = Enum.map(results, &(&1[name].per_op / &1["Python"].per_op))

  IO.puts(
    "| #{name} | #{fmt.(get.(16))} us | #{fmt.(get.(256))} us | #{fmt.(get.(:fixed))} us | " <>
      "#{:erlang.float_to_binary(get.(:per_op), decimals: 3)} us | " <>
      "#{fmt.(Bench.median(ratios))} (#{fmt.(Enum.min(ratios))}-#{fmt.(Enum.max(ratios))}) |"
  )
end
