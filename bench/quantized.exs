# Quantized decode: bench/make_models.py's Qwen3-0.6B-shaped decoder (bf16, random
# weights) through Bumblebee's text generation on Emily (`Emily.Compiler`), in bf16 and
# quantized by `Emily.Quantization.quantize_model/3` to 8 and 4 bits (affine, group 64),
# beside mlx-lm on the same libmlx quantizing the same bf16 checkpoint with its own
# `quantize_model` (bench/quantized.py), the sides alternated in one run.
#
#     python3 bench/make_models.py                       # once: $EMILY_CACHE/bench-models
#     MIX_ENV=test mix run path/to/emily/bench/quantized.exs [--variants=bf16,q8,q4]
#         [--modes=packed,dequantized,dequantized-f32] [--only=emily,mlx] [--new=64]
#         [--dir=DIR] [--tied=shared|copy] [--isolate=true|false]
#
# Run it from a Mix project with Emily, Nx 0.12 and Bumblebee as dependencies (Bumblebee
# 0.7 needs Nx 0.12). EMILY_PYTHONPATH (default $EMILY_CACHE/current) holds the `mlx`
# package on Emily's libmlx and mlx-lm, e.g.
# EMILY_PYTHONPATH=$EMILY_CACHE/current:/path/holding/mlx_lm, and `python3` on the PATH
# what mlx-lm imports (transformers). mlx-lm runs with OpenBLAS preloaded, as Emily links
# it. Without Bumblebee only mlx-lm's side runs.
#
# Variants: bf16 (the checkpoint as it is), q8 and q4. Emily quantizes every dense layer,
# the token embedding and the LM head (`embeddings: true`); the norms stay bf16. mlx-lm
# quantizes every Linear and its Embedding; its tied LM head multiplies by that quantized
# embedding (`as_linear`). So both quantize the same matrices. Bumblebee loads the tied
# LM head as a second copy of the embedding: with `--tied=shared` (the default) Emily's
# side points the head's kernel at the embedding's after quantizing (the same values:
# both are the same matrix quantized alike), as mlx-lm and `Emily.Quantization.load_mlx/2`
# share it; `--tied=copy` keeps Bumblebee's copy.
#
# `--modes`: Emily's quantized variants with the packed weights and MLX's
# `quantized_matmul` (`packed`: `packed: true`), dequantized once at load into bf16
# float layers (`dequantized`: `packed: false`), or the checkpoint loaded as f32 (as
# `Bumblebee.load_model/2` loads a bf16 checkpoint by default), quantized and dequantized
# into f32 float layers (`dequantized-f32`: its matmuls go through BLAS on the CPU; its
# quantized values differ from the others' by their f32 scales). Default: all three on
# the CPU, packed elsewhere (`quantize_model/3`'s default there).
#
# Each Emily variant runs in an OS process of its own (`mix run` of this file; with
# `--isolate=false`, in this VM): its peak RSS is then its own. It loads the checkpoint
# (`type: :bf16`), quantizes, evaluates the parameters (so that the bf16 originals are
# freed before the serving starts) and starts a `Bumblebee.Text.generation` serving
# (batch 1, sequence length 128) whose postprocessing returns the token ids, called
# twice: the first call lowers the graph and is reported apart; the second is the
# figure, traced as in bench/models.exs (`:erlang.trace` on Emily.Program.run/3,
# Emily.Program.eval/3 and Emily.to_list/1: per pass of the loop, its period and the
# host's time from its program call to the read).
#
# Prompt: 128 ASCII characters, one token each (bench/make_models.py's byte-level
# tokenizer); greedy, no end token, `--new` tokens. Prefill = from the call to the first
# token (on Emily, until the loop reads its condition after the prompt's pass); decode =
# tokens 2..N over the time from the first to the last. Weights = the bytes of the
# parameters (tensors and `Emily.QuantizedWeight`s, each counted once; mlx-lm: its
# parameters' nbytes). MLX peak = MLX's own peak during the timed generation
# (Emily.Memory, mx.get_peak_memory); peak RSS = the process's high-water mark during the
# timed generation (reset through /proc/self/clear_refs before it, on both sides), and
# from the process's start to the end of its loading (load RSS).
Code.require_file("support/bench.exs", __DIR__)
Code.require_file("support/decode.exs", __DIR__)

