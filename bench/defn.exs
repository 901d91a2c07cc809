# defn on Emily: an MLP forward pass, a transformer block, a classifier (embeddings, the
# block, a head), dropout (Nx.Random's loops) and a chain of elementwise ops,
# run through Emily.Compiler (evaluator path, every node a lazy MLX op; native path, the
# graph lowered into one Emily.Program, through Nx.Defn.jit and Nx.Defn.compile, with
# and without mx::compile) beside
# Nx.Defn.Evaluator on Nx.BinaryBackend and Python MLX on the same graph, in one run.
# Needs Nx: run it from a Mix project with both Emily and Nx as dependencies, in a
# non-test environment (the test config checks every op's result):
#
#     MIX_ENV=dev mix run path/to/emily/bench/defn.exs [--quick] [--keep=DIR] [--pairs=N] [repeats]
#
# `--keep=DIR` keeps the lowered programs and their inputs in DIR, for bench/program.exs
# (which replays them beside Python MLX without Nx, e.g. on a machine that has no Nx).
#
# Each graph runs at the bench's size and at a tiny one (batch 1, width 8), where kernel
# time is negligible and a run's time is the host's cost of its ops. Python MLX
# (bench/defn.py, with PYTHONPATH=$EMILY_CACHE/current) runs the very instructions the
# native path lowered, one `mx` call per MLX op, eager and with mx.compile; its results
# must equal Emily's native results exactly (printed as max |diff|, 0.0 when the graphs
# are the same op for op). `repeats` > 1 alternates the Emily and Python passes and keeps
# each figure's best, so that load spikes hit both sides alike.
#
# Prints, per graph: the lowered program's instruction count (ops), each path's best
# mean time per run (result read back to the host), time per op, and the ratios to
# Python; then the chain at two lengths split into a fixed cost per run and a cost per op;
# then the native paths against Python in paired windows (`--pairs=N`, default 30; 0
# leaves them out), the comparison least moved by the host's load.
unless Code.ensure_loaded?(Nx) do
  raise "bench/defn.exs needs Nx (see the comment at the top)"
end

Code.require_file("support/defn_models.exs", __DIR__)

