"""Python MLX side of bench/native_linalg.exs: the same ops and shapes, same libmlx.

Prints one `name microseconds` line per op (best mean time per call, graph built and
evaluated on a CPU stream). Run by bench/native_linalg.exs, or alone:
    PYTHONPATH=$EMILY_CACHE/current python3 bench/native_linalg.py
Emily links OpenBLAS ahead of libmlx; for the same BLAS/LAPACK here, run it with
    LD_PRELOAD=libopenblas.so.0
"""
import math
import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
from bench import best  # noqa: E402


def main():
    s = mx.new_stream(mx.cpu)
    key = mx.random.key(0)

    def arr(shape, dtype=mx.float32):
        # deterministic, well-conditioned data (no RNG in the timed path)
        n = math.prod(shape)
        return mx.reshape(mx.sin(mx.arange(n, dtype=mx.float32) * 0.37), shape).astype(dtype)

    # products: 512^3 f32 matmul-shaped dot; int32 256^3 dot (multiply + sum, as Emily
    # composes it); conv 3x3, 8x32x32x32 -> 64 channels
    a = arr((512, 512))
    b = arr((512, 512))
    ai = (arr((256, 256)) * 10).astype(mx.int32)
    bi = (arr((256, 256)) * 10).astype(mx.int32)
    x = arr((8, 32, 32, 32))
    w = arr((64, 3, 3, 32))
    # linalg: symmetric positive definite 256
    m = arr((256, 256))
    spd = mx.matmul(m, m.T) + 256 * mx.eye(256)
    # fft: rfft along the last axis of 64 x 4096
    f = arr((64, 4096))
    # fast: attention B1 H8 L256 D64 causal
    q = arr((1, 8, 256, 64))
    kv = arr((1, 8, 256, 64))
    # quant: 4-bit group 64 weights 2048 x 2048, x 8 x 2048
    wq = mx.quantize(arr((2048, 2048)), group_size=64, bits=4)
    xq = arr((8, 2048))
    mx.eval(a, b, ai, bi, x, w, spd, f, q, kv, *wq, xq)

    ops = [
        ("dot_f32_512", lambda: mx.matmul(a, b, stream=s), 5),
        ("dot_s32_256", lambda: mx.sum(ai[:, :, None] * bi[None, :, :], axis=1, stream=s), 3),
        ("conv2d_3x3_8x32x32x32_64", lambda: mx.conv_general(x, w, padding=([1, 1], [1, 1]), stream=s), 3),
        ("qr_256", lambda: mx.linalg.qr(spd, stream=s), 5),
        ("eigh_256", lambda: mx.linalg.eigh(spd, stream=s), 3),
        ("rfft_64x4096", lambda: mx.fft.rfft(f, n=4096, axis=-1, stream=s), 10),
        ("normal_1m", lambda: mx.random.normal((1 << 20,), key=key, stream=s), 10),
        ("sdpa_causal_8x256x64",
         lambda: mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.125, mask="causal", stream=s), 5),
        ("quantized_matmul_4bit_8x2048x2048",
         lambda: mx.quantized_matmul(xq, *wq, transpose=True, group_size=64, bits=4, stream=s), 5),
    ]
    for name, op, reps in ops:
        def call(op=op):
            out = op()
            mx.eval(out)

        print(f"{name} {best(call, reps):.1f}")


if __name__ == "__main__":
    main()
