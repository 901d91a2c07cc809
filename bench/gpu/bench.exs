# GPU figures: Emily beside Python MLX (the same libmlx) and PyTorch, in one run.
#
#     bin/emily-run bench/gpu/bench.exs [--decode] [--passes N]  (in a bundle, see README)
#     mix run --no-deps-check bench/gpu/bench.exs [--decode] [--passes N]  (in a checkout)
#
# EMILY_PYTHONPATH names the folder holding the `mlx` Python package that sits on the
# same libmlx as Emily (default: $EMILY_CACHE/current). Prints a markdown table.
alias Emily.Native, as: N

decode? = "--decode" in System.argv()

passes =
  case OptionParser.parse(System.argv(), strict: [passes: :integer, decode: :boolean]) do
    {opts, _, _} -> Keyword.get(opts, :passes, 2)
  end

Code.require_file("../support/bench.exs", __DIR__)

defmodule GpuBench do
  alias Emily.Native, as: N

  # The polling time of the `spin` rows (`Emily.Stream.set_spin/1`).
  @spin 50

  # Best mean seconds per call.
  def best(fun, reps, rounds \\ 5), do: Bench.best(fun, reps, rounds) / 1.0e6

  # sin(0, 1, 2, ...) in `dtype`: the same data the references build.
  def data(s, shape, dtype) do
    n = Tuple.product(shape)
    x = N.sin(s, N.arange(s, 0, n, 1, {:f, 32}))
    N.astype(s, N.reshape(s, x, shape), dtype)
  end

  # Evaluates `t` and frees it at once, as Python's reference counting does, so MLX
  # reuses its buffer for the next call (otherwise every call would allocate a fresh one
  # until the BEAM collects the handle).
  def eval_and_drop(t) do
    Emily.eval(t)
    Emily.release(t)
  end

  # The three host-overhead figures, with the workers and waiting callers polling for
  # `spin` microseconds before they sleep (`Emily.Stream.set_spin/1`).
  def overhead(s, x, one, spin) do
    previous = Emily.Stream.set_spin(spin)
    suffix = if spin == 0, do: "", else: "_spin"

    try do
      lazy = best(fn -> Enum.each(1..100, fn _ -> N.add(s, x, one) end) end, 20) / 100
      op_eval = best(fn -> Emily.eval(N.add(s, x, one)) end, 500)
      op_read = best(fn -> Emily.to_binary(N.add(s, x, one)) end, 500)

      %{
        "emily_lazy_op#{suffix}_us" => lazy * 1.0e6,
        "emily_op_eval#{suffix}_us" => op_eval * 1.0e6,
        "emily_op_read#{suffix}_us" => op_read * 1.0e6
      }
    after
      Emily.Stream.set_spin(previous)
    end
  end

  # One op as a one-instruction program through Emily.Program.eval/3, which builds and
  # evaluates it in the calling NIF (a dirty scheduler thread), with no worker hop.
  def program_overhead(s, x, one) do
    p = Emily.Program.new([{:add, [0, 1]}], inputs: 2)
    op_eval = best(fn -> Emily.release(hd(Emily.Program.eval(p, [x, one], stream: s))) end, 500)
    op_read = best(fn -> Emily.to_binary(hd(Emily.Program.eval(p, [x, one], stream: s))) end, 500)

    %{
      "emily_op_program_eval_us" => op_eval * 1.0e6,
      "emily_op_program_read_us" => op_read * 1.0e6
    }
  end

  def figures(s) do
    x = N.full(s, {}, 0.0, {:f, 32})
    one = N.full(s, {}, 1.0, {:f, 32})
    Emily.eval([x, one])

    overhead =
      overhead(s, x, one, 0)
      |> Map.merge(overhead(s, x, one, @spin))
      |> Map.merge(program_overhead(s, x, one))

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

    Map.new([{"emily_elementwise_tbs", 2 * m * 4 / t / 1.0e12} | matmuls])
    |> Map.merge(overhead)
  end
end

s = Emily.Stream.default(:gpu)

