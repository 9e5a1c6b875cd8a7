"""What SPMDTrainer writes into a checkpoint and reads back (layout, atomicity and the resume
checks: trainer/checkpoint.py). Kept apart from the loop so the loop file stays the loop."""

from __future__ import annotations

import signal
from pathlib import Path

import torch

from vlrft import progress
from vlrft.config import to_dict
from vlrft.distributed import barrier, global_rank, global_world_size
from vlrft.trainer.checkpoint import (
    checkpoint_dir,
    cpu_state_dict,
    clear_temporaries,
    fsync_tree,
    publish,
    rng_state,
    set_rng_state,
    temporary_dir,
)
from vlrft.trainer.checkpoint_read import load_state, restoring


class TrainingStopped(Exception):
    """Training ended early on a signal, after saving a checkpoint to resume from."""

    def __init__(self, step: int, checkpoint: Path, signum: int):
        super().__init__(f"stopped by signal {signal.Signals(signum).name} after step {step}; checkpoint {checkpoint}")
        self.step, self.checkpoint, self.signum = step, checkpoint, signum


def save_checkpoint(trainer, rollout_states: dict[int, dict] | None = None) -> Path:
    """Write `trainer`'s current step as a checkpoint (collective over the ranks that train);
    `rollout_states`: the rank files of an async run's rollout ranks this rank writes, by
    global rank. Returns the checkpoint's final path."""
    progress.enter(f"step {trainer.global_step}: saving a checkpoint")
    temporary = temporary_dir(trainer.out_dir, trainer.global_step)
    if trainer.rank == 0:
        clear_temporaries(trainer.out_dir)
        temporary.mkdir(parents=True)
    barrier()
    trainer.backend.save_checkpoint(temporary / "policy")
    if trainer.critic is not None:
        trainer.critic.save_checkpoint(temporary / "critic")
    torch.save(
        {
            "rng": rng_state(),
            "buffer_generator": trainer.buffer.generator.get_state(),
            "prompts_consumed": trainer.sampler.consumed,
            "dropped_rows": sorted(trainer.bad_input.dropped_rows),
            "ptx_position": trainer.ptx.position if trainer.ptx is not None else 0,
        },
        temporary / f"rank{global_rank()}.pt",
    )
    for rollout_rank, state in (rollout_states or {}).items():
        torch.save(state, temporary / f"rank{rollout_rank}.pt")
    if trainer.rank == 0:
        moving_reference = trainer.reference is not None and trainer.cfg.algo.kl.ref_ema_eta > 0
        torch.save(
            {
                "step": trainer.global_step,
                "world_size": global_world_size(),
                "config": to_dict(trainer.cfg),
                "kl_controller": trainer.kl_controller.state_dict(),
                "return_stats": trainer.return_stats.state_dict() if trainer.return_stats is not None else None,
                "policy_ema": trainer.policy_ema,
                "reference": cpu_state_dict(trainer.reference) if moving_reference else None,
                "eval_history": [(int(step), float(accuracy)) for step, accuracy in trainer.eval_history],
                "zero_reward_streak": trainer.zero_reward_watch.streak,
                "rollbacks": list(trainer.rollbacks.to_steps),
                "lr_scale": trainer.rollbacks.lr_scale,
            },
            temporary / "trainer.pt",
        )
    # Every rank flushes what it wrote (on a network file system only the writer can); rank 0
    # flushes the whole tree again in publish, once every rank's files exist.
    fsync_tree(temporary)
    barrier()  # every rank's files are complete and on disk: only now may the checkpoint appear
    if trainer.rank == 0:
        publish(temporary, trainer.cfg.checkpoint.keep_last)
    barrier()
    return checkpoint_dir(trainer.out_dir, trainer.global_step)


def load_checkpoint(trainer, path: Path) -> None:
    """Continue exactly where the checkpoint left off (every rank). Rank 0 checked every file
    (checkpoint.check_checkpoint) before anything after it was discarded; what restoring still
    finds wrong is one line naming the file (checkpoint_read.restoring), for vlrft's own files
    before DeepSpeed's load, so every rank that trains stops there alike."""
    trainer_file, rank_file = path / "trainer.pt", path / f"rank{global_rank()}.pt"
    state, mine = load_state(trainer_file), load_state(rank_file)
    with restoring(trainer_file):
        trainer.global_step = state["step"]
        # An async run's rollout ranks evaluate the checkpoint's step again (discard_after dropped
        # its line): trainer rank 0 may have logged that evaluation already when it saved.
        again = trainer.cfg.train.mode == "async"
        trainer.eval_history = [tuple(entry) for entry in state["eval_history"] if not (again and entry[0] >= trainer.global_step)]
        trainer.zero_reward_watch.streak = state["zero_reward_streak"]
        trainer.rollbacks.to_steps = set(state.get("rollbacks", ()))  # (absent before rollbacks existed)
        trainer.rollbacks.lr_scale = state.get("lr_scale", 1.0)
    with restoring(rank_file):
        trainer.sampler.consumed = mine["prompts_consumed"]
        trainer.bad_input.dropped_rows = set(mine.get("dropped_rows", ()))  # named once per run, resumed or not
        if trainer.ptx is not None:
            trainer.ptx.position = mine["ptx_position"]
        trainer.buffer.generator.set_state(mine["buffer_generator"])
    restore_models(trainer, path, state)
    if trainer.role == "trainer":  # the rollout ranks get the restored policy as its step's version
        trainer.engine.resume_at(trainer.global_step)
    trainer.guards.digests.update(trainer.policy_weights(), f"after resuming from {path.name}")  # serve the restored policy
    if trainer.rank == 0:
        print(f"vlrft: resumed from {path} at step {trainer.global_step}", flush=True)
    with restoring(rank_file):
        set_rng_state(mine["rng"])  # last: nothing above may draw from the restored streams


def restore_models(trainer, path: Path, state: dict, schedule: bool = True) -> None:
    """What the checkpoint at `path` (its trainer.pt read as `state`) holds of the models: the
    policy and its optimizer, the critic, the policy EMA, a moving reference, the KL controller
    and the return statistics. `schedule=False` keeps the current learning-rate schedule (a
    rollback: trainer/rollback.py). Every rank that trains (collective)."""
    with restoring(path / "trainer.pt"):
        trainer.kl_controller.load_state_dict(state["kl_controller"])
        if trainer.return_stats is not None:
            trainer.return_stats.load_state_dict(state["return_stats"])
        if trainer.policy_ema is not None:
            trainer.policy_ema = same_layout(state["policy_ema"], trainer.policy_ema, "policy_ema")
        if state["reference"] is not None:
            trainer.reference.load_state_dict(state["reference"])
    with restoring(path / "policy"):
        trainer.backend.load_checkpoint(path / "policy", schedule)
    if trainer.critic is not None:
        with restoring(path / "critic"):
            trainer.critic.load_checkpoint(path / "critic", schedule)


def same_layout(saved: dict, current: dict, what: str) -> dict:
    """`saved` (tensors by name), if it has `current`'s names, shapes and dtypes; else ValueError
    naming the first that differs (a checkpoint of another model)."""
    differs = sorted(set(saved) ^ set(current)) or [
        name for name in current if (saved[name].shape, saved[name].dtype) != (current[name].shape, current[name].dtype)]
    if differs:
        raise ValueError(f"its {what} does not match this model's at {differs[0]!r}")
    return saved
