"""Time per call (op + eval; median of 7 batches, and the best batch) of the MLX work behind bench/native_index.exs, from Python on
the same libmlx: the same shapes and the same composition of MLX ops as Emily's glue
(index clamping included), plus the bare MLX op where one exists.

    PYTHONPATH=$EMILY_CACHE/current python3 bench/native_index.py
"""
import time

import mlx.core as mx


def timed(fun, iters, rounds=7):
    for _ in range(3):
        fun()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fun()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    samples.sort()
    return samples[rounds // 2], samples[0]


def report(name, shapes, us):
    median, best = us
    print(f"{name:<16}{shapes:<44}{median:>10.1f} us  (best batch {best:.1f})")


def tensor(shape, dtype, m):
    n = 1
    for d in shape:
        n *= d
    t = ((mx.arange(n, dtype=mx.int64) * 7919) % m).astype(dtype).reshape(shape)
    mx.eval(t)
    return t


def window_max_axis(x, axis, w, st, out):
    # Emily's composition: combine w strided slices of the axis elementwise.
    acc = None
    for j in range(w):
        idx = [slice(None)] * x.ndim
        idx[axis] = slice(j, j + (out - 1) * st + 1, st)
        part = x[tuple(idx)]
        acc = part if acc is None else mx.maximum(acc, part)
    return acc


print(f"Python MLX {mx.__version__} on {mx.default_device()}, time per call (op + eval)")

table = tensor((8192, 512), mx.float32, 1000)
rows = tensor((4096,), mx.int32, 8192)
report("take", "f32[8192x512], s32[4096], axis 0",
       timed(lambda: mx.eval(mx.take(table, mx.clip(rows, 0, 8191), 0)), 50))
report("take (bare)", "f32[8192x512], s32[4096], axis 0",
       timed(lambda: mx.eval(mx.take(table, rows, 0)), 50))

upd = tensor((4096, 512), mx.float32, 1000)
idx2 = rows.reshape(4096, 1)


def scatter_add():
    col = idx2[:, 0]
    ok = (col >= 0) & (col < 8192)
    u = mx.where(ok.reshape(4096, 1, 1), upd.reshape(4096, 1, 512), 0.0)
    out = table.at[mx.clip(col, 0, 8191)].add(u.reshape(4096, 512))
    mx.eval(out)


report("scatter_add", "f32[8192x512] += f32[4096x512] at rows", timed(scatter_add, 20))

img = tensor((1024, 1024), mx.float32, 1000)
report("pad", "f32[1024x1024], lo/hi 1",
       timed(lambda: mx.eval(mx.pad(img, [(1, 1), (1, 1)], constant_values=mx.array(0.0))), 50))

x = tensor((8, 64, 64, 32), mx.float32, 1000)


def window_max():
    p = mx.pad(x, [(0, 0), (1, 1), (1, 1), (0, 0)], constant_values=mx.array(-float("inf")))
    for axis in (1, 2):
        p = window_max_axis(p, axis, 3, 2, (p.shape[axis] - 3) // 2 + 1)
    mx.eval(p)


report("window_max", "f32[8x64x64x32], 3x3 stride 2 pad 1", timed(window_max, 20))

packed = tensor((1048576,), mx.uint8, 256)
up = mx.array([0, 4], dtype=mx.int8)


def unpack():
    # Emily's composition for signed values: lift each nibble to the top of an int8, shift
    # it back down arithmetically.
    lifted = mx.left_shift(mx.view(packed.reshape(-1, 1), mx.int8), up)
    mx.eval(mx.right_shift(lifted, mx.array(4, mx.int8)).reshape(-1))


report("unpack_bits", "u8[1048576] -> s8[2097152] (s4)", timed(unpack, 50))
