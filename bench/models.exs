# Model-level figures: a Qwen3-0.6B-shaped decoder's greedy generation and a
# BERT-base-shaped encoder's forward pass through Bumblebee on Emily (`Emily.Compiler`),
# beside mlx-lm (on the same libmlx) and Transformers on PyTorch (bench/models.py), the
# sides alternated in one run, on the random checkpoints bench/make_models.py makes.
#
#     python3 bench/make_models.py                       # once: $EMILY_CACHE/bench-models
#     MIX_ENV=test mix run path/to/emily/bench/models.exs [--only=qwen,bert]
#         [--types=f32,bf16] [--new=64] [--rounds=1] [--pairs=5] [--dir=DIR] [--trace-file=PATH]
#         [--compile=true] [--overlap=false] [--fuse=false]   (Emily.Compiler's options)
#
# Run it from a Mix project with Emily, Nx 0.12 and Bumblebee as dependencies (Bumblebee
# 0.7 needs Nx 0.12). `python3` on the PATH needs torch and transformers;
# EMILY_PYTHONPATH (default $EMILY_CACHE/current) the `mlx` package on Emily's libmlx and
# mlx-lm, e.g. EMILY_PYTHONPATH=$EMILY_CACHE/current:/path/holding/mlx_lm. mlx-lm runs
# with OpenBLAS preloaded, as Emily links it.
#
# Decoder: the prompt is 128 ASCII characters, one token each (bench/make_models.py's
# byte-level tokenizer); greedy, no end token, `--new` tokens. Emily's side is a started
# `Bumblebee.Text.generation` serving (batch 1, sequence length 128) whose
# postprocessing returns the token ids: its first call lowers the graph (Nx.Serving
# initialises a batch key's computation on first use) and is reported apart; each later
# call is a round. mlx-lm runs `generate_step`, Transformers `generate`, each in a
# server of its own (bench/models.py's `--serve`) that loads the checkpoint and makes a
# 2-token warm-up once, then one generation a round. Prefill = from the call to the first token (on Emily, until
# the generation loop reads its condition after the prompt's pass); decode = tokens 2..N
# over the time from the first to the last. Peak RSS is the process's high-water mark
# from loading on (/proc/self/clear_refs reset before Emily's load); MLX peak is MLX's
# own (Emily.Memory). The three sides' token ids are compared; bf16 sides round
# differently and part at some step, which is printed.
#
# `--rounds=N` runs the three decoder sides N times, alternating their order each round
# (each side loaded once, so a round costs the three generations alone), and reports
# each side's best round and the median and range of its decode tok/s: on a host whose
# speed moves from one minute to the next (a GPU server's, seen here), one round's ratio
# says little.
#
# Emily's per-token breakdown: each timed call is traced (`:erlang.trace` on
# Emily.Program.run/3, Emily.Program.eval/3 and Emily.to_list/1, call times only): each
# pass of the loop is one program call, queued before the previous pass's condition is
# read (Emily.Compiler's `overlap`), and one read; a pass's period, and the host's time
# from its program call to the read (building and queueing it).
#
# Graph building a call: the host's time turning a call into MLX's lazy nodes, mean over
# the timed generation's calls (the prompt's and each token's): Emily's `Emily.Program.run/3`
# replays (`Emily.Program.build_time/0`), mlx-lm's model calls. Where the host is the
# limit, the rest of a token's time is MLX's encoding of those nodes for the device.
#
# Encoder: BertModel (last hidden state and pooled output) on token ids {batch, 128},
# Bumblebee's model through `Axon.build(compiler: Emily.Compiler)`, Transformers with as
# many threads as MLX's OpenBLAS (every core) or on CUDA where Emily runs on a GPU;
# paired windows (`Bench.paired/6`).
#
# Bandwidth: a 1 GiB copy (numpy) and sum (PyTorch, every core) in the same run; the
# bound for a decode token is the bytes of weights it reads (every matrix once, the tied
# embedding as the LM head) over the read bandwidth.
#
# On a GPU (Emily's default device), PyTorch runs on CUDA and mlx-lm on the GPU where it
# is installed. On a server without Erlang, run it from a bundle that carries a Mix
# project's Nx and Bumblebee (scripts/bundle, EMILY_BUNDLE_LIBS):
# `bin/emily-run bench/models.exs`. Without Bumblebee, only the Python sides run, beside
# Emily's hand-built Qwen3 decode step of bench/gpu/decode.exs.
Code.require_file("support/bench.exs", __DIR__)
Code.require_file("support/decode.exs", __DIR__)

