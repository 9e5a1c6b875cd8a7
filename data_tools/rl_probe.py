"""GRPO on the answer token alone: how the colour recipe's dynamics behave on a task, in about a
minute per 150 steps instead of half an hour, and over many seeds.

    python -m data_tools.rl_probe --model artifacts/tiny-vl --data artifacts/bigger --seeds 0 1 2
    python -m data_tools.rl_probe ... --kl-coef 0.01 --kl-estimator k3   # the old recipe
    python -m data_tools.rl_probe ... --lora-rank 64 --lora-alpha 64 --lr 2e-3   # a LoRA policy
    python -m data_tools.rl_probe ... --lora-rank 64 --lora-alpha 64 --lr 1e-4 --lora-lr-ratio 32   # LoRA+

Each step samples `--samples` answers per prompt for `--prompts` training prompts from the
policy's distribution over the task's colours after "<answer>" (the format tokens around it are
near-deterministic after the warm-up, so the full rollout adds nothing to the dynamics), rewards
them like the recipe (exact match 1 + format 0.1), and takes one AdamW step on the loss the
trainer would build: vlrft's GRPO advantages, ratio 1 (one optimizer step per batch), token-mean
over the 4 response tokens, and optionally the KL-in-loss term with vlrft's estimator. The
held-out accuracy is that of `supervised_probe` (the colour ranked first).

Not the shipped training path (`vlrft train` is): a lab bench for questions like "does the KL
term slow the escape from a plateau?", answered over seeds.
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch

from data_tools.supervised_probe import held_out_accuracy
from data_tools.synth_shapes import COLOURS
from data_tools.tiny_warmup import sft_batch
from vlrft.algo.advantages import grpo_advantages
from vlrft.algo.kl import KL_ESTIMATORS
from vlrft.backends.deepspeed_backend import lr_scheduler
from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.models.loader import load_model
from vlrft.models.lora import add_lora, optimizer_groups

RESPONSE_TOKENS = 4  # "<answer>", the colour, "</answer>", "<|im_end|>": token-mean's denominator


def answer_logprobs(model, tokenizer, prompts: list) -> torch.Tensor:
    """log π(token | prompt + "<answer>") over the whole vocabulary. [P, V]."""
    batch = sft_batch(tokenizer, prompts, ["<answer>"] * len(prompts), suffix="")
    batch.pop("labels")
    logits = model(**batch).logits
    at = torch.tensor([len(p.prompt_ids) for p in prompts])
    return logits[torch.arange(len(prompts)), at].float().log_softmax(-1)


def grpo_loss(vocab_logp: torch.Tensor, colour_ids: list[int], truth: torch.Tensor, samples: int, kl_coef: float,
              kl_estimator: str, ref_logp: torch.Tensor | None, generator: torch.Generator,
              entropy_coef: float = 0.0) -> torch.Tensor:
    """The trainer's loss for one batch of sampled colours. vocab_logp: [P, V] at the answer
    position; ref_logp: [P, C] at the colours; truth: [P] indices into the colours."""
    logp = vocab_logp[:, colour_ids]
    probs = logp.detach().exp()
    picked = torch.multinomial(probs / probs.sum(-1, keepdim=True), samples, replacement=True, generator=generator)
    rewards = (picked == truth[:, None]).float() + 0.1  # exact match + answer format
    groups = torch.arange(len(truth)).repeat_interleave(samples)
    adv = grpo_advantages(rewards.flatten(), groups).view_as(rewards)  # [P, n]
    chosen = logp.gather(1, picked)  # [P, n]
    tokens = chosen.numel() * RESPONSE_TOKENS
    loss = -(adv * chosen).sum() / tokens
    if kl_coef > 0:
        kl = KL_ESTIMATORS.get(kl_estimator)(chosen, ref_logp.gather(1, picked))
        loss = loss + kl_coef * kl.sum() / tokens  # the format tokens' KL is ~0 here
    if entropy_coef > 0:  # the trainer's bonus: -coef * token-mean entropy (format tokens' ~0)
        entropy = -(vocab_logp.exp() * vocab_logp).sum(-1)  # [P], the same for each sample
        loss = loss - entropy_coef * entropy.sum() * samples / tokens
    return loss


def encoded(encoder: PromptEncoder, path: str) -> list[tuple]:
    """(prompt, answer) of every row of a task file."""
    return [(encoder.encode(r, i), r["answer"]) for i, r in enumerate(load_rows(path))]


def probe(args, seed: int, tokenizer, train: list[tuple], test: list[tuple]) -> list[tuple[int, float]]:
    torch.manual_seed(seed)
    model = load_model(args.model)
    reference = copy.deepcopy(model).eval() if args.kl_coef > 0 else None
    if args.lora_rank:  # only the adapters train, as with model.lora
        add_lora(model, args.lora_rank, args.lora_alpha, 0.0, args.lora_targets)
    colour_ids = [tokenizer.convert_tokens_to_ids(c) for c in COLOURS]
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = optimizer_groups(model, args.lr, args.lora_lr_ratio)  # one group unless LoRA+
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.adam_beta2), weight_decay=0.0)
    sched = lr_scheduler(opt, "cosine", 0, args.steps)  # the recipe's schedule
    rng, generator = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    curve = []
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, held_out_accuracy(model, tokenizer, [p for p, _ in test], [a for _, a in test])))
        if step == args.steps:
            break
        picked = [train[i] for i in rng.integers(len(train), size=args.prompts)]
        prompts = [p for p, _ in picked]
        truth = torch.tensor([COLOURS.index(a) for _, a in picked])
        logp = answer_logprobs(model, tokenizer, prompts)
        ref_logp = None
        if reference is not None:
            with torch.no_grad():
                ref_logp = answer_logprobs(reference, tokenizer, prompts)[:, colour_ids]
        loss = grpo_loss(logp, colour_ids, truth, args.samples, args.kl_coef, args.kl_estimator, ref_logp, generator,
                         args.entropy_coef)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        sched.step()
    return curve


def first_step_at(curve: list[tuple[int, float]], level: float) -> int | None:
    return next((step for step, acc in curve if acc >= level), None)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="a synth_shapes colour-answer task directory")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step (the recipe's rollout_prompts)")
    parser.add_argument("--samples", type=int, default=8, help="answers per prompt (n_samples_per_prompt)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--kl-estimator", default="k3", choices=KL_ESTIMATORS.names())
    parser.add_argument("--entropy-coef", type=float, default=0.0)
    parser.add_argument("--adam-beta2", type=float, default=0.999, help="AdamW's second-moment decay")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank only (model.lora.rank)")
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--lora-lr-ratio", type=float, default=1.0, help="LoRA+: B's lr = --lr x this (model.lora.lr_ratio)")
    parser.add_argument("--lora-targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    args = parser.parse_args(argv)
    encoder = PromptEncoder(args.model, 56 * 56, 112 * 112, 1024)
    train, test = encoded(encoder, f"{args.data}/train.jsonl"), encoded(encoder, f"{args.data}/test.jsonl")
    for seed in args.seeds:
        start = time.time()
        curve = probe(args, seed, encoder.tokenizer, train, test)
        reached = first_step_at(curve, 0.9)
        print(f"seed {seed}: " + " ".join(f"{s}:{a:.2f}" for s, a in curve)
              + f"  | >= 0.9 at step {reached if reached is not None else 'never'} ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
