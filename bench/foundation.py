"""Python MLX (and numpy) side of bench/foundation.exs: the same workloads, same libmlx.

Prints one `name microseconds` line per figure. Run by bench/foundation.exs, or alone:
    PYTHONPATH=$EMILY_CACHE/current python3 bench/foundation.py
"""
import os
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
from bench import best  # noqa: E402


def main():
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    s = mx.new_stream(mx.cpu)
    x = mx.array(0.0, dtype=mx.float32)
    one = mx.array(1.0, dtype=mx.float32)
    mx.eval(x, one)

    def chain():
        y = x
        for _ in range(100):
            y = mx.add(y, one, stream=s)
        mx.eval(y)

    def lazy():
        for _ in range(100):
            mx.add(x, one, stream=s)

    def small():
        y = mx.add(x, one, stream=s)
        mx.eval(y)
        return np.array(y, copy=False)

    a = mx.ones((size, size), dtype=mx.float32)
    b = mx.ones((size, size), dtype=mx.float32)
    mx.eval(a, b)

    def matmul():
        mx.eval(mx.matmul(a, b, stream=s))

    na = np.ones((size, size), dtype=np.float32)
    nb = np.ones((size, size), dtype=np.float32)

    print(f"chain_add_per_op {best(chain, 50) / 100:.3f}")
    print(f"lazy_node {best(lazy, 50) / 100:.3f}")
    print(f"small_op_eval_read {best(small, 500):.3f}")
    print(f"matmul_f32 {best(matmul, 3, rounds=3):.1f}")
    print(f"numpy_matmul_f32 {best(lambda: na @ nb, 3, rounds=3):.1f}")


if __name__ == "__main__":
    main()
