"""Shared by the Python references of the benchmarks."""
import time


def best(fun, reps, rounds=5):
    """Best mean time per call, in microseconds, over `rounds` rounds of `reps` calls."""
    fun()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fun()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return min(times)
