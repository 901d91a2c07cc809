#!/usr/bin/env python3
"""Builds the tiny random checkpoints of the conformance suite and pins Transformers' outputs.

The suite (test/conformance/*_test.exs) loads each checkpoint with Bumblebee, runs it on
Emily and compares with the reference outputs written here. The suite itself needs no
Python; rerun this (from the repository root) only to change a model or an input:

    pip install torch transformers safetensors tokenizers numpy
    python3 scripts/conformance_models.py

Writes, per model, test/conformance/models/<name>/ (config.json, model.safetensors,
tokenizer.json and tokenizer_config.json or preprocessor_config.json, and
generation_config.json for the generative ones) and test/conformance/fixtures/<name>.json.
Every model is seeded (torch.manual_seed(SEED + index)), the tokenizers are built here
from a constructed vocabulary (no download), and the inputs are formulas the suite
recomputes (images, audio) or strings it tokenizes (the fixture pins the token ids too).

Transformers 5 saves a few things Bumblebee 0.7 reads differently; `fix_config` and
`fix_preprocessor` rewrite them (see there), and the tests assert the loaded spec's key
fields, since a misread field would otherwise only show as a wrong number.
"""

import json
import math
import os
import shutil

import numpy as np
import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

SEED = 20260607
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test", "conformance")
MODELS = os.path.join(ROOT, "models")
FIXTURES = os.path.join(ROOT, "fixtures")

# Text the tokenizers cover; the prompts and sentences below use only these words.
WORDS = (
    "the quick brown fox jumps over lazy dog a cat sat on mat hello world emily runs "
    "models fast small tiny random weights test of text and image sound speech is it "
    "what who where when how good bad day night red blue green one two three"
).split()
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "a tiny cat sat on the red mat",
    "emily runs small models fast",
]
PROMPTS = ["the quick brown fox", "hello world", "a tiny cat sat on", "emily runs"]
MASKED = "the quick brown [MASK] jumps over the lazy dog"


def image(k, size=32):
    """Image k of the suite: uint8 {size, size, 3}, the same formula as Conformance.image/2."""
    y, x, c = np.meshgrid(np.arange(size), np.arange(size), np.arange(3), indexing="ij")
    return ((x * 7 + y * 13 + c * 51 + k * 37 + (x * y) % 17) % 256).astype(np.uint8)


def audio(k, n=16000):
    """Waveform k: f32 {n} at 16 kHz, the same formula as Conformance.audio/2 (computed in f32)."""
    t = np.arange(n, dtype=np.float32) / np.float32(16000)
    f1 = np.float32(220.0 * (k + 1))
    f2 = np.float32(1250.0 + 100.0 * k)
    two_pi = np.float32(2 * math.pi)
    return (np.float32(0.5) * np.sin(two_pi * f1 * t) + np.float32(0.25) * np.sin(two_pi * f2 * t)).astype(np.float32)


def rnd(x, digits=7):
    return [round(float(v), digits) for v in np.asarray(x, dtype=np.float64).reshape(-1)]


def tensor_fixture(t):
    a = t.detach().to(torch.float64).numpy()
    return {"shape": list(a.shape), "data": rnd(a)}


# -- tokenizers ------------------------------------------------------------------------


def wordpiece(specials):
    """A lowercase WordPiece tokenizer (BERT layout): specials first, then words, letters
    and ##letters, so every word splits and unknown words still tokenize."""
    letters = sorted(set("".join(WORDS)))
    vocab = list(specials) + sorted(set(WORDS)) + letters + ["##" + l for l in letters]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return tok, vocab


