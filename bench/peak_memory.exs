# Where a decoder's peak memory goes on a CPU: bench/models.exs's Qwen3-0.6B-shaped
# checkpoint loaded by Bumblebee on Emily, a started generation serving (prompt 128, greedy
# `--new` tokens) and its calls; after each step the process's RSS and high-water mark
# (VmHWM, reset before the load) beside MLX's active and peak memory, and through each
# call, sampled every 10 ms, RSS, the VM's own memory and MLX's active memory at the
# moment RSS was highest.
#
#     python3 bench/make_models.py                  # once: $EMILY_CACHE/bench-models
#     MIX_ENV=test mix run path/to/emily/bench/peak_memory.exs [--type=bf16] [--calls=3]
#         [--new=64] [--dir=DIR] [--lean]
#
# `--lean`: before the serving starts, malloc's thresholds at 128 KiB
# (`Emily.Memory.tune_malloc/1`) and MLX's cache off (`Emily.Memory.set_cache_limit/1`),
# so that freed buffers go back to the system: the lower peak and its price in time
# (bench/README.md, "CPU: models"). From a Mix project with Emily, Nx 0.12 and Bumblebee.
Code.require_file("support/bench.exs", __DIR__)
Code.require_file("support/decode.exs", __DIR__)

alias Bench.Decode, as: D

argv = System.argv()
type = D.option(argv, "type", "bf16")
dir = Path.join(D.models_dir(argv), "qwen3-#{type}")
calls = D.option(argv, "calls", "3") |> String.to_integer()
new = D.option(argv, "new", "64") |> String.to_integer()
lean? = "--lean" in argv

Nx.global_default_backend(Emily.Backend)
mb = &D.f(&1 / 2 ** 20, 0)

report = fn step ->
  %{active: active, peak: peak} = Emily.Memory.stats()

  IO.puts(
    "#{step}: RSS #{D.f(D.rss_mb(), 0)} MB, peak #{D.f(D.rss_peak_mb(), 0)} MB; " <>
      "MLX active #{mb.(active)} MB, peak #{mb.(peak)} MB; the VM #{mb.(:erlang.memory(:total))} MB"
  )
end

# {ms since the call, RSS, the VM's memory, MLX's active memory}, every 10 ms until :stop.
sample = fn sample, t0, acc ->
  receive do
    {:stop, from} -> send(from, {:samples, acc})
  after
    10 ->
      row =
        {System.monotonic_time(:millisecond) - t0, D.rss_mb(), :erlang.memory(:total),
         Emily.Memory.stats().active}

      sample.(sample, t0, [row | acc])
  end
end

report.("start")
D.reset_rss_peak()
Emily.Memory.reset_peak()

{:ok, info} =
  Bumblebee.load_model({:local, dir}, type: String.to_atom(type), backend: Emily.Backend)

report.("loaded #{dir}")

if lean? do
  Emily.Memory.tune_malloc(mmap_threshold: 131_072, trim_threshold: 131_072)
  Emily.Memory.set_cache_limit(0)
end

prompt = D.prompt()

{_pid, name} = D.start_generation(info, dir, prompt, new)
report.("serving started#{if lean?, do: " (lean)", else: ""}")

for i <- 1..calls do
  me = self()
  t0 = System.monotonic_time(:millisecond)
  sampler = spawn(fn -> sample.(sample, t0, []) end)
  {us, _ids} = :timer.tc(fn -> Nx.Serving.batched_run(name, prompt) end)
  send(sampler, {:stop, me})

  samples =
    receive do
      {:samples, s} -> s
    end

  {at, rss, vm, active} = Enum.max_by(samples, &elem(&1, 1), fn -> {0, 0.0, 0, 0} end)
  report.("call #{i}, #{D.f(us / 1.0e6, 2)} s")

  IO.puts(
    "  highest RSS #{D.f(rss, 0)} MB at #{at} ms: the VM #{mb.(vm)} MB, MLX active #{mb.(active)} MB"
  )
end
