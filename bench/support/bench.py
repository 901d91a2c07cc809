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


def serve(runs):
    """Timed windows on request, for a benchmark that alternates them with its own
    (bench/support/bench.exs, `Bench.paired/6`): `runs` maps names to functions; reads
    `NAME REPS WARM` lines and answers each with the mean microseconds per run of REPS
    runs of that function, after untimed runs for WARM milliseconds. Says `ready` first."""
    import sys

    print("ready", flush=True)
    for line in sys.stdin:
        name, reps, warm = line.split()
        f, reps = runs[name], int(reps)
        until = time.perf_counter() + int(warm) / 1000
        f()
        while time.perf_counter() < until:
            f()
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        print(f"{(time.perf_counter() - t0) / reps * 1e6:.3f}", flush=True)