def byte_bpe(specials_first=(), specials_last=(), template=None):
    """A byte-level BPE tokenizer (GPT-2 layout) over the 256 byte symbols and one merge
    chain per word, so each word of WORDS (with or without its leading space) is one token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_syms = sorted(alphabet)
    vocab, merges = {}, []
    for t in specials_first:
        vocab[t] = len(vocab)
    for s in byte_syms:
        vocab[s] = len(vocab)
    # Each word's chain of merges, then one merge of the space symbol with the whole word,
    # so " word" does not fall apart on a merge of another word's chain.
    def merge(a, b):
        if a + b not in vocab:
            merges.append((a, b))
            vocab[a + b] = len(vocab)

    for word in WORDS:
        cur = word[0]
        for ch in word[1:]:
            merge(cur, ch)
            cur += ch
        merge("\u0120", word)
    for t in specials_last:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = list(specials_first) + list(specials_last)
    tok.add_special_tokens(specials)
    if template:
        tok.post_processor = template(vocab)
    return tok, vocab


def save_tokenizer(tok, path, **special):
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    fast.save_pretrained(path)
    return fast


# -- saved-config fix-ups ----------------------------------------------------------------


def fix_config(path):
    """Transformers 5 nests the RoPE base under `rope_parameters`; Bumblebee 0.7 reads
    `rope_theta` (and `rope_scaling` for a non-default type) and otherwise silently uses
    its own default base."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)

    def fix(c):
        # Transformers writes an unset token id as null, which Bumblebee rejects.
        for key in [k for k, v in c.items() if k.endswith("token_id") and v is None]:
            del c[key]
        rp = c.pop("rope_parameters", None)
        if rp:
            c["rope_theta"] = rp["rope_theta"]
            assert rp.get("rope_type", "default") == "default", rp
        for sub in ("text_config", "vision_config"):
            if isinstance(c.get(sub), dict):
                fix(c[sub])

    fix(cfg)
    with open(file, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    return cfg


# Image-processor classes Transformers 5 saves, and the feature-extractor names Bumblebee
# 0.7 maps (it maps only a few `image_processor_type` values).
PROCESSOR_NAMES = {
    "ViTImageProcessor": "ViTFeatureExtractor",
    "ViTImageProcessorFast": "ViTFeatureExtractor",
    "ConvNextImageProcessor": "ConvNextFeatureExtractor",
    "ConvNextImageProcessorFast": "ConvNextFeatureExtractor",
    "CLIPImageProcessor": "CLIPFeatureExtractor",
    "CLIPImageProcessorFast": "CLIPFeatureExtractor",
}


def fix_preprocessor(path):
    file = os.path.join(path, "preprocessor_config.json")
    with open(file) as f:
        cfg = json.load(f)
    kind = cfg.pop("image_processor_type", None)
    if kind:
        cfg["feature_extractor_type"] = PROCESSOR_NAMES[kind]
    with open(file, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    return cfg


def save_model(model, name):
    path = os.path.join(MODELS, name)
    if os.path.exists(path):
        shutil.rmtree(path)
    model.save_pretrained(path)
    cfg = fix_config(path)
    # Transformers 5 writes a generation config for generative models; the tests own it.
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    return path, cfg


def save_generation(path, **kw):
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(kw, f, indent=2, sort_keys=True)


def write_fixture(name, data):
    os.makedirs(FIXTURES, exist_ok=True)
    with open(os.path.join(FIXTURES, name + ".json"), "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


def perturb_norms(model, gen):
    """Random weights for every norm layer (their default ones/zeros would hide a
    misplaced scale) and, for batch norm, random running statistics."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.LayerNorm, torch.nn.BatchNorm2d)) or type(m).__name__.endswith("RMSNorm"):
                if getattr(m, "weight", None) is not None:
                    m.weight.copy_(1.0 + 0.2 * torch.randn(m.weight.shape, generator=gen))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(1.0 + 0.5 * torch.rand(m.running_var.shape, generator=gen))


def seeded(index):
    torch.manual_seed(SEED + index)
    return torch.Generator().manual_seed(SEED + 1000 + index)


def greedy(model, input_ids, n, eos=None, **kw):
    """Transformers' greedy search (generate, do_sample=False), no logits processors."""
    cfg = tf.GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=n, eos_token_id=eos, pad_token_id=eos
    )
    out = model.generate(input_ids=input_ids, generation_config=cfg, **kw)
    return out


# -- models -----------------------------------------------------------------------------


def distilbert():
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok, vocab = wordpiece(specials)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    common = dict(
        vocab_size=len(vocab), dim=32, n_layers=2, n_heads=4, hidden_dim=64,
        max_position_embeddings=64, pad_token_id=0,
        # Transformers 5 leaves a tied head out of the checkpoint, and Bumblebee's
        # DistilBERT reads the head's own weight (as older checkpoints hold it).
        tie_word_embeddings=False,
    )
    special = dict(unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")

    # Masked LM (fill-mask, and the base model's hidden states for text embedding).
    gen = seeded(0)
    mlm = tf.DistilBertForMaskedLM(tf.DistilBertConfig(**common)).eval()
    perturb_norms(mlm, gen)
    path, _ = save_model(mlm, "distilbert_mlm")
    fast = save_tokenizer(tok, path, **special)
    enc = fast(SENTENCES, padding=True, return_tensors="pt")
    menc = fast([MASKED], return_tensors="pt")
    with torch.no_grad():
        out = mlm(**enc, output_hidden_states=True)
        mout = mlm(**menc)
    mask_pos = int((menc["input_ids"][0] == 4).nonzero()[0])
    probs = torch.softmax(mout.logits[0, mask_pos], -1)
    top = torch.topk(probs, 5)
    hidden = out.hidden_states[-1]
    m = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * m).sum(1) / m.sum(1)
    write_fixture("distilbert_mlm", {
        "sentences": SENTENCES,
        "input_ids": enc["input_ids"].tolist(),
        "attention_mask": enc["attention_mask"].tolist(),
        "logits_slice": tensor_fixture(out.logits[:, :, :16]),
        "logits_argmax": out.logits.argmax(-1).tolist(),
        "hidden_state_slice": tensor_fixture(hidden[:, :, :8]),
        "mean_pooled": tensor_fixture(pooled),
        "masked": MASKED,
        # Bumblebee's fill-mask serving names a token by decoding it alone, special tokens
        # skipped (so [UNK] reads "").
        "fill_mask": [
            {"id": int(i), "token": fast.decode([int(i)], skip_special_tokens=True), "score": float(s)}
            for s, i in zip(top.values, top.indices)
        ],
    })

    # Sequence classification.
    gen = seeded(1)
    labels = ["negative", "neutral", "positive"]
    cls_cfg = tf.DistilBertConfig(
        **common, num_labels=3, id2label=dict(enumerate(labels)), label2id={l: i for i, l in enumerate(labels)}
    )
    cls = tf.DistilBertForSequenceClassification(cls_cfg).eval()
    perturb_norms(cls, gen)
    path, _ = save_model(cls, "distilbert_cls")
    fast = save_tokenizer(tok, path, **special)
    with torch.no_grad():
        out = cls(**enc)
    probs = torch.softmax(out.logits, -1)
    write_fixture("distilbert_cls", {
        "sentences": SENTENCES,
        "logits": tensor_fixture(out.logits),
        "predictions": [
            [{"label": labels[int(i)], "score": float(p[i])} for i in torch.argsort(p, descending=True)]
            for p in probs
        ],
    })


# The tied models get a larger initialisation: with the default one the embedding
# dominates the residual stream and greedy decoding repeats the last token forever.


def decoder_lm(name, index, config, tok, special, eos):
    gen = seeded(index)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    perturb_norms(model, gen)
    path, _ = save_model(model, name)
    fast = save_tokenizer(tok, path, **special)
    save_generation(path, eos_token_id=eos, pad_token_id=eos, bos_token_id=config.bos_token_id)
    ids = [fast(p, return_tensors="pt")["input_ids"] for p in PROMPTS]
    with torch.no_grad():
        out = model(input_ids=ids[0], output_hidden_states=True)
    n = 12
    generated = []
    for i in ids:
        seq = greedy(model, i, n, eos=eos)[0, i.shape[1]:].tolist()
        assert len(seq) == n and eos not in seq, (name, seq)
        generated.append(seq)
    texts = [fast.decode(g, skip_special_tokens=True) for g in generated]
    write_fixture(name, {
        "prompts": PROMPTS,
        "prompt_ids": [i[0].tolist() for i in ids],
        "logits_slice": tensor_fixture(out.logits[:, :, :16]),
        "logits_argmax": out.logits.argmax(-1).tolist(),
        "hidden_state_slice": tensor_fixture(out.hidden_states[-1][:, :, :8]),
        "max_new_tokens": n,
        "generated_ids": generated,
        "generated_text": texts,
    })


def qwen3():
    tok, vocab = byte_bpe(specials_first=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    eos = vocab["<|endoftext|>"]
    cfg = tf.Qwen3Config(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.2,
        bos_token_id=None, eos_token_id=eos, pad_token_id=eos,
    )
    decoder_lm("qwen3", 2, cfg, tok, dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>"), eos)


def llama():
    tok, vocab = byte_bpe(
        specials_first=["<unk>", "<s>", "</s>"],
        template=lambda v: processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", v["<s>"])]),
    )
    eos = vocab["</s>"]
    # Grouped-query attention: 8 query heads share 2 key/value heads.
    cfg = tf.LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=20000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=vocab["<s>"], eos_token_id=eos, pad_token_id=None,
    )
    decoder_lm("llama", 3, cfg, tok, dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"), eos)


def bart():
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok, vocab = byte_bpe(
        specials_first=specials,
        template=lambda v: processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", v["<s>"]), ("</s>", v["</s>"])]
        ),
    )
    gen = seeded(4)
    cfg = tf.BartConfig(
        vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64, bos_token_id=0, pad_token_id=1, eos_token_id=2,
        decoder_start_token_id=2, forced_bos_token_id=None, forced_eos_token_id=None,
        scale_embedding=False, init_std=0.2,
    )
    model = tf.BartForConditionalGeneration(cfg).eval()
    perturb_norms(model, gen)
    path, _ = save_model(model, "bart")
    # Transformers 5 keeps only `model.shared` of the three tied embeddings; Bumblebee
    # reads the encoder's and the decoder's (as BART checkpoints on the Hub hold them).
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    for side in ("encoder", "decoder"):
        weights[f"model.{side}.embed_tokens.weight"] = weights["model.shared.weight"].clone()
    save_file(weights, file, metadata={"format": "pt"})
    fast = save_tokenizer(tok, path, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>", sep_token="</s>", cls_token="<s>")
    save_generation(path, bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2)
    ids = [fast(p, return_tensors="pt")["input_ids"] for p in SENTENCES]
    dec = torch.tensor([[2, 0, vocab["Ġthe"], vocab["Ġquick"]]])
    with torch.no_grad():
        out = model(input_ids=ids[0], decoder_input_ids=dec, output_hidden_states=True)
    n = 12
    generated = []
    for i in ids:
        seq = greedy(model, i, n, eos=2)[0].tolist()
        assert seq[0] == 2, seq
        seq = seq[1:]
        assert len(seq) == n and 2 not in seq, seq
        generated.append(seq)
    # Bumblebee's generation serving pads every input on the left to its sequence length
    # (16 here), and BART's positions are absolute: the serving's reference is
    # Transformers on the same padded batch.
    fast.padding_side = "left"
    padded = fast(SENTENCES, padding="max_length", max_length=16, return_tensors="pt")
    served = greedy(model, padded["input_ids"], n, eos=2, attention_mask=padded["attention_mask"])[:, 1:]
    assert served.shape[1] == n
    write_fixture("bart", {
        "serving_generated_text": [fast.decode(g, skip_special_tokens=True) for g in served.tolist()],
        "sentences": SENTENCES,
        "input_ids": [i[0].tolist() for i in ids],
        "decoder_input_ids": dec[0].tolist(),
        "logits_slice": tensor_fixture(out.logits[:, :, :16]),
        "logits_argmax": out.logits.argmax(-1).tolist(),
        "encoder_hidden_state_slice": tensor_fixture(out.encoder_last_hidden_state[:, :, :8]),
        "decoder_hidden_state_slice": tensor_fixture(out.decoder_hidden_states[-1][:, :, :8]),
        "max_new_tokens": n,
        "generated_ids": generated,
        "generated_text": [fast.decode(g, skip_special_tokens=True) for g in generated],
    })


def image_classifier(name, index, model, processor, labels):
    gen = seeded(index)
    model.eval()
    perturb_norms(model, gen)
    path, _ = save_model(model, name)
    processor.save_pretrained(path)
    fix_preprocessor(path)
    images = [image(k) for k in range(4)]
    pixel = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model(pixel_values=pixel, output_hidden_states=True)
    probs = torch.softmax(out.logits, -1)
    write_fixture(name, {
        "logits": tensor_fixture(out.logits),
        "hidden_state_slice": tensor_fixture(out.hidden_states[-1].flatten(1)[:, :16]),
        "pixel_values_slice": tensor_fixture(pixel[:, :, :2, :4]),
        "predictions": [
            [{"label": labels[int(i)], "score": float(p[i])} for i in torch.argsort(p, descending=True)]
            for p in probs
        ],
    })


LABELS = ["ant", "bee", "cat", "dog", "eel"]


def vit():
    seeded(5)
    cfg = tf.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=5,
        id2label=dict(enumerate(LABELS)), label2id={l: i for i, l in enumerate(LABELS)},
    )
    # Images already at the model's size, not resized: the test is of the model, and the
    # two libraries' resampling differs.
    proc = tf.ViTImageProcessor(do_resize=False, size={"height": 32, "width": 32},
                                image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3])
    image_classifier("vit", 5, tf.ViTForImageClassification(cfg), proc, LABELS)


def resnet():
    seeded(6)
    cfg = tf.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 24], depths=[1, 2, 1],
        layer_type="bottleneck", hidden_act="relu", num_labels=5,
        id2label=dict(enumerate(LABELS)), label2id={l: i for i, l in enumerate(LABELS)},
    )
    proc = tf.ConvNextImageProcessor(do_resize=False, size={"shortest_edge": 32},
                                     image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    image_classifier("resnet", 6, tf.ResNetForImageClassification(cfg), proc, LABELS)


def clip():
    tok, vocab = byte_bpe(
        specials_last=["<|startoftext|>", "<|endoftext|>"],
        template=lambda v: processors.TemplateProcessing(
            single="<|startoftext|> $A <|endoftext|>",
            special_tokens=[("<|startoftext|>", v["<|startoftext|>"]), ("<|endoftext|>", v["<|endoftext|>"])],
        ),
    )
    eos = vocab["<|endoftext|>"]
    gen = seeded(7)
    cfg = tf.CLIPConfig(
        text_config=dict(
            vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=16, bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=eos, pad_token_id=eos, projection_dim=16,
        ),
        vision_config=dict(
            image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, projection_dim=16,
        ),
        projection_dim=16,
    )
    model = tf.CLIPModel(cfg).eval()
    perturb_norms(model, gen)
    path, _ = save_model(model, "clip")
    fast = save_tokenizer(tok, path, bos_token="<|startoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    proc = tf.CLIPImageProcessor(do_resize=False, do_center_crop=True, crop_size={"height": 32, "width": 32},
                                 size={"shortest_edge": 32})
    proc.save_pretrained(path)
    fix_preprocessor(path)
    enc = fast(SENTENCES, padding="max_length", max_length=16, return_tensors="pt")
    pixel = proc(images=[image(k) for k in range(4)], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], pixel_values=pixel)
    write_fixture("clip", {
        "sentences": SENTENCES,
        "input_ids": enc["input_ids"].tolist(),
        "attention_mask": enc["attention_mask"].tolist(),
        "logits_per_text": tensor_fixture(out.logits_per_text),
        "text_embeds": tensor_fixture(out.text_embeds),
        "image_embeds": tensor_fixture(out.image_embeds),
    })