defmodule Bench.Models do
  @moduledoc false

  # models.py's `name value` lines, keyed by atoms as Emily's side is.
  def python(args, env \\ []) do
    Bench.python(Path.join(__DIR__, "models.py"), args, env)
    |> Map.new(fn {k, v} -> {String.to_atom(k), v} end)
  end

  # A Python side's generation server (models.py generate ... --serve): the checkpoint
  # loaded and warmed up once, one timed generation per request. nil where the side
  # cannot start (mlx-lm missing on a GPU host, say).
  def generator(impl, ckpt, ids_file, new, device) do
    env = if impl == "mlx", do: [{"LD_PRELOAD", "libopenblas.so.0"}], else: []
    args = ["generate", impl, ckpt, ids_file, "#{new}", device]
    Bench.python_server(Path.join(__DIR__, "models.py"), args, env)
  rescue
    e in [RuntimeError, ErlangError] ->
      IO.puts("  (#{impl}: #{Exception.message(e) |> String.slice(0, 120)})")
      nil
  end

  # One timed generation of a Python side, with the ids it made.
  def generation(port, ids_file),
    do:
      port
      |> Bench.python_request("run")
      |> Map.put(:tokens, Bench.Decode.read_ids(ids_file <> ".out"))

  # " (median M; min-max, N rounds)" where there were several.
  def range([_]), do: ""

  def range(values),
    do:
      " (median #{Bench.Decode.f(Bench.median(values), 2)}; #{Bench.Decode.f(Enum.min(values), 2)}-" <>
        "#{Bench.Decode.f(Enum.max(values), 2)}, #{length(values)} rounds)"

  # A side's rounds: the fastest, with every round's decode tok/s under :rounds.
  def best_round(rs) do
    rs |> Enum.max_by(& &1.decode_tok_s) |> Map.put(:rounds, Enum.map(rs, & &1.decode_tok_s))
  end

  # The bytes of weights one decode token reads: every layer's matrices, the final
  # norm, and the tied embedding once, as the LM head (the embedding lookup reads one
  # row). Qwen3-0.6B's shape.
  def qwen_weight_bytes(bytes_per) do
    {h, nq, nkv, d, f, vocab, layers} = {1024, 16, 8, 128, 3072, 151_936, 28}
    per_layer = h * nq * d + 2 * h * nkv * d + nq * d * h + 3 * h * f + 2 * h + 2 * d
    (layers * per_layer + h + vocab * h) * bytes_per
  end
end

