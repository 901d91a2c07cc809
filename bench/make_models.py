#!/usr/bin/env python3
"""Makes the random checkpoints bench/models.exs runs: a Qwen3-0.6B-shaped decoder and a
BERT-base-shaped encoder, seeded, saved by Transformers as safetensors (no download).

    pip install torch transformers safetensors tokenizers
    python3 bench/make_models.py [DIR]       # DIR default: $EMILY_CACHE/bench-models

Writes DIR/qwen3-f32 and DIR/qwen3-bf16 (the same weights, the second rounded to bf16 by
PyTorch, 2.4 and 1.2 GB), and DIR/bert-f32 (0.4 GB); a directory already there is kept
(delete it to remake it). The Qwen3 shape: 28 layers, hidden 1024, 16 query / 8
key-value heads of 128, MLP 3072, vocabulary 151936, tied embeddings, RoPE base 1e6.
Its tokenizer is byte-level BPE with no merges over a vocabulary of the model's size
(the 256 byte symbols, fillers, then Qwen's three special tokens at Qwen's ids), so
every ASCII character of a prompt is one token and every id decodes; BERT gets none
(the bench feeds it token ids).
"""

import json
import os
import sys

import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SEED = 20261201
VOCAB = 151936
# Qwen's special tokens and their ids (Qwen3's tokenizer), last in the vocabulary.
SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}


def default_dir():
    cache = os.environ.get("EMILY_CACHE", os.path.expanduser("~/.cache/emily"))
    return os.path.join(cache, "bench-models")


def fix_config(path):
    """Transformers 5 nests the RoPE base under `rope_parameters`; Bumblebee 0.7 reads
    `rope_theta` and otherwise silently uses its own default (as
    scripts/conformance_models.py does for the suite's models). An unset token id is
    written as null, which Bumblebee rejects."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    for key in [k for k, v in cfg.items() if k.endswith("token_id") and v is None]:
        del cfg[key]
    rp = cfg.pop("rope_parameters", None)
    if rp:
        assert rp.get("rope_type", "default") == "default", rp
        cfg["rope_theta"] = rp["rope_theta"]
    with open(file, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def bytes_to_unicode():
    """GPT-2's byte-level alphabet: the symbol that stands for each byte, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    bs += list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer():
    """Byte-level BPE without merges: one token per byte, whose id is the byte (so a
    prompt's ids are its bytes), the vocabulary padded to the model's size with fillers
    (which decode as their text) so that every id decodes."""
    symbols = bytes_to_unicode()
    assert set(symbols.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbols[b]: b for b in range(256)}
    specials = {i: t for t, i in SPECIALS.items()}
    for i in range(len(vocab), VOCAB):
        vocab[specials.get(i, f"tok{i}")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )


def qwen3(root):
    torch.manual_seed(SEED)
    cfg = tf.Qwen3Config(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1.0e6, rms_norm_eps=1e-6,
        tie_word_embeddings=True, initializer_range=0.1, bos_token_id=None,
        eos_token_id=SPECIALS["<|endoftext|>"], pad_token_id=SPECIALS["<|endoftext|>"],
    )
    # (initializer_range 0.1, not the default 0.02: with that, the embedding dominates the
    # residual stream and greedy decoding repeats one token, which would make the token
    # check across the implementations nearly empty.)
    model = tf.Qwen3ForCausalLM(cfg).eval()
    # Random norm weights around one (their default ones would hide a misplaced scale).
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    tok = byte_tokenizer()
    for dtype, name in [(torch.float32, "qwen3-f32"), (torch.bfloat16, "qwen3-bf16")]:
        path = os.path.join(root, name)
        tok.save_pretrained(path)
        if os.path.exists(os.path.join(path, "model.safetensors")):
            print("kept", path, "(tokenizer written)")
            continue
        model.to(dtype).save_pretrained(path)
        fix_config(path)
        # The bench sets the generation options itself (greedy, no end token).
        gen_file = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_file):
            os.remove(gen_file)
        print("built", path)


def bert(root):
    path = os.path.join(root, "bert-f32")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        print("kept", path)
        return
    torch.manual_seed(SEED + 2)
    cfg = tf.BertConfig(
        vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        intermediate_size=3072, max_position_embeddings=512,
    )
    tf.BertModel(cfg).eval().save_pretrained(path)
    fix_config(path)
    print("built", path)


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else default_dir()
    os.makedirs(root, exist_ok=True)
    qwen3(root)
    bert(root)
