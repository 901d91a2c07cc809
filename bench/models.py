"""Python side of bench/models.exs: mlx-lm (on the same libmlx as Emily) and Transformers
on PyTorch, on the checkpoints bench/make_models.py makes. Each command prints
`name value` lines (bench/support/bench.exs, `Bench.python/3`):

    python3 bench/models.py generate mlx|torch DIR IDS N [DEVICE] [--serve]
        greedy generation of N tokens from the prompt in the file IDS (token ids, one
        line, space-separated) with the checkpoint in DIR, in the checkpoint's dtype,
        after a warm-up generation of 2 tokens from the prompt's first 8. Prints
        prefill_ms (from the call to the first token), decode_tok_s (tokens 2..N over
        the time from the first token to the last), total_s, rss_peak_mb (the process's
        peak resident memory, loading included), mlx_peak_mb (MLX's own peak, mlx
        only), build_ms (mlx only: the model calls' graph building, a call), and writes
        the generated ids to IDS.out. DEVICE: cpu (default) or cuda (torch) / gpu (mlx).
        With --serve, the model is loaded and warmed up once, `ready` is printed, and
        each line read from stdin runs one generation, answered by one line of
        `name=value` pairs (bench/support/bench.exs, `Bench.python_request/2`): the
        rounds of bench/models.exs, alternated with Emily's.
    python3 bench/models.py bandwidth
        the memory bandwidth of a 1 GiB f32 copy (numpy: bytes read + written) and of a
        sum over it (PyTorch, all threads: bytes read), GB/s.
    python3 bench/models.py bert DIR BATCHES [DEVICE] --serve
        a server of timed windows (bench/support/bench.py, `serve`) of the BERT forward
        pass (Transformers' BertModel, last hidden state and pooled output) on token ids
        {batch, 128} (bench/models.exs sends the same ids), one run name per batch size:
        `bert_B`. DEVICE: cpu (default) or cuda.

Threads: PyTorch uses every core (torch.set_num_threads(os.cpu_count())), as MLX's
OpenBLAS does. mlx-lm is run with OpenBLAS preloaded (bench/models.exs sets LD_PRELOAD):
the stock wheel's reference BLAS multiplies at a few GFLOP/s.
"""
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
import bench  # noqa: E402


def rss_peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def read_ids(path):
    with open(path) as f:
        return [int(x) for x in f.read().split()]


def mlx_greedy(model, prompt, count):
    """mlx-lm's greedy `generate_step` of `count` tokens from `prompt`: the start time, the
    tokens, and the time each arrived."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    sampler = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731
    tokens, times = [], []
    t0 = time.perf_counter()
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=count, sampler=sampler):
        tokens.append(int(token))
        times.append(time.perf_counter())
    return t0, tokens, times


class Timed:
    """A model whose calls are timed: mlx-lm's graph building for a step or a prompt
    (lazy nodes only; nothing is evaluated inside the model's call)."""

    def __init__(self, model):
        self.model, self.seconds, self.calls = model, 0.0, 0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.model(*args, **kwargs)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def mlx_generator(path, ids, n, device):
    """Loads the checkpoint and warms mlx-lm up: a function of one timed generation."""
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.utils import load_model

    if device == "gpu":
        mx.set_default_device(mx.gpu)
    model, _ = load_model(Path(path))
    mlx_greedy(model, ids[:8], 2)

    def run():
        mx.reset_peak_memory()
        timed = Timed(model)
        t0, tokens, times = mlx_greedy(timed, ids, n)
        return t0, tokens, times, {"mlx_peak_mb": mx.get_peak_memory() / 2**20,
                                   "build_ms": timed.seconds / timed.calls * 1e3}

    return run


def torch_generator(path, ids, n, device):
    """Loads the checkpoint and warms Transformers up: a function of one timed generation."""
    import torch
    import transformers as tf
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(os.cpu_count())
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype="auto").to(device).eval()
    # No end token: every run makes N tokens, as Bumblebee's and mlx-lm's do.
    model.generation_config.eos_token_id = None

    def config(count):
        return tf.GenerationConfig(
            do_sample=False, num_beams=1, max_new_tokens=count, eos_token_id=None,
            pad_token_id=model.config.pad_token_id,
        )

    class Times(BaseStreamer):
        """The time each new token arrives (the first put is the prompt)."""

        def __init__(self):
            self.times, self.puts = [], 0

        def put(self, value):
            self.puts += 1
            if self.puts > 1:
                if device == "cuda":
                    torch.cuda.synchronize()
                self.times.append(time.perf_counter())

        def end(self):
            pass

    def generate_from(prompt, count):
        streamer = Times()
        x = torch.tensor([prompt], device=device)
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(
                input_ids=x, attention_mask=torch.ones_like(x),
                generation_config=config(count),
                streamer=streamer,
            )
        return t0, out[0, len(prompt):].tolist(), streamer.times

    generate_from(ids[:8], 2)
    return lambda: generate_from(ids, n) + ({},)