if Code.ensure_loaded?(Bumblebee) do
  defmodule Bench.Models.Emily do
    @moduledoc false
    alias Bench.Models, as: M
    alias Bench.Decode, as: D

    # Loads the checkpoint, starts a generation serving and makes its first call (which
    # lowers the graph): `{pid, setup}`, the side's loading figures. The serving holds
    # the parameters; the loaded copy is dropped.
    def start(dir, type, prompt, new, defn_options) do
      Nx.default_backend(Emily.Backend)
      D.reset_rss_peak()
      Emily.Memory.reset_peak()

      {load_us, {:ok, info}} =
        :timer.tc(fn ->
          Bumblebee.load_model({:local, dir}, type: type, backend: Emily.Backend)
        end)

      rss_loaded = D.rss_peak_mb()
      {pid, name} = D.start_generation(info, dir, prompt, new, defn_options)
      info = nil
      _ = info
      :erlang.garbage_collect()

      rss_started = D.rss_mb()
      Emily.Memory.reset_peak()
      {first_us, first_ids} = :timer.tc(fn -> Nx.Serving.batched_run(name, prompt) end)
      {rss_first, rss_first_peak} = {D.rss_mb(), D.rss_peak_mb()}
      first_mlx_peak = Emily.Memory.stats().peak

      {pid,
       %{
         name: name,
         first_ids: first_ids,
         load_s: load_us / 1.0e6,
         first_call_s: first_us / 1.0e6,
         rss_loaded_mb: rss_loaded,
         rss_points:
           "RSS #{D.f(rss_started, 0)} MB with the serving started, " <>
             "#{D.f(rss_first, 0)} MB after the first call (peak #{D.f(rss_first_peak, 0)}; " <>
             "MLX peak #{D.f(first_mlx_peak / 2 ** 20, 0)} MB)"
       }}
    end

    # One timed (and traced) generation of the started serving.
    def generation(setup, prompt, new) do
      Emily.Memory.reset_peak()
      {runs0, built0} = Emily.Program.build_time()
      {ids, t0, t1, events} = D.traced(fn -> Nx.Serving.batched_run(setup.name, prompt) end)
      {runs1, built1} = Emily.Program.build_time()
      b = D.breakdown(t0, t1, events)
      mlx = Emily.Memory.stats()
      ^new = length(ids)

      %{
        setup: setup,
        tokens: ids,
        first_call_tokens_equal: setup.first_ids == ids,
        prefill_ms: b.prefill_ms,
        decode_tok_s: (new - 1) / ((b.total_ms - b.prefill_ms - b.after_ms) / 1000),
        total_s: b.total_ms / 1000,
        rss_peak_mb: D.rss_peak_mb(),
        rss_after_mb: D.rss_mb(),
        mlx_peak_mb: mlx.peak / 2 ** 20,
        mlx_active_mb: mlx.active / 2 ** 20,
        build_ms: (built1 - built0) / max(runs1 - runs0, 1) / 1000,
        breakdown: b
      }
    end

    def bert(dir, batches, pairs, gpu?) do
      {:ok, %{model: model, params: params, spec: spec}} =
        Bumblebee.load_model({:local, dir}, architecture: :base, backend: Emily.Backend)

      {_init, predict} = Axon.build(model, compiler: Emily.Compiler)

      server =
        Bench.python_server(
          Path.join(__DIR__, "models.py"),
          ["bert", dir, Enum.join(batches, ","), if(gpu?, do: "cuda", else: "cpu")],
          []
        )

      rows =
        for b <- batches do
          ids =
            Nx.iota({b * 128}, type: :s64, backend: Nx.BinaryBackend)
            |> Nx.multiply(7919)
            |> Nx.add(13)
            |> Nx.remainder(spec.vocab_size)
            |> Nx.reshape({b, 128})

          inputs = %{
            "input_ids" => Nx.backend_copy(ids, Emily.Backend),
            "attention_mask" => Nx.broadcast(Nx.tensor(1, backend: Emily.Backend), {b, 128}),
            "token_type_ids" => Nx.broadcast(Nx.tensor(0, backend: Emily.Backend), {b, 128})
          }

          run = fn -> predict.(params, inputs) end
          run.()
          reps = if b == 1, do: 3, else: 1
          {b, Bench.paired(run, server, "bert_#{b}", reps, pairs, 300)}
        end

      Port.close(server)
      rows
    end
  end
end

alias Bench.Models, as: M
alias Bench.Decode, as: D

argv = System.argv()
bumblebee? = Code.ensure_loaded?(Bumblebee)
dir = D.models_dir(argv)
only = D.option(argv, "only", "qwen,bert") |> String.split(",")
types = D.option(argv, "types", "f32,bf16") |> String.split(",") |> Enum.map(&String.to_atom/1)
new = D.option(argv, "new", "64") |> String.to_integer()
pairs = D.option(argv, "pairs", "5") |> String.to_integer()
rounds = D.option(argv, "rounds", "1") |> String.to_integer()
# Emily.Compiler's options for the generation serving, e.g. --compile=true --overlap=false.
defn_options =
  for name <- [:compile, :overlap, :fuse],
      value = D.option(argv, "#{name}", nil),
      do: {name, value == "true"}

needed =
  if("qwen" in only, do: Enum.map(types, &"qwen3-#{&1}"), else: []) ++
    if "bert" in only, do: ["bert-f32"], else: []

for m <- needed, not File.exists?(Path.join([dir, m, "config.json"])) do
  raise "#{Path.join(dir, m)} is missing: run `python3 bench/make_models.py #{dir}` first"
end

IO.puts("""
bench/models.exs #{Enum.join(argv, " ")}
MLX #{Emily.mlx_version()} on #{Emily.default_device()}#{if bumblebee?, do: "; Nx #{Application.spec(:nx, :vsn)}, Bumblebee #{Application.spec(:bumblebee, :vsn)}", else: "; no Bumblebee"}; #{:erlang.system_info(:logical_processors_available)} logical CPUs; load average #{D.load_average()}
""")

bw = M.python(["bandwidth"])

