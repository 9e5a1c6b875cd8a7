"""Build tiny, fully offline Qwen-style checkpoints for tests and CPU RL experiments.

The checkpoints are saved with ``save_pretrained`` and load with ``from_pretrained(path)``
exactly like real Qwen2.5-VL / Qwen2 checkpoints (config, safetensors weights, tokenizer,
chat template, image processor, generation config), so RL code paths are exercised
unchanged while a full build + warm-up stays well under a minute on 2 CPU cores.

The optional warm-up only teaches the answer *format*: labels are drawn independently
of the input, so afterwards the VL model answers ``<answer>colour</answer>`` with each
colour ~25% of the time and has to learn to look at the image through RL.

CLI::

    python -m data_tools.make_tiny_model --kind vl|text --out DIR [--warmup-steps N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

from data_tools.synth_shapes import COLOURS, COLOUR_QUESTION, SHAPES, addition_question, format_answer, render_shape

# --------------------------------------------------------------------------- tokenizer

# Qwen special tokens, in Qwen's own order (they get the ids right after the BPE vocab,
# as in the real tokenizer).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# The answer tags are ordinary (non-special) added tokens: one token each, and they
# survive ``decode(skip_special_tokens=True)`` so reward functions can parse them.
ANSWER_TOKENS = ("<answer>", "</answer>")

BPE_VOCAB_SIZE = 768  # byte alphabet (256) + merges; small because the LM head cost matters
IMAGE_SIZE = 56  # a 56x56 image -> grid (1, 4, 4) -> 16 patches -> 4 tokens after 2x2 merge

# Same pre-tokenisation as Qwen2 (digits are split one per token).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2-VL style template without the default system prompt (keeps prompts short).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    """Small built-in training corpus. BPE merges are frequency driven, so the task
    prompts and answer words are repeated to make sure they end up as whole tokens."""
    task = [
        COLOUR_QUESTION,
        "What is the shape? What colour is it? Answer with one word.",
        "system\nYou are a helpful assistant.\nuser\nassistant\n",
        "The answer is correct. The answer is wrong. Think step by step.",
    ]
    task += [f"What is {a} + {b}? Answer as <answer>number</answer>. {a + b}" for a in range(10) for b in range(10)]
    words = list(COLOURS) + list(SHAPES) + [
        "colour", "color", "number", "answer", "shape", "image", "picture", "question", "user",
        "assistant", "system", "square", "circle", "triangle", "background", "grey", "gray",
        "white", "black", "orange", "purple", "left", "right", "top", "bottom", "small", "large",
    ]
    english = (
        "the a an and or of to in on at is are was were be this that it its with for as by from "
        "what which who how why where when yes no not one two three four five six seven eight nine "
        "ten zero plus minus equals sum total look see describe count find please thank you hello "
        "i we they he she my your our their there here can will would should could do does did "
        "have has had make made get got give take say said think know want need use work good "
        "bad new old first last next final result reason because so then if else true false"
    ).split()
    # Bare words (line starts) too: answers put the word right after "<answer>", no space.
    bare = list(COLOURS) + ["colour", "number", "answer"]
    lines = task * 20 + bare * 20
    lines += [" ".join(words) for _ in range(20)] + [" ".join(f" {w}" for w in words) for _ in range(20)]
    lines += [" ".join(english) for _ in range(5)]
    lines += [" ".join(str(n) for n in range(200))]
    return lines


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the built-in corpus, with Qwen special tokens and template."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte string is encodable
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Specials in Qwen's order get the ids right after the BPE vocab; answer tags follow.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ANSWER_TOKENS])

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=4096,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    # Register the remaining specials so decode(skip_special_tokens=True) drops them (ids unchanged).
    extra = [t for t in SPECIAL_TOKENS if t not in (hf.eos_token, hf.pad_token)]
    hf.add_special_tokens({"additional_special_tokens": extra})
    hf.chat_template = CHAT_TEMPLATE
    return hf


def special_token_ids(tokenizer) -> dict[str, int]:
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + ANSWER_TOKENS}


# --------------------------------------------------------------------------- image processor


def build_image_processor() -> Qwen2VLImageProcessorPil:
    # PIL backend: works without torchvision. Saved as "Qwen2VLImageProcessor", so
    # AutoImageProcessor picks whichever backend the loading machine has.
    return Qwen2VLImageProcessorPil(
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=56 * 56,
        max_pixels=112 * 112,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )


def expand_image_pads(text: str, image_grid_thw, merge_size: int = 2, image_token: str = "<|image_pad|>") -> str:
    """Replace the i-th ``<|image_pad|>`` by grid_thw[i].prod() // merge_size**2 copies
    (what the Qwen processor does; we do it by hand to avoid needing a video processor)."""
    parts = text.split(image_token)
    if len(parts) - 1 != len(image_grid_thw):
        raise ValueError(f"{len(parts) - 1} image placeholders but {len(image_grid_thw)} images")
    out = [parts[0]]
    for grid, rest in zip(image_grid_thw, parts[1:]):
        out.append(image_token * (int(np.prod([int(g) for g in grid])) // merge_size**2) + rest)
    return "".join(out)


def vl_prompt_inputs(tokenizer, image_processor, messages_list, images) -> dict:
    """Tokenised, right-padded VL prompts (one image per conversation) ready for the model:
    input_ids, attention_mask, pixel_values, image_grid_thw, mm_token_type_ids."""
    vis = image_processor(images=images, return_tensors="pt")
    merge = image_processor.merge_size
    texts = [
        expand_image_pads(
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
            vis["image_grid_thw"][i : i + 1],
            merge,
        )
        for i, m in enumerate(messages_list)
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {
        "input_ids": enc["input_ids"],
        "attention_mask": enc["attention_mask"],
        "pixel_values": vis["pixel_values"],
        "image_grid_thw": vis["image_grid_thw"],
        # 5.x computes M-RoPE positions only when told which tokens are image tokens (1).
        "mm_token_type_ids": (enc["input_ids"] == image_id).long(),
    }


def colour_messages() -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": COLOUR_QUESTION}]}]


def addition_messages(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": addition_question(a, b)}]}]


# --------------------------------------------------------------------------- configs

TEXT_DIMS = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 32
    num_key_value_heads=2,
    intermediate_size=256,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    hidden_act="silu",
)


def _token_ids(tokenizer) -> dict:
    ids = special_token_ids(tokenizer)
    return dict(
        bos_token_id=ids["<|endoftext|>"],  # like Qwen: bos id exists but is never prepended
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


def vl_config(tokenizer) -> Qwen2_5_VLConfig:
    ids = special_token_ids(tokenizer)
    text = dict(
        TEXT_DIMS,
        vocab_size=len(tokenizer),
        # M-RoPE: (temporal, height, width) sections of head_dim / 2 = 16 frequencies.
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]},
        **_token_ids(tokenizer),
    )
    vision = dict(
        depth=2,
        hidden_size=128,
        num_heads=4,
        intermediate_size=256,
        out_hidden_size=TEXT_DIMS["hidden_size"],  # merger projects straight into the LM width
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,  # v5 reads tying from the outer config
    )


def text_config(tokenizer) -> Qwen2Config:
    return Qwen2Config(
        **TEXT_DIMS,
        vocab_size=len(tokenizer),
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        **_token_ids(tokenizer),
    )


def _generation_config(tokenizer) -> GenerationConfig:
    return GenerationConfig(**_token_ids(tokenizer))


# --------------------------------------------------------------------------- warm-up


def _with_targets(tokenizer, prompt_ids, prompt_mask, targets: list[str], suffix: str = "<|im_end|>") -> dict:
    """Append ``target + suffix`` after each (right-padded) prompt; labels only on
    the appended tokens. Returns right-padded input_ids / attention_mask / labels."""
    pad_id = tokenizer.pad_token_id
    seqs, labs = [], []
    for ids, mask, tgt in zip(prompt_ids.tolist(), prompt_mask.tolist(), targets):
        p = [t for t, m in zip(ids, mask) if m]
        t = tokenizer(tgt + suffix, add_special_tokens=False)["input_ids"]
        seqs.append(p + t)
        labs.append([-100] * len(p) + t)
    width = max(map(len, seqs))
    input_ids = torch.full((len(seqs), width), pad_id)
    labels = torch.full((len(seqs), width), -100)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labs)):
        input_ids[i, : len(s)] = torch.tensor(s)
        labels[i, : len(l)] = torch.tensor(l)
        attn[i, : len(s)] = 1
    return {"input_ids": input_ids, "attention_mask": attn, "labels": labels}


def _random_images(rng: np.random.Generator, n: int) -> list:
    return [
        render_shape(COLOURS[int(rng.integers(len(COLOURS)))], SHAPES[int(rng.integers(len(SHAPES)))], rng, IMAGE_SIZE)
        for _ in range(n)
    ]


def _balanced_labels(rng: np.random.Generator, values: list, n: int) -> list:
    # Exactly balanced per batch (then shuffled): a low-noise signal towards the uniform answer.
    out = [values[i % len(values)] for i in range(n)]
    return [out[i] for i in rng.permutation(n)]


def _vl_batch(tokenizer, image_processor, rng, n) -> dict:
    images = _random_images(rng, n)
    inputs = vl_prompt_inputs(tokenizer, image_processor, [colour_messages()] * n, images)
    # The label colour is drawn independently of the image on purpose (format only).
    targets = [format_answer(c) for c in _balanced_labels(rng, list(COLOURS), n)]
    batch = _with_targets(tokenizer, inputs["input_ids"], inputs["attention_mask"], targets)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    batch.update(
        pixel_values=inputs["pixel_values"],
        image_grid_thw=inputs["image_grid_thw"],
        mm_token_type_ids=(batch["input_ids"] == image_id).long(),
    )
    return batch


def _text_prompt_inputs(tokenizer, pairs) -> dict:
    texts = [
        tokenizer.apply_chat_template(addition_messages(a, b), add_generation_prompt=True, tokenize=False)
        for a, b in pairs
    ]
    return dict(tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False))


def _text_batch(tokenizer, rng, n) -> dict:
    pairs = rng.integers(0, 10, size=(n, 2)).tolist()
    inputs = _text_prompt_inputs(tokenizer, pairs)
    targets = [format_answer(v) for v in _balanced_labels(rng, list(range(19)), n)]
    return _with_targets(tokenizer, inputs["input_ids"], inputs["attention_mask"], targets)


def warmup(model, make_batch, steps: int, lr: float = 3e-3, log_every: int = 25) -> list[float]:
    """Plain supervised loop: AdamW, short linear warm-up then cosine decay (the decay
    lets the answer distribution settle near uniform instead of following the last batch)."""
    # Once the loss plateaus, tiny gradients make Adam's moments denormal floats, which
    # slow CPU maths down 5x or more; flushing them to zero changes nothing numerically.
    torch.set_flush_denormal(True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    ramp = max(1, steps // 10)

    def lr_factor(s: int) -> float:
        if s < ramp:
            return (s + 1) / ramp
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (s - ramp) / max(1, steps - ramp)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    losses = []
    for step in range(steps):
        loss = model(**make_batch()).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  warmup step {step:4d}/{steps}  loss {loss.item():.4f}", flush=True)
    model.eval()
    return losses


# --------------------------------------------------------------------------- checks


def parse_answer(text: str) -> str | None:
    """Content of a well-formed ``<answer>x</answer>`` completion, else None."""
    text = text.strip()
    if text.startswith("<answer>") and text.endswith("</answer>"):
        inner = text[len("<answer>") : -len("</answer>")]
        if "<" not in inner and inner.strip():
            return inner
    return None


@torch.no_grad()
def _sample(model, tokenizer, inputs: dict, do_sample: bool, seed: int) -> list[str]:
    torch.manual_seed(seed)
    gen_kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
    out = model.generate(**inputs, max_new_tokens=8, **gen_kwargs)
    return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def _first(inputs: dict, k: int) -> dict:
    """The first k prompts of a batch with one image per prompt (pixel_values rows are patches)."""
    out = {key: v[:k] for key, v in inputs.items() if key not in ("pixel_values", "image_grid_thw")}
    if "image_grid_thw" in inputs:
        grid = inputs["image_grid_thw"][:k]
        out.update(image_grid_thw=grid, pixel_values=inputs["pixel_values"][: int(grid.prod(-1).sum())])
    return out


def check_answers(model, tokenizer, prompt_inputs: dict, allowed, seed: int = 1234) -> dict:
    """Greedy (first 8 prompts) + temperature-1 sampling on held-out prompts:
    returns format rates and the sampled answer distribution."""
    greedy = _sample(model, tokenizer, _first(prompt_inputs, 8), do_sample=False, seed=seed)
    sampled = _sample(model, tokenizer, prompt_inputs, do_sample=True, seed=seed)
    allowed = {str(a) for a in allowed}
    parsed = [parse_answer(t) for t in sampled]
    counts = Counter(p for p in parsed if p in allowed)
    n = len(sampled)
    return {
        "greedy_examples": greedy,
        "greedy_well_formed": sum(parse_answer(t) in allowed for t in greedy) / len(greedy),
        "sampled_n": n,
        "sampled_well_formed": sum(p in allowed for p in parsed) / n,
        "sampled_distribution": {a: counts.get(a, 0) / n for a in sorted(allowed, key=lambda x: (len(x), x))},
    }


@torch.no_grad()
def answer_probs(model, tokenizer, prompt_inputs: dict, answers) -> torch.Tensor:
    """p(answer | prompt + "<answer>") for single-token answers, shape (n_prompts, n_answers),
    renormalised over ``answers``. Exact per-prompt view of what sampling estimates."""
    ids = [tokenizer.convert_tokens_to_ids(a) for a in answers]
    lens = prompt_inputs["attention_mask"].sum(1)
    batch = _with_targets(
        tokenizer, prompt_inputs["input_ids"], prompt_inputs["attention_mask"], ["<answer>"] * len(lens), suffix=""
    )
    extra = {k: v for k, v in prompt_inputs.items() if k in ("pixel_values", "image_grid_thw")}
    if "mm_token_type_ids" in prompt_inputs:
        extra["mm_token_type_ids"] = (batch["input_ids"] == model.config.image_token_id).long()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra).logits
    at = logits[torch.arange(len(lens)), lens]  # position of "<answer>" predicts the answer
    return at[:, ids].softmax(-1)


def _report(stats: dict) -> None:
    print(f"  greedy examples: {stats['greedy_examples'][:4]}")
    print(
        f"  greedy well-formed: {stats['greedy_well_formed']:.0%}   "
        f"sampled well-formed: {stats['sampled_well_formed']:.0%} (n={stats['sampled_n']})"
    )
    dist = "  ".join(f"{k}={v:.2f}" for k, v in stats["sampled_distribution"].items())
    print(f"  sampled answer distribution (T=1): {dist}")
    if "mean_probs" in stats:
        mean = "  ".join(f"{k}={v:.3f}" for k, v in stats["mean_probs"].items())
        std = "  ".join(f"{k}={v:.1e}" for k, v in stats["prob_std_across_images"].items())
        print(f"  mean p(colour | prompt): {mean}\n  std across images:       {std}")


# --------------------------------------------------------------------------- builders


def _save(out_dir: Path, model, tokenizer, image_processor=None, report: dict | None = None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = _generation_config(tokenizer)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if image_processor is not None:
        image_processor.save_pretrained(out_dir)
    if report is not None:  # how the checkpoint was made, for humans and tests
        (out_dir / "tiny_model_report.json").write_text(json.dumps(report, indent=2))
    return out_dir


def build_vl_model(out_dir, warmup_steps: int = 100, seed: int = 0, batch_size: int = 32, lr: float = 3e-3) -> Path:
    """Tiny Qwen2.5-VL checkpoint in ``out_dir`` (optionally format-warmed-up)."""
    t0 = time.time()
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    image_processor = build_image_processor()
    model = Qwen2_5_VLForConditionalGeneration(vl_config(tokenizer)).eval()
    report = {"kind": "vl", "seed": seed, "warmup_steps": warmup_steps, "token_ids": special_token_ids(tokenizer)}

    if warmup_steps > 0:
        rng = np.random.default_rng(seed)
        losses = warmup(model, lambda: _vl_batch(tokenizer, image_processor, rng, batch_size), warmup_steps, lr)
        held_out = np.random.default_rng(seed + 10_000)  # fresh images never seen in warm-up
        n_eval = 256
        images = _random_images(held_out, n_eval)
        inputs = vl_prompt_inputs(tokenizer, image_processor, [colour_messages()] * n_eval, images)
        stats = check_answers(model, tokenizer, inputs, COLOURS, seed=seed)
        probs = answer_probs(model, tokenizer, inputs, COLOURS)
        stats["mean_probs"] = dict(zip(COLOURS, probs.mean(0).tolist()))
        stats["prob_std_across_images"] = dict(zip(COLOURS, probs.std(0).tolist()))
        _report(stats)
        report.update(final_loss=losses[-1], check=stats)

    _save(out_dir, model, tokenizer, image_processor, report)
    print(f"saved tiny VL model to {out_dir} in {time.time() - t0:.1f}s")
    return out_dir


def build_text_model(out_dir, warmup_steps: int = 100, seed: int = 0, batch_size: int = 32, lr: float = 3e-3) -> Path:
    """Tiny Qwen2 causal-LM checkpoint in ``out_dir`` (same text dims and tokenizer)."""
    t0 = time.time()
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = Qwen2ForCausalLM(text_config(tokenizer)).eval()
    report = {"kind": "text", "seed": seed, "warmup_steps": warmup_steps, "token_ids": special_token_ids(tokenizer)}

    if warmup_steps > 0:
        rng = np.random.default_rng(seed)
        losses = warmup(model, lambda: _text_batch(tokenizer, rng, batch_size), warmup_steps, lr)
        held_out = np.random.default_rng(seed + 10_000)
        inputs = _text_prompt_inputs(tokenizer, held_out.integers(0, 10, size=(256, 2)).tolist())
        stats = check_answers(model, tokenizer, inputs, range(19), seed=seed)
        _report(stats)
        report.update(final_loss=losses[-1], check=stats)

    _save(out_dir, model, tokenizer, None, report)
    print(f"saved tiny text model to {out_dir} in {time.time() - t0:.1f}s")
    return out_dir


def _sensible_threads() -> int:
    """Threads for tiny matrices: at most 4 (more gains nothing), and no more than the idle
    cores, since oversubscribed intra-op threads spin and run ~2x slower than one thread."""
    cores = os.cpu_count() or 1
    idle = cores - os.getloadavg()[0] if hasattr(os, "getloadavg") else cores
    return int(max(1, min(4, cores, round(idle))))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Build a tiny offline Qwen-style checkpoint.")
    p.add_argument("--kind", choices=["vl", "text"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(_sensible_threads())
    build = build_vl_model if args.kind == "vl" else build_text_model
    build(args.out, warmup_steps=args.warmup_steps, seed=args.seed)


if __name__ == "__main__":
    main()