defmodule Bench.Defn do
  # The polling time of the extra native-path row (Emily.Stream.set_spin/1).
  @spin 50
  @polled "native, polling 50 us"

  def random(key, shape, scale) do
    {t, key} = Nx.Random.normal(key, 0.0, scale, shape: shape, type: :f32)
    {Nx.backend_copy(t, Nx.BinaryBackend), key}
  end

  def params(key, shapes, scale) do
    {list, key} = Enum.map_reduce(shapes, key, fn shape, key -> random(key, shape, scale) end)
    {List.to_tuple(list), key}
  end

  # The largest difference between two results (every output of a tuple).
  def diff(%Nx.Tensor{} = a, %Nx.Tensor{} = b) do
    a
    |> Nx.backend_copy(Nx.BinaryBackend)
    |> Nx.subtract(Nx.backend_copy(b, Nx.BinaryBackend))
    |> Nx.abs()
    |> Nx.reduce_max()
    |> Nx.as_type(:f64)
    |> Nx.to_number()
  end

  def diff(a, b) do
    flat = &Nx.Defn.Composite.flatten_list([&1])
    Enum.zip_with(flat.(a), flat.(b), &diff/2) |> Enum.max()
  end

  # Reads a result back to the host (each output of a tuple).
  def read(%Nx.Tensor{} = t), do: Nx.to_binary(t)

  def read(outputs),
    do: outputs |> then(&Nx.Defn.Composite.flatten_list([&1])) |> Enum.each(&Nx.to_binary/1)

  # Python literals, for the dump bench/defn.py reads.
  def py(nil), do: "None"
  def py(true), do: "True"
  def py(false), do: "False"
  def py(a) when is_atom(a), do: "'#{a}'"
  def py(i) when is_integer(i), do: Integer.to_string(i)
  def py(f) when is_float(f), do: Float.to_string(f)
  def py(s) when is_binary(s), do: inspect(s)
  def py(l) when is_list(l), do: "[" <> Enum.map_join(l, ", ", &py/1) <> "]"

  def py(t) when is_tuple(t),
    do: "(" <> Enum.map_join(Tuple.to_list(t), "", &(py(&1) <> ", ")) <> ")"

  def py(%{} = m),
    do: "{" <> Enum.map_join(m, ", ", fn {k, v} -> py(k) <> ": " <> py(v) end) <> "}"

  # One graph: its program, its inputs written out for Python, and Emily's timed paths.
  def graph(name, fun, args, reps, dir, binary?) do
    {instrs, n_inputs, outputs, extras, _template} =
      Emily.Compiler.Native.instructions_of(fun, args)

    # The parameters, then the extras: captured tensors and folded constants, as
    # Emily tensors.
    flat =
      Enum.map(Nx.Defn.Composite.flatten_list(args), fn t ->
        {Nx.to_binary(Nx.backend_copy(t, Nx.BinaryBackend)), t.shape, t.type}
      end) ++ Enum.map(extras, &{Emily.to_binary(&1), Emily.shape(&1), Emily.dtype(&1)})

    ^n_inputs = length(flat)
    slug = name |> String.downcase() |> String.replace(~r/[^a-z0-9]+/, "_") |> String.trim("_")

    inputs =
      for {{data, shape, type}, i} <- Enum.with_index(flat) do
        path = Path.join(dir, "#{slug}_in_#{i}.bin")
        File.write!(path, data)
        {path, shape, type}
      end

    emily_args = Enum.map(args, &Nx.backend_copy(&1, Emily.Backend))

    paths = [
      {"evaluator", Nx.Defn.jit(fun, compiler: Emily.Compiler, native: false)},
      {"native", Nx.Defn.jit(fun, compiler: Emily.Compiler)},
      # The same program, compiled ahead with `Nx.Defn.compile/3`: no per-call lookup.
      {"native, Nx.Defn.compile",
       Nx.Defn.compile(fun, Enum.map(args, &Nx.to_template/1), compiler: Emily.Compiler)},
      {"native, mx::compile", Nx.Defn.jit(fun, compiler: Emily.Compiler, compile: true)},
      # What every call cost before lowered programs were kept: trace, lower, run.
      {"native, cache: false", Nx.Defn.jit(fun, compiler: Emily.Compiler, cache: false)}
    ]

    expected =
      Nx.with_default_backend(Nx.BinaryBackend, fn ->
        apply(Nx.Defn.jit(fun, compiler: Nx.Defn.Evaluator), args)
      end)

    %{
      name: name,
      slug: slug,
      ops: length(instrs),
      nx_ops: count_ops(fun, args),
      reps: reps,
      binary?: binary?,
      args: args,
      fun: fun,
      expected: expected,
      emily_args: emily_args,
      paths: paths,
      # (The first output, the one Python's is compared with.)
      native_out:
        hd(Nx.Defn.Composite.flatten_list([apply(elem(Enum.at(paths, 1), 1), emily_args)])),
      dump: %{
        name: slug,
        reps: reps,
        inputs: inputs,
        outputs: outputs,
        instrs: instrs,
        out: Path.join(dir, slug)
      }
    }
  end

  # The number of op nodes in the defn graph (parameters and constants aside).
  def count_ops(fun, args) do
    expr = apply(Nx.Defn.debug_expr(fun), args)
    {_, ids} = Nx.Defn.Composite.traverse(expr, %{}, &count/2)
    map_size(ids)
  end

  defp count(%Nx.Tensor{data: %Nx.Defn.Expr{id: id, op: op}} = t, acc) do
    if Map.has_key?(acc, id) or op in [:parameter, :constant, :tensor] do
      {t, acc}
    else
      {_, acc} = Nx.Defn.Tree.apply_args(t, Map.put(acc, id, op), &count/2)
      {t, acc}
    end
  end

  # Emily's paths: best mean per run, the result read back to the host.
  # Plus the native path again with the workers polling (Emily.Stream.set_spin/1).
  def emily_pass(g) do
    args = g.emily_args
    run = fn f -> Bench.best(fn -> f |> apply(args) |> read() end, g.reps) end
    times = for {label, f} <- g.paths, into: %{}, do: {label, run.(f)}
    native = Enum.find_value(g.paths, fn {label, f} -> label == "native" && f end)
    previous = Emily.Stream.set_spin(@spin)
    polled = run.(native)
    Emily.Stream.set_spin(previous)
    Map.put(times, @polled, polled)
  end

  def polled, do: @polled

  def binary_time(g) do
    f = Nx.Defn.jit(g.fun, compiler: Nx.Defn.Evaluator)

    args = g.args

    # (In the timing process: the default backend is the process's own.)
    Bench.best(
      fn ->
        Nx.with_default_backend(Nx.BinaryBackend, fn -> f |> apply(args) |> read() end)
      end,
      1,
      3
    )
  end

  def python(graphs, dir) do
    dump = Path.join(dir, "graphs.py")
    File.write!(dump, py(Enum.map(graphs, & &1.dump)))
    # The same dump for bench/program.exs, which replays the programs without Nx.
    File.write!(Path.join(dir, "graphs.etf"), :erlang.term_to_binary(Enum.map(graphs, & &1.dump)))

    Bench.python(Path.join(__DIR__, "defn.py"), [dump], [
      {"LD_PRELOAD", "libopenblas.so.0"}
    ])
  end

  def python_out(g, label) do
    bin = File.read!("#{g.dump.out}_#{label}_0.bin")
    Nx.from_binary(bin, g.native_out.type) |> Nx.reshape(g.native_out.shape)
  end

  def fmt(us) when us >= 10_000, do: "#{Float.round(us / 1000, 1)} ms"
  def fmt(us), do: :erlang.float_to_binary(us * 1.0, decimals: 1) <> " us"
  def r(x), do: :erlang.float_to_binary(x, decimals: 2)
