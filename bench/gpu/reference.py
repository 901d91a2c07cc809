"""References for bench/gpu/bench.exs: Python MLX (the same libmlx as Emily) and PyTorch,
on the same workloads, in the same run. Prints one `name value` line per figure.

    PYTHONPATH=<dir holding mlx> python3 bench/gpu/reference.py [--decode]

Figures (units in the names): lazy op node, one op + eval, one op + read to host (us);
matmul 8192^3 in bf16/f16/f32 (TFLOP/s); elementwise f32 over 1 GiB in + out (TB/s); and,
with --decode, one Qwen3-0.6B-shaped bf16 decode step (ms).
"""
import math
import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import bench  # noqa: E402

try:
    import torch
except ImportError:  # the MLX figures still mean something alone
    torch = None

S = mx.new_stream(mx.gpu)


def best(fun, reps, rounds=5):
    """Best mean seconds per call."""
    return bench.best(fun, reps, rounds) / 1e6


def data(shape, dtype):
    """sin(0, 1, 2, ...): the same deterministic data Emily builds."""
    n = math.prod(shape)
    return mx.sin(mx.arange(n, dtype=mx.float32, stream=S), stream=S).reshape(shape).astype(dtype)


def mlx_figures():
    x = mx.array(0.0)
    one = mx.array(1.0)
    mx.eval(x, one)
    yield "mlx_lazy_op_us", best(lambda: [mx.add(x, one, stream=S) for _ in range(100)], 20) / 100 * 1e6
    yield "mlx_op_eval_us", best(lambda: mx.eval(mx.add(x, one, stream=S)), 500) * 1e6
    yield "mlx_op_read_us", best(lambda: mx.add(x, one, stream=S).item(), 500) * 1e6

    n = 8192
    for name, dt in [("bf16", mx.bfloat16), ("f16", mx.float16), ("f32", mx.float32)]:
        a, b = data((n, n), dt), data((n, n), dt)
        mx.eval(a, b)
        t = best(lambda: mx.eval(mx.matmul(a, b, stream=S)), 10, rounds=3)
        yield f"mlx_matmul_{name}_tflops", 2 * n**3 / t / 1e12
        del a, b

    m = 256 * 1024 * 1024  # 1 GiB of f32
    x = mx.full((m,), 1.5, dtype=mx.float32, stream=S)
    two = mx.array(2.0)
    mx.eval(x)
    t = best(lambda: mx.eval(mx.multiply(x, two, stream=S)), 10, rounds=3)
    yield "mlx_elementwise_tbs", 2 * m * 4 / t / 1e12


def torch_figures():
    dev = "cuda"
    x = torch.zeros((), device=dev)
    torch.cuda.synchronize()
    yield "torch_op_eval_us", best(lambda: (x + 1, torch.cuda.synchronize()), 500) * 1e6
    yield "torch_op_read_us", best(lambda: (x + 1).item(), 500) * 1e6
    n = 8192
    for name, dt in [("bf16", torch.bfloat16), ("f16", torch.float16), ("f32", torch.float32)]:
        a = torch.sin(torch.arange(n * n, device=dev, dtype=torch.float32)).reshape(n, n).to(dt)
        b = a.clone()
        t = best(lambda: (a @ b, torch.cuda.synchronize()), 10, rounds=3)
        yield f"torch_matmul_{name}_tflops", 2 * n**3 / t / 1e12
        del a, b
    m = 256 * 1024 * 1024
    x = torch.full((m,), 1.5, device=dev)
    t = best(lambda: (x * 2.0, torch.cuda.synchronize()), 10, rounds=3)
    yield "torch_elementwise_tbs", 2 * m * 4 / t / 1e12


# --- Qwen3-0.6B-shaped decode step ------------------------------------------------------
L, H, NQ, NKV, D, F, KV, V = 28, 1024, 16, 8, 128, 3072, 512, 151936


