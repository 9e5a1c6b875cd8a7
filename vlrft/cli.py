"""`vlrft train CONFIG [section.key=value ...]`: launched under torchrun, one process per rank.
`vlrft reward-server --recipe NAME [--kwargs JSON]`: serve a reward recipe over HTTP."""

from __future__ import annotations

import argparse
import json
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
    server = sub.add_parser("reward-server", help="serve a reward recipe over HTTP (POST /score, GET /health)")
    server.add_argument("--recipe", required=True, help="built-in or plugin name, pkg.mod:fn or file.py:fn")
    server.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for the recipe")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--threads", type=int, default=4, help="requests served at once")
    server.add_argument("--timeout-s", type=float, default=60.0, help="per-request recipe timeout")
    args = parser.parse_args(argv)

    try:
        if args.command == "reward-server":
            from vlrft.rewards.server import serve

            kwargs = json.loads(args.kwargs)
            if not isinstance(kwargs, dict):
                raise ConfigError(f"--kwargs must be a JSON object, got {args.kwargs}")
            serve(args.recipe, kwargs, args.host, args.port, args.threads, args.timeout_s)
            return 0
        cfg = load_config(args.config, args.overrides)
        if args.command == "train":
            from vlrft.trainer.spmd_trainer import SPMDTrainer

            trainer = SPMDTrainer(cfg)
            history = trainer.train()
            if trainer.rank == 0:
                curve = "  ".join(f"{step}:{acc:.2f}" for step, acc in history)
                print(f"held-out accuracy by step: {curve}", flush=True)
                print(f"outputs: {cfg.output.dir} (metrics.jsonl, final/ HF checkpoint)", flush=True)
    except json.JSONDecodeError as err:
        print(f"vlrft: error: --kwargs is not valid JSON ({err})", file=sys.stderr)
        return 2
    except (ConfigError, DataError, RewardError) as err:
        print(f"vlrft: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