end

Code.require_file("support/bench.exs", __DIR__)
alias Bench.Defn.Models

argv = System.argv()
quick? = "--quick" in argv

repeats =
  Enum.find_value(
    argv,
    1,
    &(Integer.parse(&1)
      |> then(fn
        {n, ""} -> n
        _ -> nil
      end))
  )

dir = Path.join(System.tmp_dir!(), "emily_bench_defn_#{System.os_time()}")
File.mkdir_p!(dir)

IO.puts(
  "MLX #{Emily.mlx_version()} on #{Emily.default_device()}; Nx #{Application.spec(:nx, :vsn)}; " <>
    "load average #{File.read!("/proc/loadavg") |> String.split() |> Enum.take(3) |> Enum.join(" ")}"
)

key = Nx.Random.key(42) |> Nx.backend_copy(Nx.BinaryBackend)

# {label, MLP {batch, in, hidden, out}, block {seq, d, ffn}, reps per round, BinaryBackend?}:
# the bench's sizes, and tiny ones where kernel time is negligible, so that the time per
# op is the host's cost of an op.
sizes =
  if quick?,
    do: [
      {"", {8, 128, 128, 10}, {16, 64, 256}, 100, true},
      {"tiny ", {1, 8, 8, 8}, {4, 8, 16}, 300, true}
    ],
    else: [
      {"", {16, 512, 256, 10}, {32, 128, 512}, 100, true},
      {"tiny ", {1, 8, 8, 8}, {4, 8, 16}, 500, true}
    ]