IO.puts(
  "Memory bandwidth: copy #{D.f(bw[:copy_gbs], 1)} GB/s (read + written, numpy), " <>
    "read #{D.f(bw[:read_gbs], 1)} GB/s (sum, PyTorch)\n"
)

prompt = D.prompt()
ids_file = Path.join(System.tmp_dir!(), "bench_models_ids_#{System.unique_integer([:positive])}")
# (bench/make_models.py's tokenizer gives each byte its value as id: Emily's side checks.)
File.write!(ids_file, prompt |> :binary.bin_to_list() |> Enum.join(" "))
gpu? = Emily.default_device() == :gpu

qwen =
  if "qwen" in only do
    for {type, i} <- Enum.with_index(types) do
      ckpt = Path.join(dir, "qwen3-#{type}")
      IO.puts("Qwen3 #{type} (#{ckpt}), load average #{D.load_average()}")

      # Each side loaded once (Emily's serving started and its graph lowered, the Python
      # sides' servers warmed up), then alternated round by round.
      device = fn impl -> if gpu?, do: if(impl == "mlx", do: "gpu", else: "cuda"), else: "cpu" end
      emily = if bumblebee?, do: Bench.Models.Emily.start(ckpt, type, prompt, new, defn_options)

      ports =
        for impl <- ["mlx", "torch"], do: M.generator(impl, ckpt, ids_file, new, device.(impl))

      [mlx, torch] = ports

      sides =
        Enum.filter(
          [
            emily: emily && fn -> Bench.Models.Emily.generation(elem(emily, 1), prompt, new) end,
            mlx: mlx && fn -> M.generation(mlx, ids_file) end,
            torch: torch && fn -> M.generation(torch, ids_file) end
          ],
          &elem(&1, 1)
        )

      # Emily first, then the others; the next round (and type) in the reverse order.
      runs =
        for round <- 1..rounds//1, reduce: %{} do
          acc ->
            order = if rem(i + round, 2) == 1, do: sides, else: Enum.reverse(sides)

            for {name, side} <- order, reduce: acc do
              acc ->
                r = side.()
                Map.update(acc, name, [r], &[r | &1])
            end
        end

      for port <- ports, port, do: Port.close(port)

      with {pid, _setup} <- emily do
        D.stop(pid)
        :erlang.garbage_collect()
      end

      {type, Map.new(runs, fn {name, rs} -> {name, M.best_round(rs)} end)}
    end
  else
    []
  end

File.rm(ids_file)
File.rm(ids_file <> ".out")

bert =
  if "bert" in only and bumblebee? do
    IO.puts("BERT, load average #{D.load_average()}")
    Bench.Models.Emily.bert(Path.join(dir, "bert-f32"), [1, 8], pairs, gpu?)
  else
    []
  end

IO.puts("\nload average at the end #{D.load_average()}\n")

