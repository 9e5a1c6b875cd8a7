"""`vlrft train CONFIG [section.key=value ...]`: launched under torchrun, one process per rank.
`vlrft reward-server --recipe NAME [--kwargs JSON] [--host H --token-file F]`: serve a reward recipe over HTTP.
`vlrft teacher-server --model PATH [--host H --token-file F]`: serve a distillation teacher over HTTP (teacher.url).
`vlrft report RUN_DIR [--out PATH] [--top-k N]`: an offline HTML report of saved trajectories."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import NoReturn

from vlrft.config import load_config
from vlrft.console import say
from vlrft.errors import ConfigError, VlrftError
from vlrft.models.teacher_server_cli import add_teacher_server_flags, teacher_server_options
from vlrft.rewards.server_cli import add_reward_server_guards, reward_server_options
from vlrft.trajectory.report import DEFAULT_TOP_K, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlrft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run RL training (start it with torchrun for several ranks)")
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.total_steps=10")
    server = sub.add_parser("reward-server", help="serve a reward recipe over HTTP (POST /score, GET /health)")
    server.add_argument("--recipe", required=True, help="built-in or plugin name, pkg.mod:fn or file.py:fn")
    server.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for the recipe")
    server.add_argument("--timeout-s", type=float, default=60.0,
                        help="per-request recipe timeout: a call past it is killed (a code recipe: --max-code-seconds)")
    add_reward_server_guards(server)
    teacher = sub.add_parser("teacher-server", help="serve a distillation teacher over HTTP (POST /logprobs, GET /health)")
    add_teacher_server_flags(teacher)
    report = sub.add_parser("report", help="write RUN_DIR/report.html (self-contained) and report.json")
    report.add_argument("run_dir", help="run directory holding trajectories/ (and metrics.jsonl)")
    report.add_argument("--out", help="HTML file to write (default RUN_DIR/report.html; the .json goes next to it)")
    report.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="best/worst samples per step and source")
    args = parser.parse_args(argv)

    try:
        if args.command == "reward-server":
            from vlrft.rewards.server import serve

            kwargs = json.loads(args.kwargs)
            if not isinstance(kwargs, dict):
                raise ConfigError(f"--kwargs must be a JSON object, got {args.kwargs}")
            serve(args.recipe, kwargs, reward_server_options(args))
            return 0
        if args.command == "teacher-server":
            from vlrft.models.teacher_server import serve_teacher

            serve_teacher(teacher_server_options(args))
            return 0
        if args.command == "report":
            for path in write_report(args.run_dir, args.out, args.top_k):
                print(path)
            return 0
        cfg = load_config(args.config, args.overrides)
        if args.command == "train":
            return run_training(cfg)
    except json.JSONDecodeError as err:
        print(f"vlrft: error: --kwargs is not valid JSON ({err})", file=sys.stderr)
        return 2
    except VlrftError as err:  # a user's mistake: one line, no traceback
        say(f"vlrft: error: {err}", sys.stderr)
        return 2
    return 0


def run_training(cfg) -> int:
    """`vlrft train`: the exit code. A rank that fails prints its message and tells the others,
    which stop within guards.peer_timeout_s (vlrft.rank_watch) instead of waiting in a collective."""
    import traceback

    import torch

    from vlrft import progress
    from vlrft.distributed import global_rank, init_distributed, shutdown_distributed
    from vlrft.rank_watch import start_rank_watch
    from vlrft.trainer.run_start import AlreadyFinished
    from vlrft.trainer.spmd_trainer import SPMDTrainer, TrainingStopped

    init_distributed()  # here as well as in the trainer: the watch covers building it too
    progress.enter("building the trainer (models, engine, data)", guarded=False)  # (a download may be long)
    watch = start_rank_watch(cfg.guards.peer_timeout_s, cfg.guards.stall_timeout_s)
    try:
        trainer = SPMDTrainer(cfg)
        history = trainer.train()
    except AlreadyFinished as finished:  # a rerun of a finished run: nothing to do, not a failure
        watch.stop()
        if global_rank() == 0:
            print(finished, flush=True)
        shutdown_distributed()
        return 0
    except TrainingStopped as stopped:
        watch.stop()
        watch.linger()  # until the other ranks have stopped too
        # What is left is the exit. The first rank to exit makes torchrun send the others
        # SIGTERM, which would kill a rank that had a signal already (its handler is gone).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if trainer.writes_output:
            say(f"vlrft: {stopped}; run the same command again to resume (checkpoint.resume: auto)")
        shutdown_distributed()
        return 128 + stopped.signum
    except VlrftError as err:  # a user's mistake: one line, no traceback
        watch.fail(f"vlrft: error: {err}", f"rank {watch.rank} failed with {type(err).__name__} (its message is above)")
        return 2
    except Exception as err:  # noqa: BLE001 - every failure must reach the other ranks
        if watch.stop_on_lost_connection(err):  # a peer died: one line naming it, not gloo's traceback
            return 1
        if isinstance(err, torch.OutOfMemoryError):
            err.add_note(out_of_memory_note(cfg))  # (printed under the traceback)
        if not watch.active:  # no other ranks: the exception goes on as it would (in-process callers see it)
            raise
        watch.fail(traceback.format_exc().rstrip(), f"rank {watch.rank} failed with {type(err).__name__} (its traceback is above)")
        return 1
    watch.stop()
    if trainer.writes_output:
        if history:  # empty without data.eval_path
            curve = "  ".join(f"{step}:{acc:.2f}" for step, acc in history)
            print(f"held-out accuracy by step: {curve}", flush=True)
        print(f"outputs: {cfg.output.dir} (metrics.jsonl, final/ HF checkpoint)", flush=True)
        if cfg.trajectory.save_every:
            html, summary = write_report(cfg.output.dir)
            print(f"trajectory report: {html} (open it in a browser; numbers in {summary.name})", flush=True)
    shutdown_distributed()
    return 0


def out_of_memory_note(cfg) -> str:
    """What to change after a GPU out-of-memory error, cheapest first, each with its value now
    (the levers already pulled left out)."""
    levers = []
    if not cfg.model.gradient_checkpointing:
        levers.append("model.gradient_checkpointing=true")
    levers.append(f"a smaller train.micro_batch_tokens (now {cfg.train.micro_batch_tokens})")
    if cfg.train.zero_stage < 3:
        levers.append(f"train.zero_stage=3 (now {cfg.train.zero_stage})")
    if cfg.train.offload == "none":
        levers.append("train.offload=optimizer")
    if cfg.rollout.engine == "vllm":
        levers.append(f"a smaller rollout.vllm_memory_fraction (now {cfg.rollout.vllm_memory_fraction})")
    if cfg.teacher.path and (cfg.teacher.compute_dtype or cfg.model.compute_dtype) != "bfloat16":
        levers.append("teacher.compute_dtype=bfloat16 (the teacher is held whole on every rank that trains)")
    elif cfg.teacher.path:
        levers.append("a smaller teacher.path (the teacher is held whole, in bf16, on every rank that trains)")
    return ("vlrft: this rank ran out of GPU memory (where: the traceback above). To fit, in this order: "
            + "; ".join(levers) + ". What fits which GPUs: docs/scaling.md, \"What fits\".")


def entry() -> NoReturn:
    """The `vlrft` command and `python -m vlrft.cli`: `main`, then a process exit that skips the
    interpreter's finalisation (vlrft.distributed.exit_process says why)."""
    from vlrft.distributed import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
