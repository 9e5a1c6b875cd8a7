"""`vlrft train CONFIG [section.key=value ...]`: launched under torchrun, one process per rank."""

from __future__ import annotations

import argparse
import sys

from vlrft.config import ConfigError, load_config
from vlrft.data.dataset import DataError
from vlrft.rewards.mix import RewardError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlrft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run RL training (start it with torchrun for several ranks)")
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.total_steps=10")
    args = parser.parse_args(argv)

    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "train":
            from vlrft.trainer.spmd_trainer import SPMDTrainer

            trainer = SPMDTrainer(cfg)
            history = trainer.train()
            if trainer.rank == 0:
                curve = "  ".join(f"{step}:{acc:.2f}" for step, acc in history)
                print(f"held-out accuracy by step: {curve}", flush=True)
                print(f"outputs: {cfg.output.dir} (metrics.jsonl, final/ HF checkpoint)", flush=True)
    except (ConfigError, DataError, RewardError) as err:
        print(f"vlrft: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