defmodule Bench.Quantized do
  @moduledoc false

  def bits("bf16"), do: 16
  def bits("q8"), do: 8
  def bits("q4"), do: 4

  def mb(nil), do: nil
  def mb(bytes), do: bytes / 2 ** 20

  def python(args, env) do
    Bench.python(Path.join(__DIR__, "quantized.py"), args, env)
  rescue
    e in [MatchError, ErlangError] ->
      IO.puts("  (mlx-lm: #{Exception.message(e) |> String.slice(0, 160)})")
      nil
  end
end

if Code.ensure_loaded?(Bumblebee) do
  defmodule Bench.Quantized.Emily do
    @moduledoc false
    alias Bench.Quantized, as: Q
    alias Bench.Decode, as: D

    # `{bytes, packed kernels}`: the bytes of the parameters' tensors, each once (a
    # shared tied head counts once), and the kernels that are quantized weights.
    def params_bytes(%{data: data}) do
      leaves =
        for {_layer, params} <- data, {_name, t} <- params, uniq: true do
          case t do
            %Emily.QuantizedWeight{value: v} -> {v.data.ref, Emily.QuantizedWeight.byte_size(t)}
            %Nx.Tensor{data: d} -> {d.ref, Nx.byte_size(t)}
          end
        end

      packed = for {_, p} <- data, {_, %Emily.QuantizedWeight{}} <- p, do: 1
      {leaves |> Enum.map(&elem(&1, 1)) |> Enum.sum(), length(packed)}
    end

    def evaluate(%{data: data}) do
      refs =
        for {_layer, params} <- data,
            {_name, t} <- params,
            %Nx.Tensor{data: %{ref: ref}} <- Nx.Defn.Composite.flatten_list([t]),
            uniq: true,
            do: ref

      Emily.eval(refs)
    end

    @head "language_modeling_head.output"
    @embedding "embedder.token_embedding"

    def share_tied(%{spec: spec, params: %{data: data} = state} = info) do
      if Map.get(spec, :tie_word_embeddings) == true and data[@head] != nil and
           data[@embedding] != nil do
        data = put_in(data, [@head, "kernel"], data[@embedding]["kernel"])
        %{info | params: %{state | data: data}}
      else
        info
      end
    end

    # `mode`: :float (the checkpoint as it is), :packed, :dequantized (bf16 float
    # layers), :dequantized_f32 (loaded as f32, then quantized and dequantized).
    def generate(dir, bits, mode, prompt, new, tied) do
      Bench.isolated(fn ->
        Nx.default_backend(Emily.Backend)
        D.reset_rss_peak()
        Emily.Memory.reset_peak()
        type = if mode == :dequantized_f32, do: :f32, else: :bf16

        {load_us, {:ok, info}} =
          :timer.tc(fn ->
            Bumblebee.load_model({:local, dir}, type: type, backend: Emily.Backend)
          end)

        {quantize_us, info} =
          :timer.tc(fn ->
            info =
              if mode == :float,
                do: info,
                else:
                  Emily.Quantization.quantize_model(info,
                    bits: bits,
                    group_size: 64,
                    embeddings: true,
                    packed: mode == :packed
                  )

            info = if tied == "shared", do: share_tied(info), else: info
            evaluate(info.params)
            info
          end)

        :erlang.garbage_collect()
        {weight_bytes, packed_layers} = params_bytes(info.params)
        mlx_loaded = Emily.Memory.stats()
        rss_load = D.rss_peak_mb()

        {pid, name} = D.start_generation(info, dir, prompt, new)
        # The serving holds the parameters; the copy here is dropped.
        info = nil
        _ = info
        :erlang.garbage_collect()

        Emily.Memory.reset_peak()
        {first_us, first_ids} = :timer.tc(fn -> Nx.Serving.batched_run(name, prompt) end)
        first_mlx_peak = Emily.Memory.stats().peak
        D.reset_rss_peak()
        Emily.Memory.reset_peak()
        {ids, t0, t1, events} = D.traced(fn -> Nx.Serving.batched_run(name, prompt) end)
        b = D.breakdown(t0, t1, events)
        mlx = Emily.Memory.stats()
        rss = D.rss_peak_mb()

        D.stop(pid)

        ^new = length(ids)

        %{
          tokens: ids,
          first_call_tokens_equal: first_ids == ids,
          load_s: (load_us + quantize_us) / 1.0e6,
          quantize_s: quantize_us / 1.0e6,
          weight_bytes: weight_bytes,
          packed_layers: packed_layers,
          mlx_loaded_mb: Q.mb(mlx_loaded.active),
          mlx_load_peak_mb: Q.mb(mlx_loaded.peak),
          first_call_s: first_us / 1.0e6,
          first_mlx_peak_mb: Q.mb(first_mlx_peak),
          prefill_ms: b.prefill_ms,
          decode_tok_s: (new - 1) / ((b.total_ms - b.prefill_ms - b.after_ms) / 1000),
          total_s: b.total_ms / 1000,
          rss_load_mb: rss_load,
          rss_peak_mb: rss,
          mlx_peak_mb: Q.mb(mlx.peak),
          breakdown: b
        }
      end)
    end
  end
