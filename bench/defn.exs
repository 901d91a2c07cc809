# defn on Emily: an MLP forward pass and a transformer block, run through Emily.Compiler
# (evaluator path, every node a lazy MLX op; native path, the graph lowered once into one
# Emily.Program, with and without mx::compile) beside Nx.Defn.Evaluator on
# Nx.BinaryBackend, in one run. Needs Nx: run it from a Mix project with both Emily and Nx as dependencies,
# in a non-test environment (the test config checks every op's result):
#
#     MIX_ENV=dev mix run path/to/emily/bench/defn.exs [--quick]
#
# Prints the graph's op count, the median time per call of each (the result read back
# to the host, so the MLX work is included), the ratio, and Emily's time per op; then
# the native path's times.
unless Code.ensure_loaded?(Nx) do
  raise "bench/defn.exs needs Nx (see the comment at the top)"
end

defmodule Bench.Defn.Models do
  import Nx.Defn

  defn mlp(x, {w1, b1, w2, b2, w3, b3}) do
    x
    |> Nx.dot(w1)
    |> Nx.add(b1)
    |> Nx.max(0)
    |> Nx.dot(w2)
    |> Nx.add(b2)
    |> Nx.max(0)
    |> Nx.dot(w3)
    |> Nx.add(b3)
    |> softmax()
  end

  defn softmax(x) do
    e = Nx.exp(x - Nx.reduce_max(x, axes: [-1], keep_axes: true))
    e / Nx.sum(e, axes: [-1], keep_axes: true)
  end

  defn layer_norm(x, g, b) do
    mean = Nx.mean(x, axes: [-1], keep_axes: true)
    var = Nx.mean((x - mean) ** 2, axes: [-1], keep_axes: true)
    (x - mean) * Nx.rsqrt(var + 1.0e-5) * g + b
  end

  defn gelu(x) do
    0.5 * x * (1 + Nx.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))
  end

  # A pre-norm transformer block: multi-head self-attention with a causal mask, then
  # a GELU MLP, each with a residual connection.
  defn block(x, {ln1_g, ln1_b, wqkv, wo, ln2_g, ln2_b, w1, w2}, opts \\ []) do
    opts = keyword!(opts, heads: 4)
    heads = opts[:heads]
    {seq, d} = Nx.shape(x)
    hd = div(d, heads)

    h = layer_norm(x, ln1_g, ln1_b)
    qkv = Nx.dot(h, wqkv) |> Nx.reshape({seq, 3, heads, hd}) |> Nx.transpose(axes: [1, 2, 0, 3])
    q = qkv[0]
    k = qkv[1]
    v = qkv[2]

    scores = Nx.dot(q, [2], [0], k, [2], [0]) / Nx.sqrt(hd)
    mask = Nx.iota({seq, seq}, axis: 0) >= Nx.iota({seq, seq}, axis: 1)
    scores = Nx.select(Nx.broadcast(mask, Nx.shape(scores)), scores, -1.0e9)
    attn = softmax(scores)
    out = Nx.dot(attn, [2], [0], v, [1], [0])
    out = out |> Nx.transpose(axes: [1, 0, 2]) |> Nx.reshape({seq, d})
    x = x + Nx.dot(out, wo)

    h = layer_norm(x, ln2_g, ln2_b)
    x + Nx.dot(gelu(Nx.dot(h, w1)), w2)
  end
end

