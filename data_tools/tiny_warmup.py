"""Format warm-up of the tiny checkpoints, and the checks that follow it.

Prompts are real dataset rows (``synth_shapes.colour_row`` / ``addition_row``) encoded by
vlrft's own ``PromptEncoder`` and batched by its ``collate``, so the warm-up sees exactly
the token ids, pixel inputs and ``mm_token_type_ids`` (M-RoPE) that RL training will.

The labels are drawn independently of the prompt: the warm-up teaches the answer *format*
only, and the VL model ends up answering each colour ~25% of the time.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from data_tools.synth_shapes import (
    ADDITION_ANSWERS,
    ADDITION_OPERANDS,
    COLOURS,
    SHAPES,
    addition_row,
    colour_row,
    format_answer,
    render_shape,
)
from vlrft.models.collate import collate
from vlrft.types import Rollout

IMAGE_SIZE = 56  # a 56x56 image -> grid (1, 4, 4) -> 16 patches -> 4 tokens after 2x2 merge
# PromptEncoder reads images from files: write them to RAM where possible (file opens on
# the disk cost as much as the rest of the prompt encoding).
_IMAGE_TMP = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None

# --------------------------------------------------------------------------- prompts and batches


def colour_prompts(encoder, rng: np.random.Generator, n: int, image_dir) -> list:
    """``n`` encoded colour questions on random shapes (images written as PNGs to ``image_dir``)."""
    prompts = []
    for i in range(n):
        colour = COLOURS[int(rng.integers(len(COLOURS)))]
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        path = Path(image_dir) / f"{i:05d}.png"  # lossless: the model sees the rendered pixels
        render_shape(colour, shape, rng, IMAGE_SIZE).save(path, compress_level=0)  # fastest
        prompts.append(encoder.encode(colour_row(f"warmup-{i}", str(path), colour, shape), i))
    return prompts


def addition_prompts(encoder, rng: np.random.Generator, n: int, image_dir=None) -> list:
    pairs = rng.integers(0, len(ADDITION_OPERANDS), size=(n, 2)).tolist()
    return [encoder.encode(addition_row(f"warmup-{i}", a, b), i) for i, (a, b) in enumerate(pairs)]


# kind -> (prompt maker, allowed answers)
TASKS = {"vl": (colour_prompts, COLOURS), "text": (addition_prompts, ADDITION_ANSWERS)}


def sft_batch(tokenizer, prompts: list, targets: list[str] | None = None, suffix: str = "<|im_end|>") -> dict:
    """Right-padded model inputs for ``prompt + target + suffix`` (prompts alone when
    ``targets`` is None), with ``labels`` on the appended tokens only."""
    if targets is None:
        responses = [[] for _ in prompts]
    else:
        responses = [tokenizer(t + suffix, add_special_tokens=False)["input_ids"] for t in targets]
    rollouts = [
        Rollout(prompt=p, group_id=i, response_ids=r, response_text="", truncated=False)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
    ]
    batch = collate(rollouts, tokenizer.pad_token_id)  # also adds mm_token_type_ids (M-RoPE)
    if targets is None:
        return batch.model_inputs()
    return {**batch.model_inputs(), "labels": batch.input_ids.masked_fill(batch.response_mask == 0, -100)}


def _balanced_labels(rng: np.random.Generator, values: list, n: int) -> list:
    # Exactly balanced per batch (then shuffled): a low-noise signal towards the uniform answer.
    out = [values[i % len(values)] for i in range(n)]
    return [out[i] for i in rng.permutation(n)]


# --------------------------------------------------------------------------- warm-up


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


def copy_base(out_dir, base, build_base, seed: int) -> Path:
    """An example's warm-up starts from a make_tiny_model checkpoint: ``base`` copied to
    ``out_dir`` (``build_base(path, seed=seed)`` makes it first when missing)."""
    out_dir = Path(out_dir)
    if base is None or not (Path(base) / "config.json").is_file():
        base = build_base(Path(base or out_dir.with_name(out_dir.name + "-base")), seed=seed)
    shutil.copytree(base, out_dir, dirs_exist_ok=True)
    return out_dir


def warmup_cli(argv, description: str, build, default_steps: int, what: str) -> None:
    """The command line of an example's warm-up (zoom_warmup, calculator_warmup): ``build(out,
    base, steps, seed)`` a checkpoint from a make_tiny_model one of kind ``what``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True)
    p.add_argument("--base", default=None, help=f"a make_tiny_model {what} checkpoint (built next to --out when missing)")
    p.add_argument("--steps", type=int, default=default_steps)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the same weights every run
    print(f"saved the model to {build(args.out, args.base, args.steps, args.seed)}")