end

alias Bench.Quantized, as: Q
alias Bench.Decode, as: D

argv = System.argv()
bumblebee? = Code.ensure_loaded?(Bumblebee)
gpu? = Emily.default_device() == :gpu
dir = D.models_dir(argv)
ckpt = Path.join(dir, "qwen3-bf16")
new = D.option(argv, "new", "64") |> String.to_integer()
tied = D.option(argv, "tied", "shared")
true = tied in ["shared", "copy"]

mode_names = %{
  "packed" => :packed,
  "dequantized" => :dequantized,
  "dequantized-f32" => :dequantized_f32
}

prompt = D.prompt()

case D.option(argv, "child", nil) do
  nil ->
    :run

  spec ->
    # One Emily variant, in this OS process: `BITS:MODE`, its result to --result.
    [bits, mode] = String.split(spec, ":")
    mode = String.to_existing_atom(mode)
    r = Bench.Quantized.Emily.generate(ckpt, String.to_integer(bits), mode, prompt, new, tied)
    File.write!(D.option(argv, "result", nil), :erlang.term_to_binary(r))
    System.halt(0)
end

variants = D.list_option(argv, "variants", "bf16,q8,q4")
true = Enum.all?(variants, &(&1 in ["bf16", "q8", "q4"]))

modes =
  D.list_option(argv, "modes", if(gpu?, do: "packed", else: "packed,dequantized,dequantized-f32"))
  |> Enum.map(&Map.fetch!(mode_names, &1))

only = D.list_option(argv, "only", "emily,mlx")

isolate? =
  D.option(argv, "isolate", "true") == "true" and Code.ensure_loaded?(Mix.Project) and
    System.find_executable("mix") != nil

if not File.exists?(Path.join(ckpt, "config.json")),
  do: raise("#{ckpt} is missing: run `python3 bench/make_models.py #{dir}` first")

IO.puts("""
bench/quantized.exs #{Enum.join(argv, " ")}
MLX #{Emily.mlx_version()} on #{Emily.default_device()}#{if bumblebee?, do: "; Nx #{Application.spec(:nx, :vsn)}, Bumblebee #{Application.spec(:bumblebee, :vsn)}", else: "; no Bumblebee: mlx-lm's side only"}; #{:erlang.system_info(:logical_processors_available)} logical CPUs; load average #{D.load_average()}
""")

label = fn
  {:emily, :float} -> "Emily"
  {:emily, :packed} -> "Emily packed"
  {:emily, :dequantized} -> "Emily dequantized"
  {:emily, :dequantized_f32} -> "Emily dequantized f32"
  :mlx -> "mlx-lm"
end

ids_file =
  Path.join(System.tmp_dir!(), "bench_quantized_ids_#{System.unique_integer([:positive])}")

File.write!(ids_file, prompt |> :binary.bin_to_list() |> Enum.join(" "))

emily_side = fn bits, mode ->
  IO.puts("  #{label.({:emily, mode})}, load average #{D.load_average()}")

  if isolate? do
    result = ids_file <> ".emily"

    args =
      ["run", "--no-compile", "--no-deps-check", __ENV__.file] ++
        ["--child=#{bits}:#{mode}", "--result=#{result}", "--new=#{new}", "--dir=#{dir}"] ++
        ["--tied=#{tied}"]

    {_, status} = System.cmd(System.find_executable("mix"), args, into: IO.stream())
    r = if status == 0, do: result |> File.read!() |> :erlang.binary_to_term()
    File.rm(result)
    if r == nil, do: IO.puts("  (#{label.({:emily, mode})}: exited #{status})")
    r
  else
    Bench.Quantized.Emily.generate(ckpt, bits, mode, prompt, new, tied)
  end
