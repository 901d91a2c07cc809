# Model-level figures: a Qwen3-0.6B-shaped decoder's greedy generation and a
# BERT-base-shaped encoder's forward pass through Bumblebee on Emily (`Emily.Compiler`),
# beside mlx-lm (on the same libmlx) and Transformers on PyTorch (bench/models.py), the
# sides alternated in one run, on the random checkpoints bench/make_models.py makes.
#
#     python3 bench/make_models.py                       # once: $EMILY_CACHE/bench-models
#     MIX_ENV=test mix run path/to/emily/bench/models.exs [--only=qwen,bert]
#         [--types=f32,bf16] [--new=64] [--pairs=5] [--dir=DIR] [--trace-file=PATH]
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
# postprocessing returns the token ids, called twice: the first call lowers the graph
# (Nx.Serving initialises a batch key's computation on first use) and is reported apart;
# the second is the figure. mlx-lm runs `generate_step`, Transformers `generate`, each
# after a 2-token warm-up. Prefill = from the call to the first token (on Emily, until
# the generation loop reads its condition after the prompt's pass); decode = tokens 2..N
# over the time from the first to the last. Peak RSS is the process's high-water mark
# from loading on (/proc/self/clear_refs reset before Emily's load); MLX peak is MLX's
# own (Emily.Memory). The three sides' token ids are compared; bf16 sides round
# differently and part at some step, which is printed.
#
# Emily's per-token breakdown: the second call is traced (`:erlang.trace` on
# Emily.Program.run/3, Emily.Program.eval/3 and Emily.to_list/1, call times only): each
# pass of the loop is one program call, queued before the previous pass's condition is
# read (Emily.Compiler's `overlap`), and one read; a pass's period, and the host's time
# from its program call to the read (building and queueing it).
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