emily_pass = fn ->
  emily = GpuBench.figures(s)

  if decode? do
    Code.require_file(Path.join(__DIR__, "decode.exs"))
    d = GpuDecode.run(s)

    Map.merge(emily, %{
      "emily_decode_ms" => d.op_by_op * 1.0e3,
      "emily_decode_spin_ms" => d.op_by_op_spin * 1.0e3,
      "emily_decode_program_ms" => d.program * 1.0e3,
      "emily_decode_program_eval_ms" => d.program_eval * 1.0e3,
      "emily_decode_compiled_ms" => d.compiled * 1.0e3,
      "emily_decode_max_diff" => d.max_diff
    })
  else
    emily
  end
end

python_pass = fn ->
  Bench.python(Path.join(__DIR__, "reference.py"), if(decode?, do: ["--decode"], else: []))
end

# Passes of each side, alternated (Emily, Python, Emily, Python, ...), each figure the
# best of its side's: neither side always runs on a GPU just woken or just warmed.
better = fn passes ->
  Enum.reduce(passes, fn pass, acc ->
    Map.merge(acc, pass, fn k, a, b ->
      cond do
        String.ends_with?(k, "max_diff") -> max(a, b)
        String.ends_with?(k, ["_us", "_ms"]) -> min(a, b)
        true -> max(a, b)
      end
    end)
  end)
end

{emily_passes, python_passes} =
  Enum.map(1..passes, fn _ -> {emily_pass.(), python_pass.()} end) |> Enum.unzip()

emily = better.(emily_passes)
ref = better.(python_passes)
IO.puts("#{passes} alternated passes of each side, best kept\n")

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
    {"lazy op node, spin 50 us (us)", "lazy_op_spin_us", "lazy_op_us"},
    {"one op + eval, spin 50 us (us)", "op_eval_spin_us", "op_eval_us"},
    {"one op + read to host, spin 50 us (us)", "op_read_spin_us", "op_read_us"},
    {"one op as Program.eval (us)", "op_program_eval_us", "op_eval_us"},
    {"one op as Program.eval + read to host (us)", "op_program_read_us", "op_read_us"},
    {"matmul 8192^3 bf16 (TFLOP/s)", "matmul_bf16_tflops"},
    {"matmul 8192^3 f16 (TFLOP/s)", "matmul_f16_tflops"},
    {"matmul 8192^3 f32 (TFLOP/s)", "matmul_f32_tflops"},
    {"elementwise f32, 1 GiB in + out (TB/s)", "elementwise_tbs"}
  ] ++
    if(decode?,
      do: [
        {"decode step, Qwen3-0.6B shapes (ms)", "decode_ms"},
        {"decode step, spin 50 us (ms)", "decode_spin_ms", "decode_ms"},
        {"decode step as one Program.eval (ms)", "decode_program_eval_ms", "decode_ms"}
      ],
      else: []
    )

IO.puts("| figure | Emily | Python MLX | Emily / Python MLX | PyTorch |")
IO.puts("|---|---|---|---|---|")

for row <- rows do
  # A spin or Program.eval row compares with Python's plain figure (the same work).
  {label, key, ref_key} = with {label, key} <- row, do: {label, key, key}
  e = emily["emily_" <> key]
  p = ref["mlx_" <> ref_key]

  torch =
    case ref_key do
      "decode_ms" ->
        "eager #{f.(ref["torch_decode_eager_ms"])}, CUDA graph #{f.(ref["torch_decode_graph_ms"])}"

      _ ->
        f.(ref["torch_" <> ref_key])
    end

  IO.puts("| #{label} | #{f.(e)} | #{f.(p)} | #{ratio.(e, p)} | #{torch} |")
end

if decode? do
  IO.puts("""

  Decode step as one Emily.Program: #{f.(emily["emily_decode_program_ms"])} ms, compiled (mx::compile) #{f.(emily["emily_decode_compiled_ms"])} ms; largest difference from the op-by-op step: #{emily["emily_decode_max_diff"]}
  Python MLX compiled decode step: #{f.(ref["mlx_decode_compiled_ms"])} ms
  """)
end