def timed_generation(run, ids_file, n):
    """One generation's figures; its ids go to IDS.out."""
    t0, tokens, times, extra = run()
    assert len(tokens) == n and len(times) == n, (len(tokens), len(times))
    with open(ids_file + ".out", "w") as f:
        f.write(" ".join(map(str, tokens)) + "\n")
    return {
        "prefill_ms": (times[0] - t0) * 1e3,
        "decode_tok_s": (n - 1) / (times[-1] - times[0]),
        "total_s": times[-1] - t0,
        "rss_peak_mb": rss_peak_mb(),
        **extra,
    }


def generate(impl, path, ids_file, n, device, serve):
    run = {"mlx": mlx_generator, "torch": torch_generator}[impl](path, read_ids(ids_file), n, device)
    if not serve:
        for name, value in timed_generation(run, ids_file, n).items():
            print(f"{name} {value:.4f}", flush=True)
        return
    print("ready", flush=True)
    for _request in sys.stdin:
        figures = timed_generation(run, ids_file, n)
        print(" ".join(f"{name}={value:.4f}" for name, value in figures.items()), flush=True)


def bandwidth():
    import numpy as np
    import torch

    n = 256 * 2**20  # 1 GiB of f32
    src = np.ones(n, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t = bench.best(lambda: np.copyto(dst, src), 1, rounds=5) / 1e6
    print(f"copy_gbs {2 * n * 4 / t / 1e9:.4f}")
    torch.set_num_threads(os.cpu_count())
    x = torch.from_numpy(src)
    t = bench.best(lambda: x.sum(), 1, rounds=5) / 1e6
    print(f"read_gbs {n * 4 / t / 1e9:.4f}", flush=True)


def bert(path, batches, device):
    import torch
    import transformers as tf

    torch.set_num_threads(os.cpu_count())
    model = tf.BertModel.from_pretrained(path).to(device).eval()
    runs = {}
    for b in batches:
        x = bert_ids(b, model.config.vocab_size).to(device)
        mask = torch.ones_like(x)

        def run(x=x, mask=mask):
            with torch.no_grad():
                out = model(input_ids=x, attention_mask=mask)
            if device == "cuda":
                torch.cuda.synchronize()
            return out.last_hidden_state, out.pooler_output

        runs[f"bert_{b}"] = run
    bench.serve(runs)


def bert_ids(batch, vocab, seq=128):
    """Token ids {batch, seq}: (i * 7919 + 13) mod vocab over the flat index, the formula
    bench/models.exs uses."""
    import torch

    return (torch.arange(batch * seq, dtype=torch.int64) * 7919 + 13).remainder(vocab).reshape(batch, seq)


def main():
    cmd = sys.argv[1]
    if cmd == "generate":
        serve = "--serve" in sys.argv
        args = [a for a in sys.argv[2:] if a != "--serve"]
        impl, path, ids_file, n = args[:4]
        device = args[4] if len(args) > 4 else "cpu"
        generate(impl, path, ids_file, int(n), device, serve)
    elif cmd == "bandwidth":
        bandwidth()
    elif cmd == "bert":
        device = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "--serve" else "cpu"
        bert(sys.argv[2], [int(b) for b in sys.argv[3].split(",")], device)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
