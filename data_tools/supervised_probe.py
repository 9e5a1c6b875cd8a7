"""Can the policy learn a task at all? Supervised fine-tuning on its training rows, with the
held-out accuracy printed as it goes: the ceiling an RL run on the same checkpoint is judged by.

    python -m data_tools.supervised_probe --model artifacts/tiny-vl --data artifacts/left_right

Accuracy is the held-out rate at which the answer token the model ranks first after
``<answer>`` (among the task's answers: every answer of its training rows, each one token) is
the right one: greedy decoding of a well-formed answer.

``--save DIR`` keeps the trained model as an HF checkpoint (weights, tokenizer, image
processor, generation config): a teacher for on-policy distillation (examples/distill/).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from data_tools.synth_shapes import COLOURS, format_answer
from data_tools.tiny_warmup import answer_probs, sft_batch, warmup
from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.models.loader import load_model


def held_out_accuracy(model, tokenizer, prompts, answers, choices=COLOURS, chunk: int = 64) -> float:
    model.eval()
    right = 0
    for start in range(0, len(prompts), chunk):
        part = prompts[start : start + chunk]
        best = answer_probs(model, tokenizer, part, choices).argmax(-1).tolist()
        right += sum(choices[b] == a for b, a in zip(best, answers[start : start + chunk]))
    model.train()
    return right / len(prompts)


def answer_choices(tokenizer, answers) -> tuple[str, ...]:
    """The task's answers, sorted; each must be one token, as the accuracy reads one position."""
    choices = tuple(sorted(set(answers)))
    for answer in choices:
        if len(tokenizer(answer, add_special_tokens=False)["input_ids"]) != 1:
            raise SystemExit(f"supervised_probe: answer {answer!r} is not a single token; "
                             "the probe scores one-token answers")
    return choices


def check_save_path(out_dir) -> None:
    """Refused before any training: the checkpoint never replaces or mixes into what is there."""
    if os.path.lexists(out_dir):
        raise SystemExit(f"supervised_probe: --save {out_dir} exists; remove it or name another directory")


def save_checkpoint(model, encoder: PromptEncoder, out_dir) -> Path:
    """`model` with the tokenizer and image processor it was trained with, written to a new
    directory beside `out_dir` and renamed into place: `out_dir` is whole or absent."""
    out_dir = Path(out_dir)
    check_save_path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    partial.chmod(0o755)  # mkdtemp's 0700 would keep the checkpoint from other users
    try:
        model.save_pretrained(partial)
        encoder.tokenizer.save_pretrained(partial)
        if encoder.image_processor is not None:
            encoder.image_processor.save_pretrained(partial)
        partial.rename(out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out_dir


def probe(model_path: str, data_dir: str, steps: int, batch_size: int, lr: float, eval_every: int, seed: int = 0,
          save: str | None = None):
    """[(step, held-out accuracy)] of supervised training from `model_path` on `data_dir`; the
    trained model saved to `save` when given (a path that does not exist yet)."""
    if save:
        check_save_path(save)
    encoder = PromptEncoder(model_path, 56 * 56, 112 * 112, 1024)
    model = load_model(model_path)
    train = [(encoder.encode(r, i), r["answer"]) for i, r in enumerate(load_rows(f"{data_dir}/train.jsonl"))]
    test = [(encoder.encode(r, i), r["answer"]) for i, r in enumerate(load_rows(f"{data_dir}/test.jsonl"))]
    choices = answer_choices(encoder.tokenizer, [a for _, a in train])
    test_prompts, test_answers = [p for p, _ in test], [a for _, a in test]
    rng = np.random.default_rng(seed)
    curve = [(0, held_out_accuracy(model, encoder.tokenizer, test_prompts, test_answers, choices))]
    done = 0
    while done < steps:
        chunk = min(eval_every, steps - done)

        def make_batch() -> dict:
            picked = [train[i] for i in rng.integers(len(train), size=batch_size)]
            return sft_batch(encoder.tokenizer, [p for p, _ in picked], [format_answer(a) for _, a in picked])

        warmup(model, make_batch, chunk, lr, log_every=0)
        done += chunk
        curve.append((done, held_out_accuracy(model, encoder.tokenizer, test_prompts, test_answers, choices)))
        print(f"step {done:4d}  held-out accuracy {curve[-1][1]:.3f}", flush=True)
    if save:
        print(f"saved the model to {save_checkpoint(model.eval(), encoder, save)}")
    return curve


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="a synth_shapes task directory (train.jsonl, test.jsonl)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0, help="the seed of the weights and the batches")
    parser.add_argument("--save", default=None, help="write the trained model to this new directory (an HF checkpoint)")
    args = parser.parse_args(argv)
    # One thread: a fixed reduction order, so the saved weights are the same every run.
    torch.set_num_threads(1)
    if args.save and not torch.cuda.is_available():  # saving pulls in DeepSpeed, which warns when it finds no GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.manual_seed(args.seed)
    start = time.time()
    curve = probe(args.model, args.data, args.steps, args.batch_size, args.lr, args.eval_every, args.seed, args.save)
    print("supervised held-out accuracy by step: " + "  ".join(f"{s}:{a:.2f}" for s, a in curve))
    print(f"wall time {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
