"""Python side of bench/quantized.exs: mlx-lm (on the same libmlx as Emily) generating
from bench/make_models.py's bf16 Qwen3 checkpoint, as it is or quantized by mlx-lm's own
`quantize_model` (affine, group 64). Prints `name value` lines (bench/support/bench.exs,
`Bench.python/3`):

    python3 bench/quantized.py generate DIR IDS N BITS [DEVICE]
        loads DIR (lazily), quantizes every layer mlx-lm's `quantize_model` takes (each
        Linear and the Embedding, which the tied LM head multiplies by through
        `as_linear`) to BITS (8 or 4; 16: left in bf16), evaluates the weights, then
        runs greedy `generate_step` of N tokens from the prompt in the file IDS (token
        ids, one line), after a warm-up of 2 tokens from its first 8, and writes the
        ids to IDS.out. Prints load_s (load, quantize and evaluate), weight_bytes (the
        bytes of the model's parameters), quantized_layers and float_layers (the
        Linear and Embedding layers quantized and left float), prefill_ms (from the
        call to the first token), decode_tok_s (tokens 2..N over the time from the
        first to the last), total_s, rss_load_mb (the process's peak resident memory
        from its start to the end of the warm-up), rss_peak_mb (the peak during the
        timed generation: the high-water mark is reset after the warm-up) and
        mlx_peak_mb (MLX's own peak during it). DEVICE: cpu (default) or gpu.

Run with OpenBLAS preloaded (bench/quantized.exs sets LD_PRELOAD), as Emily links it.
"""
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import mlx_greedy, read_ids  # noqa: E402


def status_mb(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) / 1024


def reset_rss_peak():
    """Resets the process's peak RSS (VmHWM) to its current RSS, as bench/quantized.exs
    does on Emily's side."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def generate(path, ids_file, n, bits, device):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, quantize_model

    if device == "gpu":
        mx.set_default_device(mx.gpu)
    ids = read_ids(ids_file)
    t0 = time.perf_counter()
    # Lazy, as mlx_lm.convert loads: each bf16 weight is read when its quantization is
    # evaluated.
    model, config = load_model(Path(path), lazy=True)
    if bits != 16:
        # (quantize_model prints its bits per weight to stdout; kept off the figures.)
        stdout, sys.stdout = sys.stdout, sys.stderr
        try:
            model, _ = quantize_model(model, config, group_size=64, bits=bits, mode="affine")
        finally:
            sys.stdout = stdout
    mx.eval(model.parameters())
    load_s = time.perf_counter() - t0

    layers = [m for _, m in model.named_modules()]
    quantized = sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in layers)
    floats = sum(type(m) in (nn.Linear, nn.Embedding) for m in layers)
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    mlx_greedy(model, ids[:8], 2)
    rss_load = status_mb("VmHWM")
    reset_rss_peak()
    mx.reset_peak_memory()
    t0, tokens, times = mlx_greedy(model, ids, n)
    assert len(tokens) == n and len(times) == n, (len(tokens), len(times))
    with open(ids_file + ".out", "w") as f:
        f.write(" ".join(map(str, tokens)) + "\n")
    figures = {
        "load_s": load_s,
        "weight_bytes": weight_bytes,
        "quantized_layers": quantized,
        "float_layers": floats,
        "prefill_ms": (times[0] - t0) * 1e3,
        "decode_tok_s": (n - 1) / (times[-1] - times[0]),
        "total_s": times[-1] - t0,
        "rss_load_mb": rss_load,
        "rss_peak_mb": status_mb("VmHWM"),
        "mlx_peak_mb": mx.get_peak_memory() / 2**20,
    }
    for name, value in figures.items():
        print(f"{name} {value:.4f}", flush=True)


def main():
    if len(sys.argv) >= 6 and sys.argv[1] == "generate":
        path, ids_file, n, bits = sys.argv[2:6]
        device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
        generate(path, ids_file, int(n), int(bits), device)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
