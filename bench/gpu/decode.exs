# One Qwen3-0.6B-shaped bf16 decode step through Emily.Native, op for op the same as
# bench/gpu/reference.py's: 28 layers, hidden 1024, 16 query / 8 KV heads, head dim 128,
# MLP 3072, a 512-long KV window, fast rms_norm / rope / attention, and the LM head.
defmodule GpuDecode do
  alias Emily.Native, as: N

  @layers 28
  @h 1024
  @nq 16
  @nkv 8
  @d 128
  @f 3072
  @kv 512
  @vocab 151_936
  @bf16 {:bf, 16}

  def run(s) do
    scale = N.full(s, {}, 0.02, @bf16)
    w = fn shape -> N.multiply(s, GpuBench.data(s, shape, @bf16), scale) end
    ones = fn n -> N.full(s, {n}, 1.0, @bf16) end

    layers =
      for _ <- 1..@layers do
        %{
          ln1: ones.(@h),
          ln2: ones.(@h),
          qn: ones.(@d),
          kn: ones.(@d),
          wq: w.({@h, @nq * @d}),
          wk: w.({@h, @nkv * @d}),
          wv: w.({@h, @nkv * @d}),
          wo: w.({@nq * @d, @h}),
          wg: w.({@h, @f}),
          wu: w.({@h, @f}),
          wd: w.({@f, @h}),
          k: w.({1, @nkv, @kv, @d}),
          v: w.({1, @nkv, @kv, @d})
        }
      end

    norm = ones.(@h)
    head = w.({@h, @vocab})
    x0 = w.({1, 1, @h})
    Emily.eval([norm, head, x0 | Enum.flat_map(layers, &Map.values/1)])

    GpuBench.best(fn -> GpuBench.eval_and_drop(step(s, layers, norm, head, x0)) end, 20, 3)
  end

  defp step(s, layers, norm, head, x0) do
    rms = fn x, g -> N.rms_norm(s, x, g, 1.0e-6) end
    rope = fn x -> N.rope(s, x, @d, false, 1.0e6, 1.0, @kv, nil) end
    t0213 = [0, 2, 1, 3]

    x =
      Enum.reduce(layers, x0, fn p, x ->
        h = rms.(x, p.ln1)
        q = N.reshape(s, N.matmul(s, h, p.wq), {1, 1, @nq, @d})
        k = N.reshape(s, N.matmul(s, h, p.wk), {1, 1, @nkv, @d})
        v = N.transpose(s, N.reshape(s, N.matmul(s, h, p.wv), {1, 1, @nkv, @d}), t0213)
        q = rope.(N.transpose(s, rms.(q, p.qn), t0213))
        k = rope.(N.transpose(s, rms.(k, p.kn), t0213))
        # A 512-long window ending at the new token: cache[1:] ++ new.
        ks =
          N.concatenate(
            s,
            [N.slice(s, p.k, [0, 0, 1, 0], [1, @nkv, @kv, @d], [1, 1, 1, 1]), k],
            2
          )

        vs =
          N.concatenate(
            s,
            [N.slice(s, p.v, [0, 0, 1, 0], [1, @nkv, @kv, @d], [1, 1, 1, 1]), v],
            2
          )

        o = N.scaled_dot_product_attention(s, q, ks, vs, :math.pow(@d, -0.5), "", nil, nil)
        o = N.reshape(s, N.transpose(s, o, t0213), {1, 1, @nq * @d})
        x = N.add(s, x, N.matmul(s, o, p.wo))
        h = rms.(x, p.ln2)
        g = N.matmul(s, h, p.wg)
        act = N.multiply(s, N.multiply(s, g, N.sigmoid(s, g)), N.matmul(s, h, p.wu))
        N.add(s, x, N.matmul(s, act, p.wd))
      end)

    N.matmul(s, rms.(x, norm), head)
  end
end