graphs =
  Enum.flat_map(sizes, fn {label, {batch, din, hidden, dout}, {seq, d, ffn}, reps, binary?} ->
    {x, key} = Bench.Defn.random(key, {batch, din}, 1.0)

    {mlp, key} =
      Bench.Defn.params(
        key,
        [{din, hidden}, {hidden}, {hidden, hidden}, {hidden}, {hidden, dout}, {dout}],
        0.05
      )

    {h, key} = Bench.Defn.random(key, {seq, d}, 1.0)

    {block, key} =
      Bench.Defn.params(key, [{d}, {d}, {d, 3 * d}, {d, d}, {d}, {d}, {d, ffn}, {ffn, d}], 0.05)

    # The classifier's vocabulary and classes.
    {vocab, classes} = {8 * seq, 4}
    {embeddings, key} = Bench.Defn.params(key, [{vocab, d}, {seq, d}], 0.5)
    {head, key} = Bench.Defn.params(key, [{d, classes}, {classes}], 0.5)
    {tokens, key} = Nx.Random.randint(key, 0, vocab, shape: {seq}, type: :s32)
    tokens = Nx.backend_copy(tokens, Nx.BinaryBackend)

    # The training step's one-hot labels and Adam moments (as after some steps).
    {classes_of, key} = Nx.Random.randint(key, 0, dout, shape: {batch}, type: :s32)
    labels = Nx.equal(Nx.new_axis(classes_of, 1), Nx.iota({1, dout})) |> Nx.as_type(:f32)
    labels = Nx.backend_copy(labels, Nx.BinaryBackend)
    {m, key} = Bench.Defn.params(key, Enum.map(Tuple.to_list(mlp), & &1.shape), 0.01)
    {v, _key} = Bench.Defn.params(key, Enum.map(Tuple.to_list(mlp), & &1.shape), 0.01)
    v = v |> Tuple.to_list() |> Enum.map(&Nx.multiply(&1, &1)) |> List.to_tuple()

    [
      Bench.Defn.graph(
        "#{label}MLP #{batch}x#{din}-#{hidden}-#{hidden}-#{dout}",
        &Models.mlp/2,
        [x, mlp],
        reps,
        dir,
        binary?
      ),
      Bench.Defn.graph(
        "#{label}MLP training step (grad, Adam) #{batch}x#{din}-#{hidden}-#{hidden}-#{dout}",
        &Models.train_step/4,
        [x, labels, mlp, {m, v}],
        div(reps, 4),
        dir,
        binary?
      ),
      Bench.Defn.graph(
        "#{label}transformer block seq #{seq}, d #{d}",
        &Models.block/2,
        [h, block],
        div(reps, 4),
        dir,
        binary?
      ),
      Bench.Defn.graph(
        "#{label}classifier (embeddings, block, head) seq #{seq}, d #{d}",
        &Models.classifier/4,
        [tokens, embeddings, block, head],
        div(reps, 4),
        dir,
        binary?
      )
    ]
  end)

{x, _key} = Bench.Defn.random(key, {1, 8}, 1.0)

chains =
  for n <- [16, 256] do
    Bench.Defn.graph("chain of #{n} sin/cos, 1x8", &Models.chain(&1, n: n), [x], 100, dir, false)
  end

{noise_in, _key} = Bench.Defn.random(Nx.Random.key(7), {64, 64}, 1.0)
noise_key = Nx.backend_copy(Nx.Random.key(8), Nx.BinaryBackend)

dropout =
  Bench.Defn.graph(
    "dropout 64x64 (Nx.Random.uniform)",
    &Models.dropout/2,
    [noise_in, noise_key],
    100,
    dir,
    true
  )

graphs = graphs ++ [dropout] ++ chains

min_merge = fn maps -> Enum.reduce(maps, &Map.merge(&1, &2, fn _, a, b -> min(a, b) end)) end

passes =
  for _ <- 1..repeats do
    emily = for g <- graphs, into: %{}, do: {g.slug, Bench.Defn.emily_pass(g)}
    {emily, Bench.Defn.python(graphs, dir)}
  end

emily =
  passes
  |> Enum.map(&elem(&1, 0))
  |> Enum.reduce(&Map.merge(&1, &2, fn _, a, b -> min_merge.([a, b]) end))

python = min_merge.(Enum.map(passes, &elem(&1, 1)))

IO.puts("""

Per run: best mean time (graph built, evaluated, result read back), #{repeats} pass(es).
ops = instructions of the lowered program (Nx expression nodes in brackets); Python MLX
runs the same instructions as the same MLX ops (bench/defn.py). Ratios: Emily / Python.
""")

