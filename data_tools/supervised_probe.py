"""Can the policy learn a task at all? Supervised fine-tuning on its training rows, with the
held-out accuracy printed as it goes: the ceiling an RL run on the same checkpoint is judged by.

    python -m data_tools.supervised_probe --model artifacts/tiny-vl --data artifacts/left_right

Accuracy is the held-out rate at which the answer token the model ranks first after
``<answer>`` (among the task's answers) is the right one: greedy decoding of a well-formed answer.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from data_tools.synth_shapes import COLOURS, format_answer
from data_tools.tiny_warmup import answer_probs, sft_batch, warmup
from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.models.loader import load_model


def held_out_accuracy(model, tokenizer, prompts, answers, chunk: int = 64) -> float:
    model.eval()
    right = 0
    for start in range(0, len(prompts), chunk):
        part = prompts[start : start + chunk]
        best = answer_probs(model, tokenizer, part, COLOURS).argmax(-1).tolist()
        right += sum(COLOURS[b] == a for b, a in zip(best, answers[start : start + chunk]))
    model.train()
    return right / len(prompts)


def probe(model_path: str, data_dir: str, steps: int, batch_size: int, lr: float, eval_every: int, seed: int = 0):
    """[(step, held-out accuracy)] of supervised training from `model_path` on `data_dir`."""
    encoder = PromptEncoder(model_path, 56 * 56, 112 * 112, 1024)
    model = load_model(model_path)
    train = [(encoder.encode(r, i), r["answer"]) for i, r in enumerate(load_rows(f"{data_dir}/train.jsonl"))]
    test = [(encoder.encode(r, i), r["answer"]) for i, r in enumerate(load_rows(f"{data_dir}/test.jsonl"))]
    test_prompts, test_answers = [p for p, _ in test], [a for _, a in test]
    rng = np.random.default_rng(seed)
    curve = [(0, held_out_accuracy(model, encoder.tokenizer, test_prompts, test_answers))]
    done = 0
    while done < steps:
        chunk = min(eval_every, steps - done)

        def make_batch() -> dict:
            picked = [train[i] for i in rng.integers(len(train), size=batch_size)]
            return sft_batch(encoder.tokenizer, [p for p, _ in picked], [format_answer(a) for _, a in picked])

        warmup(model, make_batch, chunk, lr, log_every=0)
        done += chunk
        curve.append((done, held_out_accuracy(model, encoder.tokenizer, test_prompts, test_answers)))
        print(f"step {done:4d}  held-out accuracy {curve[-1][1]:.3f}", flush=True)
    return curve


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="a synth_shapes task directory (train.jsonl, test.jsonl)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    start = time.time()
    curve = probe(args.model, args.data, args.steps, args.batch_size, args.lr, args.eval_every)
    print("supervised held-out accuracy by step: " + "  ".join(f"{s}:{a:.2f}" for s, a in curve))
    print(f"wall time {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
