"""Time per call of the ops bench/native_ops.exs times, with Python MLX on the same libmlx.

Each call builds the op and evaluates it (mx.eval), on the CPU. Run with the MLX that
scripts/setup installed for Emily:

    PYTHONPATH=$EMILY_CACHE/current python3 bench/native_ops.py

Prints one line per op and shape: the median and mean time per call in microseconds.
"""

import random
import statistics
import time

import mlx.core as mx

MIN_SECONDS = 1.0
MAX_CALLS = 20_000

mx.set_default_device(mx.cpu)


def bench(fun):
    for _ in range(10):
        fun()
    samples = []
    deadline = time.perf_counter() + MIN_SECONDS
    while True:
        t0 = time.perf_counter_ns()
        fun()
        samples.append((time.perf_counter_ns() - t0) / 1000)
        if len(samples) >= MAX_CALLS or time.perf_counter() > deadline:
            break
    return statistics.median_high(samples), statistics.fmean(samples), len(samples)


def rand(shape):
    rng = random.Random(123)
    n = shape[0] * shape[1]
    return mx.array([rng.uniform(-1, 1) for _ in range(n)], dtype=mx.float32).reshape(shape)


OPS = [
    ("exp", lambda x, y: mx.exp(x)),
    ("add", lambda x, y: mx.add(x, y)),
    ("sum(axis=1)", lambda x, y: mx.sum(x, axis=1)),
    ("cumsum(axis=1)", lambda x, y: mx.cumsum(x, axis=1)),
    ("argsort(axis=1)", lambda x, y: mx.argsort(x, axis=1)),
]

print(f"Python MLX {mx.__version__}, CPU")
print(f"{'op':<18}{'shape':<12}median us   mean us   calls")
for shape in [(16, 64), (1024, 1024)]:
    x = rand(shape)
    y = x * x
    mx.eval(x, y)
    for name, fun in OPS:
        median, mean, calls = bench(lambda: mx.eval(fun(x, y)))
        print(f"{name:<18}{f'{shape[0]}x{shape[1]}':<12}{median:>9.1f}{mean:>10.1f}{calls:>8}")
