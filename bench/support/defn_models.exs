# The defn graphs bench/defn.exs and bench/defn_call.exs time (needs Nx).
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

  # A chain of `n` elementwise ops (one program instruction each): timed at two lengths
  # on a tiny input, it splits a run's time into a fixed part and a part per op.
  defn chain(x, opts \\ []) do
    opts = keyword!(opts, n: 16)
    unary_chain(x, opts[:n])
  end

  deftransformp unary_chain(x, n) do
    Enum.reduce(1..n, x, fn i, acc -> if rem(i, 2) == 0, do: Nx.cos(acc), else: Nx.sin(acc) end)
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

  # Dropout at rate 0.5: Nx.Random.uniform's threefry rounds are two `while` loops,
  # which the native path unrolls.
  defn dropout(x, key) do
    keep = Nx.Random.uniform_split(key, 0.0, 1.0, shape: Nx.shape(x)) >= 0.5
    Nx.select(keep, x * 2, 0.0)
  end

  # One training step of the MLP, as a training loop runs it: softmax cross-entropy
  # against one-hot `labels`, its gradient (Nx's grad through the whole forward pass),
  # and an Adam update of each parameter and its two moments, in one graph.
  defn train_step(x, labels, params, moments, opts \\ []) do
    opts = keyword!(opts, lr: 1.0e-3, b1: 0.9, b2: 0.999, eps: 1.0e-8, step: 10)

    {loss, grads} =
      value_and_grad(params, fn p ->
        -Nx.mean(Nx.sum(labels * Nx.log(mlp(x, p)), axes: [1]))
      end)

    {params, moments} = adam_all(params, grads, moments, opts)
    {params, moments, loss}
  end

  deftransformp adam_all(params, grads, {m, v}, opts) do
    [params, grads, m, v]
    |> Enum.map(&Tuple.to_list/1)
    |> Enum.zip_with(fn [p, g, m, v] -> adam(p, g, m, v, opts) end)
    |> Enum.reduce({[], [], []}, fn {p, m, v}, {ps, ms, vs} -> {[p | ps], [m | ms], [v | vs]} end)
    |> then(fn {ps, ms, vs} ->
      tuple = &(&1 |> Enum.reverse() |> List.to_tuple())
      {tuple.(ps), {tuple.(ms), tuple.(vs)}}
    end)
  end

  defn adam(p, g, m, v, opts) do
    m = opts[:b1] * m + (1 - opts[:b1]) * g
    v = opts[:b2] * v + (1 - opts[:b2]) * g * g
    m_hat = m / (1 - opts[:b1] ** opts[:step])
    v_hat = v / (1 - opts[:b2] ** opts[:step])
    {p - opts[:lr] * m_hat / (Nx.sqrt(v_hat) + opts[:eps]), m, v}
  end

  # A sequence classifier: token and position embeddings (take), the block, mean
  # pooling and a linear head; the predicted class (argmax).
  defn classifier(tokens, {emb, pos}, block_params, {wc, bc}) do
    x = Nx.take(emb, tokens, axis: 0) + pos
    x = block(x, block_params)
    logits = Nx.dot(Nx.mean(x, axes: [0]), wc) + bc
    Nx.argmax(logits, axis: 0)
  end
end