if qwen != [] do
  IO.puts("""
  Qwen3-0.6B shape, random weights, prompt 128, greedy #{new} tokens#{if rounds > 1, do: "; each side's best of #{rounds} alternated rounds (its prefill, graph building and peaks are the best round's)", else: ""}. Emily decode / this: Emily's tok/s over this side's, best round against best round, and median against median (below 1: Emily slower). Peak RSS of a type after the first is raised by what the VM kept from the ones before (glibc keeps freed pages).
  | type | side | prefill ms | decode tok/s | graph building ms a call | peak RSS MB | MLX peak MB | Emily decode / this (medians) | bound (read bandwidth) |
  |---|---|---|---|---|---|---|---|---|\
  """)

  for {type, r} <- qwen do
    bytes = M.qwen_weight_bytes(if type == :f32, do: 4, else: 2)
    # The host's bandwidth bounds a CPU decode; on a GPU the weights are read from its
    # own memory, which this run does not measure.
    bound = if not gpu? and bw[:read_gbs], do: bw.read_gbs * 1.0e9 / bytes

    for {side, label} <- [emily: "Bumblebee on Emily", mlx: "mlx-lm", torch: "transformers"],
        x = r[side] do
      IO.puts(
        "| #{type} | #{label} | #{D.f(x[:prefill_ms], 0)} | " <>
          "#{D.f(x.decode_tok_s, 2)}#{M.range(x.rounds)} | #{D.f(x[:build_ms], 2)} | " <>
          "#{D.f(x[:rss_peak_mb], 0)} | " <>
          "#{D.f(x[:mlx_peak_mb], 0)} | " <>
          "#{D.ratio(r[:emily] && r[:emily][:decode_tok_s], x.decode_tok_s)} " <>
          "(#{D.ratio(r[:emily] && Bench.median(r[:emily].rounds), Bench.median(x.rounds))}) | " <>
          "#{D.f(bound, 2)} tok/s (#{D.f(bytes / 1.0e9, 2)} GB/token) |"
      )
    end
  end

  IO.puts("")

  for {type, r} <- qwen do
    tok = fn side -> r[side] && r[side].tokens end
    e = r[:emily]

    IO.puts(
      "#{type} greedy ids: " <>
        Enum.join(
          [
            "Emily / mlx-lm: #{D.agreement(tok.(:emily), tok.(:mlx))}",
            "Emily / transformers: #{D.agreement(tok.(:emily), tok.(:torch))}",
            "mlx-lm / transformers: #{D.agreement(tok.(:mlx), tok.(:torch))}"
          ],
          "; "
        )
    )

    if e do
      b = e.breakdown

      IO.puts("""
        Emily #{type}: load #{D.f(e.setup.load_s, 1)} s (peak RSS after it #{D.f(e.setup.rss_loaded_mb, 0)} MB); first call (graph lowered) #{D.f(e.setup.first_call_s, 1)} s, same ids: #{e.first_call_tokens_equal}; best timed call #{D.f(e.total_s, 1)} s
        #{e.setup.rss_points}, #{D.f(e.rss_after_mb, 0)} MB after the best timed one; MLX active #{D.f(e.mlx_active_mb, 0)} MB, the VM's own memory #{D.f(:erlang.memory(:total) / 2 ** 20, 0)} MB
        best round, per token: #{b.passes} loop passes, #{b.calls} program calls in all (#{if b.overlapped, do: "each pass queued before the last one's condition is read", else: "each pass evaluated, then its condition read"}); a pass #{D.f(b.pass_ms, 1)} ms, from its program call to the next read #{D.f(b.call_to_read_ms, 2)} ms (medians); after the loop #{D.f(b.after_ms, 1)} ms\
      """)
    end
  end
end

if bert != [] do
  IO.puts("""

  BERT-base shape (12 layers, hidden 768), sequence 128, forward pass; #{pairs} paired windows (Bench.paired/6), medians.
  | batch | Bumblebee on Emily | transformers | ratio (q1-q3) | sequences/s Emily / transformers |
  |---|---|---|---|---|\
  """)

  for {b, r} <- bert do
    IO.puts(
      "| #{b} | #{D.f(r.emily / 1000, 1)} ms | #{D.f(r.python / 1000, 1)} ms | " <>
        "**#{D.f(r.ratio, 2)}** (#{D.f(r.q1, 2)}-#{D.f(r.q3, 2)}) | " <>
        "#{D.f(b / (r.emily / 1.0e6), 1)} / #{D.f(b / (r.python / 1.0e6), 1)} |"
    )
  end
end

if not bumblebee? do
  Code.require_file("gpu/decode.exs", __DIR__)

  unless Code.ensure_loaded?(GpuBench) do
    # What bench/gpu/decode.exs takes from bench/gpu/bench.exs (whose body runs its bench).
    defmodule GpuBench do
      alias Emily.Native, as: N
      def best(fun, reps, rounds \\ 5), do: Bench.best(fun, reps, rounds) / 1.0e6

      def data(s, shape, dtype) do
        x = N.sin(s, N.arange(s, 0, Tuple.product(shape), 1, {:f, 32}))
        N.astype(s, N.reshape(s, x, shape), dtype)
      end

      def eval_and_drop(t) do
        Emily.eval(t)
        Emily.release(t)
      end
    end
  end

  d = GpuDecode.run(Emily.Stream.default(Emily.default_device()))

  IO.puts("""

  No Bumblebee here: Emily's side is bench/gpu/decode.exs's hand-built Qwen3 bf16 decode step
  (a 512-long KV window): op by op #{D.f(d.op_by_op * 1.0e3, 2)} ms (#{D.f(1 / d.op_by_op, 1)} tok/s), as one Emily.Program #{D.f(d.program_eval * 1.0e3, 2)} ms (#{D.f(1 / d.program_eval, 1)} tok/s), compiled #{D.f(d.compiled * 1.0e3, 2)} ms
  """)
end
