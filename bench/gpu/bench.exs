# GPU figures: Emily beside Python MLX (the same libmlx) and PyTorch, in one run.
#
#     bin/emily-run bench/gpu/bench.exs [--decode]          (in a bundle, see README)
#     mix run --no-deps-check bench/gpu/bench.exs [--decode] (in a checkout)
#
# EMILY_PYTHONPATH names the folder holding the `mlx` Python package that sits on the
# same libmlx as Emily (default: $EMILY_CACHE/current). Prints a markdown table.
alias Emily.Native, as: N

decode? = "--decode" in System.argv()

Code.require_file("../support/bench.exs", __DIR__)

defmodule GpuBench do
  alias Emily.Native, as: N

  # Best mean seconds per call.
  def best(fun, reps, rounds \\ 5), do: Bench.best(fun, reps, rounds) / 1.0e6

  # sin(0, 1, 2, ...) in `dtype`: the same data the references build.
  def data(s, shape, dtype) do
    n = Tuple.product(shape)
    x = N.sin(s, N.arange(s, 0, n, 1, {:f, 32}))
    N.astype(s, N.reshape(s, x, shape), dtype)
  end

  # Evaluates `t` and lets it go at once, as Python's reference counting does: the BEAM
  # frees a dropped tensor at its next garbage collection, and until then MLX cannot reuse
  # its buffer (every call would allocate a fresh GiB).
  def eval_and_drop(t) do
    Emily.eval(t)
    :erlang.garbage_collect()
  end

  def figures(s) do
    x = N.full(s, {}, 0.0, {:f, 32})
    one = N.full(s, {}, 1.0, {:f, 32})
    Emily.eval([x, one])

    lazy = best(fn -> Enum.each(1..100, fn _ -> N.add(s, x, one) end) end, 20) / 100
    op_eval = best(fn -> Emily.eval(N.add(s, x, one)) end, 500)
    op_read = best(fn -> Emily.to_binary(N.add(s, x, one)) end, 500)

    n = 8192

    matmuls =
      for {name, dt} <- [{"bf16", {:bf, 16}}, {"f16", {:f, 16}}, {"f32", {:f, 32}}] do
        a = data(s, {n, n}, dt)
        b = data(s, {n, n}, dt)
        Emily.eval([a, b])
        t = best(fn -> eval_and_drop(N.matmul(s, a, b)) end, 10, 3)
        {"emily_matmul_#{name}_tflops", 2 * n ** 3 / t / 1.0e12}
      end

    m = 256 * 1024 * 1024
    big = N.full(s, {m}, 1.5, {:f, 32})
    two = N.full(s, {}, 2.0, {:f, 32})
    Emily.eval([big, two])
    t = best(fn -> eval_and_drop(N.multiply(s, big, two)) end, 10, 3)

    Map.new(
      [
        {"emily_lazy_op_us", lazy * 1.0e6},
        {"emily_op_eval_us", op_eval * 1.0e6},
        {"emily_op_read_us", op_read * 1.0e6},
        {"emily_elementwise_tbs", 2 * m * 4 / t / 1.0e12}
      ] ++ matmuls
    )
  end
end

s = Emily.Stream.default(:gpu)
emily = GpuBench.figures(s)

emily =
  if decode? do
    Code.require_file(Path.join(__DIR__, "decode.exs"))
    d = GpuDecode.run(s)

    Map.merge(emily, %{
      "emily_decode_ms" => d.op_by_op * 1.0e3,
      "emily_decode_program_ms" => d.program * 1.0e3,
      "emily_decode_compiled_ms" => d.compiled * 1.0e3,
      "emily_decode_max_diff" => d.max_diff
    })
  else
    emily
  end

ref = Bench.python(Path.join(__DIR__, "reference.py"), if(decode?, do: ["--decode"], else: []))

f = fn
  nil -> "—"
  x -> :erlang.float_to_binary(x * 1.0, decimals: 2)
end

ratio = fn a, b -> if a && b, do: f.(a / b), else: "—" end

rows =
  [
    {"lazy op node (us)", "lazy_op_us"},
    {"one op + eval (us)", "op_eval_us"},
    {"one op + read to host (us)", "op_read_us"},
    {"matmul 8192^3 bf16 (TFLOP/s)", "matmul_bf16_tflops"},
    {"matmul 8192^3 f16 (TFLOP/s)", "matmul_f16_tflops"},
    {"matmul 8192^3 f32 (TFLOP/s)", "matmul_f32_tflops"},
    {"elementwise f32, 1 GiB in + out (TB/s)", "elementwise_tbs"}
  ] ++ if(decode?, do: [{"decode step, Qwen3-0.6B shapes (ms)", "decode_ms"}], else: [])

IO.puts("| figure | Emily | Python MLX | Emily / Python MLX | PyTorch |")
IO.puts("|---|---|---|---|---|")

for {label, key} <- rows do
  e = emily["emily_" <> key]
  p = ref["mlx_" <> key]

  torch =
    case key do
      "decode_ms" ->
        "eager #{f.(ref["torch_decode_eager_ms"])}, CUDA graph #{f.(ref["torch_decode_graph_ms"])}"

      _ ->
        f.(ref["torch_" <> key])
    end

  IO.puts("| #{label} | #{f.(e)} | #{f.(p)} | #{ratio.(e, p)} | #{torch} |")
end

if decode? do
  IO.puts("""

  Decode step as one Emily.Program: #{f.(emily["emily_decode_program_ms"])} ms, compiled (mx::compile) #{f.(emily["emily_decode_compiled_ms"])} ms; largest difference from the op-by-op step: #{emily["emily_decode_max_diff"]}
  Python MLX compiled decode step: #{f.(ref["mlx_decode_compiled_ms"])} ms
  """)
end
