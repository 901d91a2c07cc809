"""The host's cost of one node of MLX's custom-kernel API (`mx.fast.cuda_kernel`, what
Emily's decoding products and attention go through) beside a builtin op's, by the
length of the kernel's source: a chain of N calls on a GPU, its graph building and its
`async_eval` timed apart, per node (medians of 7 chains after 2 warm-ups).

    PYTHONPATH=<dir holding mlx> python3 bench/gpu/custom_kernel.py

MLX hashes a custom kernel's whole source (its header included) at every evaluation,
so the encoding of such a node grows with the source; the header here is a comment of
the given length.
"""
import statistics
import time

import mlx.core as mx

N = 300
x = mx.ones((1, 4096), dtype=mx.bfloat16)
mx.eval(x)
body = "unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < inp_shape[1]) out[i] = inp[i] + (T)1;"


def chain(step):
    y = x
    for _ in range(N):
        y = step(y)
    return y


def timeit(step):
    build, encode = [], []
    for r in range(9):
        t0 = time.perf_counter()
        y = chain(step)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        if r >= 2:
            build.append((t1 - t0) / N * 1e6)
            encode.append((t2 - t1) / N * 1e6)
    return statistics.median(build), statistics.median(encode)


print("builtin add: build %.2f us, async_eval %.2f us a node" % timeit(lambda y: y + 1))
for pad in [0, 2048, 8192, 32768]:
    k = mx.fast.cuda_kernel(
        name=f"k{pad}", input_names=["inp"], output_names=["out"], source=body, header="// " + "p" * pad + "\n"
    )

    def call(y, k=k):
        return k(
            inputs=[y],
            output_shapes=[y.shape],
            output_dtypes=[y.dtype],
            grid=(4096, 1, 1),
            threadgroup=(256, 1, 1),
            template=[("T", mx.bfloat16)],
        )[0]

    print("custom kernel, header %6d B: build %.2f us, async_eval %.2f us a node" % ((pad,) + timeit(call)))
