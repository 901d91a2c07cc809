# One rank of bench/distributed.exs's Python reference: all_sum over MLX's ring backend
# through mlx.core.distributed, on the libmlx Emily loads. The rank and the hosts come
# from MLX's own environment variables (MLX_RANK, MLX_HOSTFILE: a JSON list of
# ["ip:port"] lists, one per rank), as a Python launch gives them.
#
# It reads commands from stdin, one a line, and answers each on stdout:
#
#     bw BYTES ITERS  ->  us MEAN   (mean time of one all_sum of a BYTES-long f32 buffer)
#     quit
import sys
import time

import mlx.core as mx

mx.set_default_device(mx.cpu)
group = mx.distributed.init(strict=True, backend="ring")
print(f"ready {group.rank()} {group.size()}", flush=True)

for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
        break
    n, iters = int(cmd[1]) // 4, int(cmd[2])
    x = mx.ones((n,), dtype=mx.float32)
    mx.eval(x)
    # One untimed collective: a warm-up, and a barrier that lines the ranks up.
    mx.eval(mx.distributed.all_sum(x, group=group))
    t0 = time.perf_counter()
    for _ in range(iters):
        mx.eval(mx.distributed.all_sum(x, group=group))
    print(f"us {(time.perf_counter() - t0) / iters * 1e6}", flush=True)