def mlx_decode():
    dt = mx.bfloat16
    w = lambda *s: data(s, dt) * 0.02  # noqa: E731
    layers = []
    for _ in range(L):
        layers.append(dict(
            ln1=mx.ones((H,), dt), ln2=mx.ones((H,), dt), qn=mx.ones((D,), dt), kn=mx.ones((D,), dt),
            wq=w(H, NQ * D), wk=w(H, NKV * D), wv=w(H, NKV * D), wo=w(NQ * D, H),
            wg=w(H, F), wu=w(H, F), wd=w(F, H),
            k=w(1, NKV, KV, D), v=w(1, NKV, KV, D)))
    norm, head = mx.ones((H,), dt), w(H, V)
    x0 = w(1, 1, H)
    mx.eval(layers, norm, head, x0)

    def step():
        x = x0
        for p in layers:
            h = mx.fast.rms_norm(x, p["ln1"], 1e-6, stream=S)
            q = (h @ p["wq"]).reshape(1, 1, NQ, D)
            k = (h @ p["wk"]).reshape(1, 1, NKV, D)
            v = (h @ p["wv"]).reshape(1, 1, NKV, D).transpose(0, 2, 1, 3)
            q = mx.fast.rms_norm(q, p["qn"], 1e-6, stream=S).transpose(0, 2, 1, 3)
            k = mx.fast.rms_norm(k, p["kn"], 1e-6, stream=S).transpose(0, 2, 1, 3)
            q = mx.fast.rope(q, D, traditional=False, base=1e6, scale=1.0, offset=KV, stream=S)
            k = mx.fast.rope(k, D, traditional=False, base=1e6, scale=1.0, offset=KV, stream=S)
            # A 512-long window ending at the new token: cache[1:] ++ new.
            ks = mx.concatenate([p["k"][:, :, 1:, :], k], axis=2)
            vs = mx.concatenate([p["v"][:, :, 1:, :], v], axis=2)
            o = mx.fast.scaled_dot_product_attention(q, ks, vs, scale=D**-0.5, stream=S)
            x = x + o.transpose(0, 2, 1, 3).reshape(1, 1, NQ * D) @ p["wo"]
            h = mx.fast.rms_norm(x, p["ln2"], 1e-6, stream=S)
            g = h @ p["wg"]
            x = x + (g * mx.sigmoid(g) * (h @ p["wu"])) @ p["wd"]
        return mx.fast.rms_norm(x, norm, 1e-6, stream=S) @ head

    with mx.stream(S):
        yield "mlx_decode_ms", best(lambda: mx.eval(step()), 20, rounds=3) * 1e3
        compiled = mx.compile(step)
        yield "mlx_decode_compiled_ms", best(lambda: mx.eval(compiled()), 20, rounds=3) * 1e3


def torch_decode():
    dev, dt = "cuda", torch.bfloat16
    w = lambda *s: (torch.sin(torch.arange(math.prod(s), device=dev, dtype=torch.float32)).reshape(s) * 0.02).to(dt)  # noqa: E731
    layers = [dict(wq=w(H, NQ * D), wk=w(H, NKV * D), wv=w(H, NKV * D), wo=w(NQ * D, H), wg=w(H, F),
                   wu=w(H, F), wd=w(F, H), k=w(1, NKV, KV, D), v=w(1, NKV, KV, D)) for _ in range(L)]
    ones_h, ones_d = torch.ones(H, device=dev, dtype=dt), torch.ones(D, device=dev, dtype=dt)
    head, x0 = w(H, V), w(1, 1, H)
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
    ang = KV * inv
    cos, sin = torch.cos(ang).to(dt), torch.sin(ang).to(dt)

    def rms(x, g):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), g, 1e-6)

    def rope(x):
        a, b = x[..., : D // 2], x[..., D // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def step():
        x = x0
        for p in layers:
            h = rms(x, ones_h)
            q = rope(rms((h @ p["wq"]).view(1, 1, NQ, D), ones_d).transpose(1, 2))
            k = rope(rms((h @ p["wk"]).view(1, 1, NKV, D), ones_d).transpose(1, 2))
            v = (h @ p["wv"]).view(1, 1, NKV, D).transpose(1, 2)
            ks = torch.cat([p["k"][:, :, 1:, :], k], dim=2)
            vs = torch.cat([p["v"][:, :, 1:, :], v], dim=2)
            o = torch.nn.functional.scaled_dot_product_attention(q, ks, vs, enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(1, 1, NQ * D) @ p["wo"]
            h = rms(x, ones_h)
            x = x + (torch.nn.functional.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"]
        return rms(x, ones_h) @ head

    yield "torch_decode_eager_ms", best(lambda: (step(), torch.cuda.synchronize()), 20, rounds=3) * 1e3
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    yield "torch_decode_graph_ms", best(lambda: (g.replay(), torch.cuda.synchronize()), 20, rounds=3) * 1e3


def main():
    decode = "--decode" in sys.argv
    gens = [mlx_figures()] + ([mlx_decode()] if decode else [])
    if torch is not None and torch.cuda.is_available():
        gens += [torch_figures()] + ([torch_decode()] if decode else [])
    for gen in gens:
        for name, value in gen:
            print(f"{name} {value:.4f}", flush=True)


if __name__ == "__main__":
    main()