end

mlx_side = fn bits ->
  IO.puts("  mlx-lm, load average #{D.load_average()}")
  device = if gpu?, do: "gpu", else: "cpu"
  env = [{"LD_PRELOAD", "libopenblas.so.0"}]
  r = Q.python(["generate", ckpt, ids_file, "#{new}", "#{bits}", device], env)
  r && Map.put(r, :tokens, D.read_ids(ids_file <> ".out"))
end

results =
  for {variant, i} <- Enum.with_index(variants) do
    bits = Q.bits(variant)
    IO.puts("#{variant} (#{ckpt}), load average #{D.load_average()}")
    variant_modes = if bits == 16, do: [:float], else: modes

    emily =
      if "emily" in only and bumblebee?,
        do: for(m <- variant_modes, do: {{:emily, m}, fn -> emily_side.(bits, m) end}),
        else: []

    mlx = if "mlx" in only, do: [{:mlx, fn -> mlx_side.(bits) end}], else: []
    # Emily first, then mlx-lm; the next variant in the reverse order.
    sides = if rem(i, 2) == 0, do: emily ++ mlx, else: Enum.reverse(emily ++ mlx)
    {variant, Map.new(sides, fn {k, side} -> {k, side.()} end)}
  end

File.rm(ids_file)
File.rm(ids_file <> ".out")

IO.puts("\nload average at the end #{D.load_average()}\n")

get = fn r, key -> r && (r[key] || r[Atom.to_string(key)]) end
by = Map.new(results)
emily_bf16 = get.(by["bf16"][{:emily, :float}], :weight_bytes)
mlx_bf16 = get.(by["bf16"][:mlx], :weight_bytes)

IO.puts("""
Qwen3-0.6B shape, random weights (bf16 checkpoint), affine group 64, prompt 128, greedy #{new} tokens; tied LM head #{tied} on Emily's side. weights: the parameters' bytes, / bf16: over the same side's bf16 variant. Emily / mlx-lm: decode tok/s over mlx-lm's of the same variant (above 1: Emily faster), prefill time over mlx-lm's (below 1: Emily faster). Peak RSS and MLX peak: during the timed generation; load RSS: the process's peak up to the end of loading.
| variant | side | weights MB | / bf16 | prefill ms | decode tok/s | MLX peak MB | peak RSS MB | load RSS MB | Emily / mlx-lm decode | Emily / mlx-lm prefill |
|---|---|---|---|---|---|---|---|---|---|---|\
""")

# Emily's rows (packed first), then mlx-lm's.
order = [{:emily, :float} | Enum.map([:packed, :dequantized, :dequantized_f32], &{:emily, &1})]
sides = fn r -> Enum.filter(order ++ [:mlx], &r[&1]) end

for {variant, r} <- results, side <- sides.(r) do
  x = r[side]
  m = r[:mlx]
  emily? = side != :mlx
  base = if emily?, do: emily_bf16, else: mlx_bf16

  IO.puts(
    "| #{variant} | #{label.(side)} | #{D.f(Q.mb(get.(x, :weight_bytes)), 0)} | " <>
      "#{D.ratio(get.(x, :weight_bytes), base)} | #{D.f(get.(x, :prefill_ms), 0)} | " <>
      "#{D.f(get.(x, :decode_tok_s), 2)} | #{D.f(get.(x, :mlx_peak_mb), 0)} | " <>
      "#{D.f(get.(x, :rss_peak_mb), 0)} | #{D.f(get.(x, :rss_load_mb), 0)} | " <>
      if(emily?,
        do:
          "#{D.ratio(get.(x, :decode_tok_s), get.(m, :decode_tok_s))} | " <>
            "#{D.ratio(get.(x, :prefill_ms), get.(m, :prefill_ms))} |",
        else: "— | — |"
      )
  )
end

tok_s = fn variant, side -> get.(by[variant][side], :decode_tok_s) end

