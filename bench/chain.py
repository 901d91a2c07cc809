# bench/chain.exs's Python reference: the chain bench/chain.cc runs, through Python MLX
# on Emily's libmlx (OpenBLAS preloaded by the caller, as for the NIF). Usage:
# chain.py REPS N...  Prints `n mean_us` for each length: the best of five windows.
import sys
import time

import mlx.core as mx
import numpy as np

mx.set_default_device(mx.cpu)
x = mx.array([[0.1 * i for i in range(8)]], dtype=mx.float32)
mx.eval(x)


def window(n, reps):
    t0 = time.perf_counter()
    for _ in range(reps):
        y = x
        for i in range(1, n + 1):
            y = mx.cos(y) if i % 2 == 0 else mx.sin(y)
        mx.eval(y)
        np.asarray(y)
    return (time.perf_counter() - t0) / reps * 1e6


reps = int(sys.argv[1])
for n in map(int, sys.argv[2:]):
    window(n, reps // 10 + 1)
    print(n, f"{min(window(n, reps) for _ in range(5)):.3f}", flush=True)