defmodule Bench.Models do
  @moduledoc false

  def option(argv, name, default) do
    Enum.find_value(argv, default, fn arg ->
      case String.split(arg, "=", parts: 2) do
        ["--" <> ^name, value] -> value
        _ -> nil
      end
    end)
  end

  def load_average,
    do: File.read!("/proc/loadavg") |> String.split() |> Enum.take(3) |> Enum.join(" ")

  # Resets the process's peak RSS (VmHWM) to its current RSS.
  def reset_rss_peak, do: File.write("/proc/self/clear_refs", "5")

  def rss_peak_mb, do: status_mb("VmHWM")
  def rss_mb, do: status_mb("VmRSS")

  defp status_mb(field) do
    [_, kb] = Regex.run(~r/#{field}:\s+(\d+) kB/, File.read!("/proc/self/status"))
    String.to_integer(kb) / 1024
  end

  def python(args, env \\ []), do: Bench.python(Path.join(__DIR__, "models.py"), args, env)

  # A Python side that may be missing (mlx-lm on a GPU host, say): nil then.
  def python_maybe(args, env \\ []) do
    python(args, env)
  rescue
    e in [MatchError, ErlangError] ->
      IO.puts("  (#{Enum.at(args, 1)}: #{Exception.message(e) |> String.slice(0, 120)})")
      nil
  end

  # The bytes of weights one decode token reads: every layer's matrices, the final
  # norm, and the tied embedding once, as the LM head (the embedding lookup reads one
  # row). Qwen3-0.6B's shape.
  def qwen_weight_bytes(bytes_per) do
    {h, nq, nkv, d, f, vocab, layers} = {1024, 16, 8, 128, 3072, 151_936, 28}
    per_layer = h * nq * d + 2 * h * nkv * d + nq * d * h + 3 * h * f + 2 * h + 2 * d
    (layers * per_layer + h + vocab * h) * bytes_per
  end

  def f(nil, _), do: "—"
  def f(x, decimals), do: :erlang.float_to_binary(x * 1.0, decimals: decimals)

  def ratio(a, b) when is_number(a) and is_number(b) and b != 0, do: f(a / b, 2)
  def ratio(_, _), do: "—"

  # Where two token lists first differ (nil when equal).
  def parting(a, b) do
    Enum.zip(a, b) |> Enum.find_index(fn {x, y} -> x != y end) ||
      if length(a) == length(b), do: nil, else: min(length(a), length(b))
  end

  def agreement(name, a, b) do
    case {a, b} do
      {nil, _} -> "#{name}: —"
      {_, nil} -> "#{name}: —"
      _ -> "#{name}: " <> agreement_text(parting(a, b), length(a))
    end
  end

  defp agreement_text(nil, n), do: "all #{n} equal"
  defp agreement_text(i, n), do: "first #{i} of #{n} equal, part at token #{i + 1}"

  def read_ids(path),
    do: path |> File.read!() |> String.split() |> Enum.map(&String.to_integer/1)
end

if Code.ensure_loaded?(Bumblebee) do
  defmodule Bench.Models.Emily do
    @moduledoc false
    alias Bench.Models, as: M

    # A loop pass's program calls (queued or evaluated) and condition reads, timed by
    # call tracing: the call messages carry arities only (no tensors), so the trace
    # holds no arrays.
    @traced [{Emily.Program, :eval, 3}, {Emily.Program, :run, 3}, {Emily, :to_list, 1}]

    def traced(fun) do
      me = self()
      tracer = spawn(fn -> collect(me, []) end)
      for mfa <- @traced, do: :erlang.trace_pattern(mfa, true, [:global])
      :erlang.trace(:all, true, [:call, :arity, :monotonic_timestamp, {:tracer, tracer}])
      t0 = System.monotonic_time()
      result = fun.()
      t1 = System.monotonic_time()
      :erlang.trace(:all, false, [:call])
      for mfa <- @traced, do: :erlang.trace_pattern(mfa, false, [:global])
      send(tracer, :done)

      events =
        receive do
          {:events, events} -> events
        end

      {result, t0, t1, events}
    end

    defp collect(parent, acc) do
      receive do
        {:trace_ts, _pid, :call, {m, f, _a}, ts} ->
          collect(parent, [{{m, f}, ts} | acc])

        :done ->
          # (Messages the VM sent before the trace stopped are already in the mailbox.)
          send(parent, {:events, drain(acc) |> Enum.reverse()})
      end
    end

    defp drain(acc) do
      receive do
        {:trace_ts, _pid, :call, {m, f, _a}, ts} -> drain([{{m, f}, ts} | acc])
      after
        0 -> acc
      end
    end

    @doc """
    The per-token breakdown of a traced generation: each pass of the loop is a program
    call (`Emily.Program.run/3`, queued, where the loop overlaps; else
    `Emily.Program.eval/3`) and a read of a condition. Returns the prefill (from the call
    to the first condition read), the period between condition reads (a token's time),
    and the time from a pass's program call to the next read, in ms (medians): where
    the loop overlaps, the host's cost of building and queueing a pass, which the
    device's work on the pass before hides while it is the shorter; else the pass's
    whole evaluation.
    """
    def breakdown(t0, t1, events) do
      ms = fn native -> System.convert_time_unit(native, :native, :microsecond) / 1000 end
      reads = for {{Emily, :to_list}, ts} <- events, do: ts
      calls = for {{Emily.Program, f}, ts} <- events, f in [:run, :eval], do: {f, ts}
      queued = Enum.count(calls, &(elem(&1, 0) == :run))
      first_read = hd(reads)

      to_read =
        for [prev, read] <- Enum.chunk_every(reads, 2, 1, :discard) do
          {_, start} =
            calls |> Enum.filter(&(elem(&1, 1) > prev and elem(&1, 1) < read)) |> List.last()

          ms.(read - start)
        end

      periods = for [a, b] <- Enum.chunk_every(reads, 2, 1, :discard), do: ms.(b - a)

      %{
        prefill_ms: ms.(first_read - t0),
        passes: length(periods),
        calls: length(calls),
        overlapped: queued > 0,
        pass_ms: Bench.median(periods),
        call_to_read_ms: Bench.median(to_read),
        after_ms: ms.(t1 - List.last(reads)),
        total_ms: ms.(t1 - t0)
      }
    end

    def generate(dir, type, prompt, new, defn_options) do
      Bench.isolated(fn ->
        Nx.default_backend(Emily.Backend)
        M.reset_rss_peak()
        Emily.Memory.reset_peak()

        {load_us, {:ok, info}} =
          :timer.tc(fn ->
            Bumblebee.load_model({:local, dir}, type: type, backend: Emily.Backend)
          end)

        rss_loaded = M.rss_peak_mb()
        {:ok, tokenizer} = Bumblebee.load_tokenizer({:local, dir})
        # The Python sides are given the prompt's bytes as its ids.
        tokens = Bumblebee.apply_tokenizer(tokenizer, prompt)["input_ids"] |> Nx.to_flat_list()

        if tokens != :binary.bin_to_list(prompt),
          do: raise("#{dir}: the tokenizer is not bench/make_models.py's byte-level one")

        {:ok, config} = Bumblebee.load_generation_config({:local, dir})

        config =
          Bumblebee.configure(config,
            max_new_tokens: new,
            eos_token_id: nil,
            pad_token_id: info.spec.pad_token_id || 151_643
          )

        serving =
          Bumblebee.Text.generation(info, tokenizer, config,
            compile: [batch_size: 1, sequence_length: byte_size(prompt)],
            defn_options: [compiler: Emily.Compiler] ++ defn_options
          )
          |> Nx.Serving.client_postprocessing(fn {%{token_ids: ids}, _meta}, _info ->
            Nx.to_flat_list(ids)
          end)

        name = :"bench_models_#{System.unique_integer([:positive])}"
        {:ok, pid} = Nx.Serving.start_link(serving: serving, name: name, batch_size: 1)
        # The serving holds the parameters; the loaded copy here is dropped.
        info = nil
        _ = info
        :erlang.garbage_collect()

        rss_started = M.rss_mb()
        Emily.Memory.reset_peak()
        {first_us, first_ids} = :timer.tc(fn -> Nx.Serving.batched_run(name, prompt) end)
        {rss_first, rss_first_peak} = {M.rss_mb(), M.rss_peak_mb()}
        first_mlx_peak = Emily.Memory.stats().peak
        Emily.Memory.reset_peak()
        {ids, t0, t1, events} = traced(fn -> Nx.Serving.batched_run(name, prompt) end)
        b = breakdown(t0, t1, events)
        mlx = Emily.Memory.stats()
        {rss_timed, rss} = {M.rss_mb(), M.rss_peak_mb()}

        Process.unlink(pid)
        ref = Process.monitor(pid)
        Process.exit(pid, :shutdown)

        receive do
          {:DOWN, ^ref, _, _, _} -> :ok
        end

        {ids_tokens, ^new} = {ids, length(ids)}

        %{
          tokens: ids_tokens,
          first_call_tokens_equal: first_ids == ids,
          load_s: load_us / 1.0e6,
          first_call_s: first_us / 1.0e6,
          prefill_ms: b.prefill_ms,
          decode_tok_s: (new - 1) / ((b.total_ms - b.prefill_ms - b.after_ms) / 1000),
          total_s: b.total_ms / 1000,
          rss_loaded_mb: rss_loaded,
          rss_points:
            "RSS #{M.f(rss_started, 0)} MB with the serving started, " <>
              "#{M.f(rss_first, 0)} MB after the first call (peak #{M.f(rss_first_peak, 0)}; " <>
              "MLX peak #{M.f(first_mlx_peak / 2 ** 20, 0)} MB), " <>
              "#{M.f(rss_timed, 0)} MB after the timed one; MLX active #{M.f(mlx.active / 2 ** 20, 0)} MB, " <>
              "the VM's own memory #{M.f(:erlang.memory(:total) / 2 ** 20, 0)} MB",
          rss_peak_mb: rss,
          mlx_peak_mb: mlx.peak / 2 ** 20,
          breakdown: b
        }
      end)
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

argv = System.argv()
bumblebee? = Code.ensure_loaded?(Bumblebee)
cache = System.get_env("EMILY_CACHE", Path.expand("~/.cache/emily"))
dir = M.option(argv, "dir", Path.join(cache, "bench-models"))
only = M.option(argv, "only", "qwen,bert") |> String.split(",")
types = M.option(argv, "types", "f32,bf16") |> String.split(",") |> Enum.map(&String.to_atom/1)
new = M.option(argv, "new", "64") |> String.to_integer()
pairs = M.option(argv, "pairs", "5") |> String.to_integer()
# Emily.Compiler's options for the generation serving, e.g. --compile=true --overlap=false.
defn_options =
  for name <- [:compile, :overlap, :fuse],
      value = M.option(argv, "#{name}", nil),
      do: {name, value == "true"}

for m <- ["qwen3-f32", "qwen3-bf16", "bert-f32"],
    not File.exists?(Path.join([dir, m, "config.json"])) do
  raise "#{Path.join(dir, m)} is missing: run `python3 bench/make_models.py #{dir}` first"
end

IO.puts("""
bench/models.exs #{Enum.join(argv, " ")}
MLX #{Emily.mlx_version()} on #{Emily.default_device()}#{if bumblebee?, do: "; Nx #{Application.spec(:nx, :vsn)}, Bumblebee #{Application.spec(:bumblebee, :vsn)}", else: "; no Bumblebee"}; #{:erlang.system_info(:logical_processors_available)} logical CPUs; load average #{M.load_average()}
""")

bw = M.python(["bandwidth"])

IO.puts(
  "Memory bandwidth: copy #{M.f(bw["copy_gbs"], 1)} GB/s (read + written, numpy), " <>
    "read #{M.f(bw["read_gbs"], 1)} GB/s (sum, PyTorch)\n"
)

# A 128-character ASCII prompt: 128 tokens.
prompt =
  "Emily runs Nx on MLX through a Rust NIF; this prompt is exactly one hundred and " <>
    "twenty-eight bytes long, one token per byte. OK!"

128 = byte_size(prompt)
ids_file = Path.join(System.tmp_dir!(), "bench_models_ids_#{System.unique_integer([:positive])}")
# (bench/make_models.py's tokenizer gives each byte its value as id: Emily's side checks.)
File.write!(ids_file, prompt |> :binary.bin_to_list() |> Enum.join(" "))
gpu? = Emily.default_device() == :gpu

qwen =
  if "qwen" in only do
    for {type, i} <- Enum.with_index(types) do
      ckpt = Path.join(dir, "qwen3-#{type}")
      IO.puts("Qwen3 #{type} (#{ckpt}), load average #{M.load_average()}")

      python_side = fn impl ->
        env = if impl == "mlx", do: [{"LD_PRELOAD", "libopenblas.so.0"}], else: []
        device = if gpu?, do: if(impl == "mlx", do: "gpu", else: "cuda"), else: "cpu"
        r = M.python_maybe(["generate", impl, ckpt, ids_file, "#{new}", device], env)
        r && Map.put(r, :tokens, M.read_ids(ids_file <> ".out"))
      end

      emily_side = fn ->
        if bumblebee?, do: Bench.Models.Emily.generate(ckpt, type, prompt, new, defn_options)
      end

      # Emily first, then the others; the next type in the reverse order.
      sides = [
        emily: emily_side,
        mlx: fn -> python_side.("mlx") end,
        torch: fn -> python_side.("torch") end
      ]

      sides = if rem(i, 2) == 0, do: sides, else: Enum.reverse(sides)
      results = for {name, side} <- sides, into: %{}, do: {name, side.()}
      {type, results}
    end
  else
    []
  end

File.rm(ids_file)
File.rm(ids_file <> ".out")

bert =
  if "bert" in only and bumblebee? do
    IO.puts("BERT, load average #{M.load_average()}")
    Bench.Models.Emily.bert(Path.join(dir, "bert-f32"), [1, 8], pairs, gpu?)
  else
    []
  end

IO.puts("\nload average at the end #{M.load_average()}\n")

if qwen != [] do
  IO.puts("""
  Qwen3-0.6B shape, random weights, prompt 128, greedy #{new} tokens. Emily decode / this: Emily's tok/s over this side's (below 1: Emily slower). Peak RSS of a type after the first is raised by what the VM kept from the ones before (glibc keeps freed pages).
  | type | side | prefill ms | decode tok/s | peak RSS MB | MLX peak MB | Emily decode / this | bound (read bandwidth) |
  |---|---|---|---|---|---|---|---|\
  """)

  for {type, r} <- qwen do
    bytes = M.qwen_weight_bytes(if type == :f32, do: 4, else: 2)
    # The host's bandwidth bounds a CPU decode; on a GPU the weights are read from its
    # own memory, which this run does not measure.
    bound = if not gpu? and bw["read_gbs"], do: bw["read_gbs"] * 1.0e9 / bytes

    for {side, label} <- [emily: "Bumblebee on Emily", mlx: "mlx-lm", torch: "transformers"],
        x = r[side] do
      IO.puts(
        "| #{type} | #{label} | #{M.f(x[:prefill_ms] || x["prefill_ms"], 0)} | " <>
          "#{M.f(x[:decode_tok_s] || x["decode_tok_s"], 2)} | #{M.f(x[:rss_peak_mb] || x["rss_peak_mb"], 0)} | " <>
          "#{M.f(x[:mlx_peak_mb] || x["mlx_peak_mb"], 0)} | " <>
          "#{M.ratio(r[:emily][:decode_tok_s], x[:decode_tok_s] || x["decode_tok_s"])} | " <>
          "#{M.f(bound, 2)} tok/s (#{M.f(bytes / 1.0e9, 2)} GB/token) |"
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
            M.agreement("Emily / mlx-lm", tok.(:emily), tok.(:mlx)),
            M.agreement("Emily / transformers", tok.(:emily), tok.(:torch)),
            M.agreement("mlx-lm / transformers", tok.(:mlx), tok.(:torch))
          ],
          "; "
        )
    )

    if e do
      b = e.breakdown

      IO.puts("""
        Emily #{type}: load #{M.f(e.load_s, 1)} s (peak RSS after it #{M.f(e.rss_loaded_mb, 0)} MB); first call (graph lowered) #{M.f(e.first_call_s, 1)} s, same ids: #{e.first_call_tokens_equal}; timed call #{M.f(e.total_s, 1)} s
        #{e.rss_points}
        per token: #{b.passes} loop passes, #{b.calls} program calls in all (#{if b.overlapped, do: "each pass queued before the last one's condition is read", else: "each pass evaluated, then its condition read"}); a pass #{M.f(b.pass_ms, 1)} ms, from its program call to the next read #{M.f(b.call_to_read_ms, 2)} ms (medians); after the loop #{M.f(b.after_ms, 1)} ms\
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
      "| #{b} | #{M.f(r.emily / 1000, 1)} ms | #{M.f(r.python / 1000, 1)} ms | " <>
        "**#{M.f(r.ratio, 2)}** (#{M.f(r.q1, 2)}-#{M.f(r.q3, 2)}) | " <>
        "#{M.f(b / (r.emily / 1.0e6), 1)} / #{M.f(b / (r.python / 1.0e6), 1)} |"
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
  (a 512-long KV window): op by op #{M.f(d.op_by_op * 1.0e3, 2)} ms (#{M.f(1 / d.op_by_op, 1)} tok/s), as one Emily.Program #{M.f(d.program_eval * 1.0e3, 2)} ms (#{M.f(1 / d.program_eval, 1)} tok/s), compiled #{M.f(d.compiled * 1.0e3, 2)} ms
  """)
end