defmodule Bench.Defn do
  def median_us(fun, runs) do
    fun.()

    times =
      for _ <- 1..runs do
        {us, _} = :timer.tc(fun)
        us
      end

    times |> Enum.sort() |> Enum.at(div(runs, 2))
  end

  def random(key, shape, scale) do
    {t, key} = Nx.Random.normal(key, 0.0, scale, shape: shape, type: :f32)
    {Nx.backend_copy(t, Nx.BinaryBackend), key}
  end

  def params(key, shapes, scale) do
    {list, key} = Enum.map_reduce(shapes, key, fn shape, key -> random(key, shape, scale) end)
    {List.to_tuple(list), key}
  end

  def to_emily(container), do: Nx.backend_copy(container, Emily.Backend)

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

  def run(name, fun, args, emily_runs, binary_runs) do
    emily = Nx.Defn.jit(fun, compiler: Emily.Compiler)
    binary = Nx.Defn.jit(fun, compiler: Nx.Defn.Evaluator)
    emily_args = Enum.map(args, &to_emily/1)

    # The check that both compute the same thing, then the timings.
    a = emily |> apply(emily_args) |> Nx.backend_copy(Nx.BinaryBackend)
    b = Nx.with_default_backend(Nx.BinaryBackend, fn -> apply(binary, args) end)
    diff = a |> Nx.subtract(b) |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number()

    t_emily = median_us(fn -> emily |> apply(emily_args) |> Nx.to_binary() end, emily_runs)

    t_binary =
      Nx.with_default_backend(Nx.BinaryBackend, fn ->
        median_us(fn -> apply(binary, args) |> Nx.to_binary() end, binary_runs)
      end)

    ops = count_ops(fun, args)

    IO.puts(
      String.pad_trailing(name, 34) <>
        String.pad_leading("#{ops}", 5) <>
        String.pad_leading(fmt(t_emily), 12) <>
        String.pad_leading(fmt(t_binary), 14) <>
        String.pad_leading("#{Float.round(t_binary / t_emily, 1)}x", 10) <>
        String.pad_leading("#{Float.round(t_emily / ops, 1)} us", 10) <>
        "   max |diff| #{Float.round(diff, 7)}"
    )

    native(name, fun, emily_args, b, emily_runs, t_emily)
  end

  # The native path, plain and compiled with mx::compile, against the evaluator path.
  defp native(name, fun, emily_args, expected, runs, t_emily) do
    for compile <- [false, true] do
      jit = Nx.Defn.jit(fun, compiler: Emily.Compiler, native: true, compile: compile)
      out = jit |> apply(emily_args) |> Nx.backend_copy(Nx.BinaryBackend)
      diff = out |> Nx.subtract(expected) |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number()
      t = median_us(fn -> jit |> apply(emily_args) |> Nx.to_binary() end, runs)
      label = if compile, do: "  native, mx::compile", else: "  native"

      IO.puts(
        String.pad_trailing(label, 34) <>
          String.pad_leading("", 5) <>
          String.pad_leading(fmt(t), 12) <>
          String.pad_leading("", 14) <>
          String.pad_leading("#{Float.round(t_emily / t, 2)}x", 10) <>
          String.pad_leading("", 10) <>
          "   max |diff| #{Float.round(diff, 7)}   (vs evaluator path #{name})"
      )
    end
  end

  defp fmt(us) when us >= 10_000, do: "#{Float.round(us / 1000, 1)} ms"
  defp fmt(us), do: "#{us} us"
end

quick? = "--quick" in System.argv()
key = Nx.Random.key(42) |> Nx.backend_copy(Nx.BinaryBackend)
alias Bench.Defn.Models

IO.puts(
  "MLX #{Emily.mlx_version()} on #{Emily.default_device()}; Nx #{Application.spec(:nx, :vsn)}"
)

IO.puts(
  String.pad_trailing("", 34) <>
    String.pad_leading("ops", 5) <>
    String.pad_leading("Emily", 12) <>
    String.pad_leading("BinaryBackend", 14) <>
    String.pad_leading("speedup", 10) <> String.pad_leading("per op", 10)
)

{batch, din, hidden, dout} = if quick?, do: {8, 128, 128, 10}, else: {16, 512, 256, 10}
{x, key} = Bench.Defn.random(key, {batch, din}, 1.0)

{mlp_params, key} =
  Bench.Defn.params(
    key,
    [{din, hidden}, {hidden}, {hidden, hidden}, {hidden}, {hidden, dout}, {dout}],
    0.05
  )

Bench.Defn.run(
  "MLP #{batch}x#{din}-#{hidden}-#{hidden}-#{dout}",
  &Models.mlp/2,
  [x, mlp_params],
  200,
  3
)

{seq, d, ffn} = if quick?, do: {16, 64, 256}, else: {32, 128, 512}
{x, key} = Bench.Defn.random(key, {seq, d}, 1.0)

{block_params, _key} =
  Bench.Defn.params(
    key,
    [{d}, {d}, {d, 3 * d}, {d, d}, {d}, {d}, {d, ffn}, {ffn, d}],
    0.05
  )

Bench.Defn.run(
  "transformer block seq #{seq}, d #{d}",
  &Models.block/2,
  [x, block_params],
  100,
  3
)
