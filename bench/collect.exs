# Memory of a training loop: steps of bench/support/defn_models.exs's MLP training step
# (grad and an Adam update; each step's parameters and moments replace the last), with
# Emily's collection budget (Emily.Memory, "Results the BEAM has not collected yet"),
# without it, and with the loop's process collected after every step, as a training
# library's forced collection does. Needs Nx, as bench/defn.exs does:
#
#     MIX_ENV=dev mix run path/to/emily/bench/collect.exs [steps] [heap_words]
#
# Prints, per way, MLX's peak memory over the loop (Emily.Memory.stats/0) and the time
# per step, each way twice, alternated. Each loop runs in a process of its own, whose
# heap starts at `heap_words` (default 0: the BEAM's smallest): a training library's
# loop process, holding its state and metrics, has a larger one, and the larger the
# heap, the fewer steps between the BEAM's own collections.
unless Code.ensure_loaded?(Nx) do
  raise "bench/collect.exs needs Nx (see the comment at the top)"
end

Code.require_file("support/defn_models.exs", __DIR__)

{steps, heap_words} =
  case Enum.map(System.argv(), &String.to_integer/1) do
    [] -> {20, 0}
    [steps] -> {steps, 0}
    [steps, heap_words] -> {steps, heap_words}
  end

{batch, din, hidden, dout} = {64, 1024, 4096, 10}
Nx.default_backend(Emily.Backend)
key = Nx.Random.key(1)
normal = fn shape -> elem(Nx.Random.normal(key, 0.0, 0.02, shape: shape), 0) end
shapes = [{din, hidden}, {hidden}, {hidden, hidden}, {hidden}, {hidden, dout}, {dout}]
params = shapes |> Enum.map(normal) |> List.to_tuple()
zeros = shapes |> Enum.map(&Nx.broadcast(0.0, &1)) |> List.to_tuple()
x = normal.({batch, din})
labels = Nx.iota({batch}) |> Nx.remainder(dout) |> Nx.new_axis(1) |> Nx.equal(Nx.iota({1, dout}))
labels = Nx.as_type(labels, :f32)
step = Nx.Defn.jit(&Bench.Defn.Models.train_step/4, compiler: Emily.Compiler)
mib = fn bytes -> "#{Float.round(bytes / 1024 ** 2, 1)} MiB" end

run = fn budget, force? ->
  previous = Emily.Memory.set_collect_after(budget)
  parent = self()

  Process.spawn(
    fn ->
      # (The first step compiles; the loop starts from its result.)
      state = step.(x, labels, params, {zeros, zeros})
      Emily.Memory.reset_peak()
      t0 = System.monotonic_time(:millisecond)

      Enum.reduce(1..steps, state, fn _, {p, moments, _loss} ->
        if force?, do: :erlang.garbage_collect()
        step.(x, labels, p, moments)
      end)

      ms = System.monotonic_time(:millisecond) - t0
      send(parent, {:done, Emily.Memory.stats().peak, ms})
    end,
    [:link, min_heap_size: heap_words]
  )

  receive do
    {:done, peak, ms} ->
      Emily.Memory.set_collect_after(previous)
      {peak, ms}
  end
end

state_bytes = 3 * Enum.sum(Enum.map(shapes, &(Tuple.product(&1) * 4)))

IO.puts(
  "MLX #{Emily.mlx_version()} on #{Emily.default_device()}; MLP #{batch}x#{din}-#{hidden}-#{hidden}-#{dout}, " <>
    "#{steps} steps; parameters and Adam moments #{mib.(state_bytes)}; loop heap #{heap_words} words\n"
)

IO.puts("| loop | MLX peak | time per step |\n|---|---|---|")

ways = [
  {"collect_after: 64 MiB (the default)", 64 * 1024 ** 2, false},
  {"collect_after: false", false, false},
  {"collect_after: false, the loop's process collected each step", false, true}
]

for {label, budget, force?} <- ways ++ Enum.reverse(ways) do
  {peak, ms} = run.(budget, force?)
  IO.puts("| #{label} | #{mib.(peak)} | #{div(ms, steps)} ms |")
end