def warm_up_and_save(model, make_batch, steps: int, lr: float, seed: int, check, name: str, out_dir: Path) -> Path:
    """An example's warm-up after its batches are defined: seeded supervised steps, then
    ``check()`` (the format rates it reports), then the checkpoint saved to ``out_dir``."""
    torch.manual_seed(seed)
    warmup(model, make_batch, steps, lr)
    print(f"  {name} format: {check()}", flush=True)
    model.save_pretrained(out_dir)
    return out_dir


def run_warmup(model, encoder, kind: str, steps: int, seed: int, batch_size: int, lr: float, n_eval: int = 256) -> dict:
    """Warm ``model`` up on fresh random prompts, then check it on ``n_eval`` held-out ones.
    Returns the report entries ``final_loss`` and ``check``."""
    make_prompts, answers = TASKS[kind]
    tokenizer = encoder.tokenizer
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="tiny_warmup_", dir=_IMAGE_TMP) as image_dir:

        def make_batch() -> dict:
            prompts = make_prompts(encoder, rng, batch_size, image_dir)
            # The label is drawn independently of the prompt on purpose (format only).
            targets = [format_answer(a) for a in _balanced_labels(rng, list(answers), batch_size)]
            return sft_batch(tokenizer, prompts, targets)

        losses = warmup(model, make_batch, steps, lr)
        held_out = make_prompts(encoder, np.random.default_rng(seed + 10_000), n_eval, image_dir)  # never seen
    stats = check_answers(model, tokenizer, held_out, answers, seed=seed)
    if kind == "vl":
        probs = answer_probs(model, tokenizer, held_out, answers)
        stats["mean_probs"] = dict(zip(answers, probs.mean(0).tolist()))
        stats["prob_std_across_images"] = dict(zip(answers, probs.std(0).tolist()))
    _report(stats)
    return {"final_loss": losses[-1], "check": stats}


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
def _sample(model, tokenizer, prompts: list, do_sample: bool, seed: int) -> list[str]:
    torch.manual_seed(seed)
    inputs = sft_batch(tokenizer, prompts)
    gen_kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
    out = model.generate(**inputs, max_new_tokens=8, **gen_kwargs)
    return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def check_answers(model, tokenizer, prompts: list, allowed, seed: int = 1234) -> dict:
    """Greedy (first 8 prompts) + temperature-1 sampling on held-out prompts:
    returns format rates and the sampled answer distribution."""
    greedy = _sample(model, tokenizer, prompts[:8], do_sample=False, seed=seed)
    sampled = _sample(model, tokenizer, prompts, do_sample=True, seed=seed)
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
def answer_probs(model, tokenizer, prompts: list, answers) -> torch.Tensor:
    """p(answer | prompt + "<answer>") for single-token answers, shape (n_prompts, n_answers),
    renormalised over ``answers``. Exact per-prompt view of what sampling estimates."""
    ids = [tokenizer.convert_tokens_to_ids(a) for a in answers]
    batch = sft_batch(tokenizer, prompts, ["<answer>"] * len(prompts), suffix="")
    batch.pop("labels")
    logits = model(**batch).logits
    lens = torch.tensor([len(p.prompt_ids) for p in prompts])
    at = logits[torch.arange(len(prompts)), lens]  # position of "<answer>" predicts the answer
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