# The faster of Emily's quantized modes (label and tok/s).
emily_best = fn variant ->
  for({:emily, m} = side <- order, m != :float, t = tok_s.(variant, side), do: {t, label.(side)})
  |> Enum.max(fn -> {nil, "—"} end)
end

{mlx_best, mlx_best_variant} =
  for(v <- variants, t = tok_s.(v, :mlx), do: {t, v}) |> Enum.max(fn -> {nil, "—"} end)

IO.puts("\nTargets:")

if by["q4"] do
  IO.puts(
    "  q4 weights / bf16: Emily #{D.ratio(get.(by["q4"][{:emily, :packed}], :weight_bytes), emily_bf16)} " <>
      "(target <= 0.30), mlx-lm #{D.ratio(get.(by["q4"][:mlx], :weight_bytes), mlx_bf16)}"
  )

  IO.puts(
    "  q4 decode, Emily packed / mlx-lm: " <>
      "#{D.ratio(tok_s.("q4", {:emily, :packed}), tok_s.("q4", :mlx))} (target >= 1.0 on a GPU)"
  )
end

if not gpu? do
  for variant <- variants, variant != "bf16" do
    {best, best_label} = emily_best.(variant)

    IO.puts(
      "  #{variant} decode, the faster Emily mode (#{best_label}) over mlx-lm's fastest variant " <>
        "(#{mlx_best_variant}, #{D.f(mlx_best, 2)} tok/s): #{D.ratio(best, mlx_best)} " <>
        "(target >= 1.0 on the CPU); over mlx-lm's #{variant}: #{D.ratio(best, tok_s.(variant, :mlx))}"
    )
  end
end

IO.puts("\nGreedy ids (the first 6 of each side, then where pairs part):")
tokens = fn variant, side -> get.(by[variant][side], :tokens) end

for variant <- variants, r = by[variant], r != %{} do
  firsts =
    for side <- sides.(r), ids = tokens.(variant, side) do
      "#{label.(side)} #{ids |> Enum.take(6) |> Enum.join(" ")}"
    end

  emily_sides = for side <- sides.(r), side != :mlx, do: side
  with_mlx = for side <- emily_sides, r[:mlx], do: {side, :mlx}
  among = for [a, b] <- Enum.chunk_every(emily_sides, 2, 1, :discard), do: {a, b}

  pairs =
    for {a, b} <- with_mlx ++ among do
      "#{label.(a)} / #{label.(b)}: #{D.agreement(tokens.(variant, a), tokens.(variant, b))}"
    end

  IO.puts("  #{variant}: #{Enum.join(firsts, "; ")}")
  if pairs != [], do: IO.puts("    #{Enum.join(pairs, "; ")}")
end

IO.puts("")

for {variant, r} <- results, side <- sides.(r) do
  x = r[side]

  if side == :mlx do
    IO.puts(
      "mlx-lm #{variant}: load and quantize #{D.f(x["load_s"], 1)} s; " <>
        "#{D.f(x["quantized_layers"], 0)} layers quantized, #{D.f(x["float_layers"], 0)} Linear/Embedding left float; " <>
        "timed call #{D.f(x["total_s"], 1)} s"
    )
  else
    b = x.breakdown

    IO.puts("""
    #{label.(side)} #{variant}: load #{D.f(x.load_s, 1)} s (quantize and evaluate #{D.f(x.quantize_s, 1)} s), #{x.packed_layers} packed kernels, MLX active after it #{D.f(x.mlx_loaded_mb, 0)} MB (peak #{D.f(x.mlx_load_peak_mb, 0)}); first call (graph lowered) #{D.f(x.first_call_s, 1)} s, MLX peak #{D.f(x.first_mlx_peak_mb, 0)} MB, same ids: #{x.first_call_tokens_equal}; timed call #{D.f(x.total_s, 1)} s
      per token: #{b.passes} loop passes, #{b.calls} program calls (#{if b.overlapped, do: "each pass queued before the last one's condition is read", else: "each pass evaluated, then its condition read"}); a pass #{D.f(b.pass_ms, 1)} ms, from its program call to the next read #{D.f(b.call_to_read_ms, 2)} ms (medians); after the loop #{D.f(b.after_ms, 1)} ms\
    """)
  end
end
