#!/usr/bin/env python3
"""Quantizes the conformance suite's tiny decoders with mlx-lm and pins mlx-lm's outputs.

test/conformance/mlx_checkpoint_test.exs loads each checkpoint written here with
`Emily.Quantization.load_mlx/2` (packed u32 weights, scales, biases and the
`quantization` entry of config.json, as mlx-lm writes them) and compares with the
outputs of mlx-lm itself. Rerun this (from the repository root) after
scripts/conformance_models.py, which makes the float checkpoints quantized here:

    pip install mlx-lm        # with mlx (the CPU wheel does) and transformers
    python3 scripts/mlx_lm_models.py

Writes, per variant, test/conformance/models/<name>/ (what `mlx_lm.convert` writes, less
its README) and test/conformance/fixtures/<name>.json: the prompts' token ids (those of
the float model's fixture, checked against the converted tokenizer), mlx-lm's logits for
the first prompt, their argmax for every prompt, and its greedy tokens (12 per prompt,
the float fixture's count).

The tiny models' widths (32, 64) take group size 32, the one MLX group size that divides
every layer: at mlx-lm's default of 64 only the MLP's down projections would quantize.
"""

import json
import os
import shutil

import mlx.core as mx
import numpy as np
from mlx_lm import convert, load
from mlx_lm.generate import generate_step

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test", "conformance")
MODELS = os.path.join(ROOT, "models")
FIXTURES = os.path.join(ROOT, "fixtures")

# name: (float checkpoint, convert's keyword arguments)
VARIANTS = {
    "qwen3_mlx_q4": ("qwen3", dict(q_bits=4, q_group_size=32)),
    "qwen3_mlx_q8": ("qwen3", dict(q_bits=8, q_group_size=32)),
    # bf16 weights, scales and biases, as published mlx-lm checkpoints have them.
    "qwen3_mlx_q4_bf16": ("qwen3", dict(q_bits=4, q_group_size=32, dtype="bfloat16")),
    "llama_mlx_q4": ("llama", dict(q_bits=4, q_group_size=32)),
    "llama_mlx_q8": ("llama", dict(q_bits=8, q_group_size=32)),
    # mlx-lm's mixed recipe: 6 bits for some layers (codes that straddle u32 words), 4 for
    # the rest, each listed under its path in config.json's `quantization` entry.
    "llama_mlx_mixed_4_6": ("llama", dict(q_bits=4, q_group_size=32, quant_predicate="mixed_4_6")),
}

MAX_NEW_TOKENS = 12


def rnd(x, digits=7):
    return [round(float(v), digits) for v in np.asarray(x, dtype=np.float64).reshape(-1)]


def tensor_fixture(a):
    a = np.array(a.astype(mx.float32))
    return {"shape": list(a.shape), "data": rnd(a)}


def greedy(model, ids, n, eos):
    sampler = lambda logprobs: mx.argmax(logprobs, axis=-1)
    out = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=n, sampler=sampler):
        token = int(token)
        if token == eos:
            break
        out.append(token)
    return out


def build(name, base, kwargs):
    path = os.path.join(MODELS, name)
    if os.path.exists(path):
        shutil.rmtree(path)
    convert(os.path.join(MODELS, base), mlx_path=path, quantize=True, **kwargs)
    os.remove(os.path.join(path, "README.md"))

    with open(os.path.join(FIXTURES, base + ".json")) as f:
        float_fixture = json.load(f)
    with open(os.path.join(path, "generation_config.json")) as f:
        eos = json.load(f)["eos_token_id"]

    model, tokenizer = load(path)
    prompt_ids = float_fixture["prompt_ids"]
    for prompt, ids in zip(float_fixture["prompts"], prompt_ids):
        assert tokenizer.encode(prompt) == ids, (name, prompt)

    logits = [model(mx.array([ids])) for ids in prompt_ids]
    generated = [greedy(model, ids, MAX_NEW_TOKENS, eos) for ids in prompt_ids]
    assert all(len(g) == MAX_NEW_TOKENS for g in generated), (name, generated)

    with open(os.path.join(path, "config.json")) as f:
        quantization = json.load(f)["quantization"]

    fixture = {
        "base": base,
        "quantization": quantization,
        "prompt_ids": prompt_ids,
        "logits": tensor_fixture(logits[0]),
        "logits_argmax": [np.array(mx.argmax(l, axis=-1)).tolist() for l in logits],
        "max_new_tokens": MAX_NEW_TOKENS,
        "generated_ids": generated,
    }
    with open(os.path.join(FIXTURES, name + ".json"), "w") as f:
        json.dump(fixture, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    mx.set_default_device(mx.cpu)
    for name, (base, kwargs) in VARIANTS.items():
        build(name, base, kwargs)
        print("built", name)