def whisper():
    # The special tokens follow the ordinary vocabulary, as in Whisper's own tokenizer:
    # Bumblebee reads every id above <|notimestamps|> as a timestamp.
    specials = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>",
                "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
    tok, vocab = byte_bpe(specials_last=specials)
    v = {t: vocab[t] for t in specials}
    gen = seeded(8)
    cfg = tf.WhisperConfig(
        vocab_size=len(vocab), num_mel_bins=80, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=50, max_target_positions=64,
        pad_token_id=v["<|endoftext|>"], bos_token_id=v["<|endoftext|>"], eos_token_id=v["<|endoftext|>"],
        decoder_start_token_id=v["<|startoftranscript|>"], suppress_tokens=[], begin_suppress_tokens=[],
    )
    model = tf.WhisperForConditionalGeneration(cfg).eval()
    perturb_norms(model, gen)
    path, _ = save_model(model, "whisper")
    fast = save_tokenizer(tok, path, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    # One-second windows (Whisper's are 30 s): 100 frames, 50 encoder positions.
    fe = tf.WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=1, n_fft=400)
    fe.save_pretrained(path)
    save_generation(
        path, decoder_start_token_id=v["<|startoftranscript|>"], eos_token_id=v["<|endoftext|>"],
        pad_token_id=v["<|endoftext|>"], bos_token_id=v["<|endoftext|>"], no_timestamps_token_id=v["<|notimestamps|>"],
        lang_to_id={"<|en|>": v["<|en|>"], "<|de|>": v["<|de|>"]},
        task_to_id={"transcribe": v["<|transcribe|>"], "translate": v["<|translate|>"]},
        is_multilingual=True, suppress_tokens=[], begin_suppress_tokens=[],
    )
    waves = [audio(k) for k in range(4)]
    feats = fe(waves, sampling_rate=16000, return_tensors="pt")["input_features"]
    prefix = [v["<|startoftranscript|>"], v["<|en|>"], v["<|transcribe|>"], v["<|notimestamps|>"]]
    with torch.no_grad():
        out = model(input_features=feats[:1], decoder_input_ids=torch.tensor([prefix]), output_hidden_states=True)
        # Greedy decoding after the forced prefix, Transformers' forward pass step by step
        # (generate's Whisper path needs a full multilingual generation config).
        n = 12
        generated = []
        for k in range(4):
            seq = list(prefix)
            for _ in range(n):
                logits = model(input_features=feats[k:k + 1], decoder_input_ids=torch.tensor([seq])).logits
                seq.append(int(logits[0, -1].argmax()))
            new = seq[len(prefix):]
            assert v["<|endoftext|>"] not in new, new
            generated.append(new)
    write_fixture("whisper", {
        "input_features_slice": tensor_fixture(feats[:, :4, :8]),
        "decoder_input_ids": prefix,
        "logits_slice": tensor_fixture(out.logits[:, :, :16]),
        "logits_argmax": out.logits.argmax(-1).tolist(),
        "encoder_hidden_state_slice": tensor_fixture(out.encoder_last_hidden_state[:, :8, :8]),
        "max_new_tokens": n,
        "generated_ids": generated,
        "generated_text": [fast.decode(g, skip_special_tokens=True) for g in generated],
    })


if __name__ == "__main__":
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    os.makedirs(MODELS, exist_ok=True)
    for build in (distilbert, qwen3, llama, bart, vit, resnet, clip, whisper):
        build()
        print("built", build.__name__)