for g <- graphs do
  py_eager = python["#{g.slug}_eager"]
  py_compiled = python["#{g.slug}_compiled"]
  times = emily[g.slug]

  binary =
    if g.binary? do
      t = Bench.Defn.binary_time(g)
      "; Nx.BinaryBackend #{Bench.Defn.fmt(t)}, native #{round(t / times["native"])}x faster"
    else
      ""
    end

  checks =
    g.paths
    |> Enum.map(fn {label, f} -> {label, Bench.Defn.diff(apply(f, g.emily_args), g.expected)} end)
    |> Enum.map_join(", ", fn {label, d} -> "#{label} #{Float.round(d, 7)}" end)

  IO.puts("""
  #{g.name}: #{g.ops} ops (#{g.nx_ops})#{binary}
    max |diff| vs BinaryBackend: #{checks}
    max |diff| Python MLX vs Emily native: eager #{Bench.Defn.diff(Bench.Defn.python_out(g, "eager"), g.native_out)}, compiled #{Bench.Defn.diff(Bench.Defn.python_out(g, "compiled"), g.native_out)}
  | path | per run | per op | / Python eager | / Python compiled |
  |---|---|---|---|---|\
  """)

  rows =
    Enum.map(g.paths, fn {label, _} -> {"Emily #{label}", times[label]} end) ++
      [{"Emily #{Bench.Defn.polled()}", times[Bench.Defn.polled()]}] ++
      [{"Python MLX eager", py_eager}, {"Python MLX mx.compile", py_compiled}]

  for {label, t} <- rows do
    IO.puts(
      "  | #{label} | #{Bench.Defn.fmt(t)} | #{Bench.Defn.fmt(t / g.ops)} | " <>
        "#{Bench.Defn.r(t / py_eager)} | #{Bench.Defn.r(t / py_compiled)} |"
    )
  end

  IO.puts("")
end

# The chain at two lengths: time per run = fixed + ops x marginal cost of an op.
[short, long] = chains
dn = long.ops - short.ops

split = fn t_short, t_long ->
  per_op = (t_long - t_short) / dn
  {t_short - short.ops * per_op, per_op}
end

chain_rows =
  Enum.map(Enum.map(short.paths, &elem(&1, 0)) ++ [Bench.Defn.polled()], fn label ->
    {"Emily #{label}", emily[short.slug][label], emily[long.slug][label]}
  end) ++
    for {label, key} <- [{"Python MLX eager", "eager"}, {"Python MLX mx.compile", "compiled"}] do
      {label, python["#{short.slug}_#{key}"], python["#{long.slug}_#{key}"]}
    end

{_, py_op} =
  chain_rows
  |> Enum.find(&(elem(&1, 0) == "Python MLX eager"))
  |> then(fn {_, a, b} -> split.(a, b) end)

IO.puts("""
Chain of #{short.ops} and #{long.ops} ops, 1x8: time per run = fixed + ops x per op
| path | #{short.ops} ops | #{long.ops} ops | fixed | per op | per op / Python eager's |
|---|---|---|---|---|---|\
""")

for {label, a, b} <- chain_rows do
  {fixed, per_op} = split.(a, b)

  IO.puts(
    "| #{label} | #{Bench.Defn.fmt(a)} | #{Bench.Defn.fmt(b)} | #{Bench.Defn.fmt(fixed)} | " <>
      "#{:erlang.float_to_binary(per_op, decimals: 2)} us | #{Bench.Defn.r(per_op / py_op)} |"
  )
end

# Paired windows (Bench.paired/6): each Emily window beside a Python window run right
# next to it, so that the host's slow and fast phases fall on both sides alike.
{pairs, _} = Bench.pairs_option(argv)

if pairs > 0 do
  rows =
    for g <- graphs,
        {label, py} <- [
          {"native", "eager"},
          {"native, Nx.Defn.compile", "eager"},
          {"native, mx::compile", "compiled"}
        ] do
      f = Enum.find_value(g.paths, fn {l, f} -> l == label && f end)
      args = g.emily_args
      run = fn -> f |> apply(args) |> Bench.Defn.read() end
      {[g.name, label, py], run, "#{g.slug}_#{py}", 4 * g.reps}
    end

  Bench.paired_table(Path.join(dir, "graphs.py"), "libopenblas.so.0", pairs, rows)
end

if keep =
     Enum.find_value(
       argv,
       &(String.starts_with?(&1, "--keep=") && String.trim_leading(&1, "--keep="))
     ) do
  File.rm_rf!(keep)
  File.cp_r!(dir, keep)

  IO.puts(
    "\nThe lowered programs and their inputs are in #{keep} (bench/program.exs replays them)."
  )
end

File.rm_rf!(dir)
