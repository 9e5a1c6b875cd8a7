"""Build a tiny, fully offline scalar reward model for tests.

A randomly initialised ``Qwen2ForSequenceClassification`` (num_labels=1, pad_token_id set, so
it pools each row's last non-pad token) with the tiny text model's tokenizer, chat template
and text dims, saved with ``save_pretrained`` so it loads with
``AutoModelForSequenceClassification.from_pretrained(path)`` like a real reward model.

CLI::

    python -m data_tools.make_tiny_reward_model --out DIR [--seed S] [--num-labels N]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import Qwen2ForSequenceClassification

from data_tools.make_tiny_model import text_config
from data_tools.tiny_tokenizer import build_tokenizer


def build_tiny_reward_model(out_dir, seed: int = 0, num_labels: int = 1) -> Path:
    """Tiny Qwen2 sequence-classification checkpoint in ``out_dir`` (num_labels=1 by default;
    other values only exist to test that reward-model loaders reject them)."""
    t0 = time.time()
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = text_config(tokenizer)  # pad_token_id = <|endoftext|>, as in the tiny text model
    config.num_labels = num_labels
    model = Qwen2ForSequenceClassification(config).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    print(f"saved tiny reward model to {out_dir} in {time.time() - t0:.1f}s")
    return out_dir


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Build a tiny offline Qwen2 scalar reward model.")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-labels", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as make_tiny_model: bit-identical weights from run to run
    build_tiny_reward_model(args.out, seed=args.seed, num_labels=args.num_labels)


if __name__ == "__main__":
    main()
