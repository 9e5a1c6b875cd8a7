"""Training checkpoints: written atomically, rotated, found again for `checkpoint.resume`.

A checkpoint is a directory `output.dir/checkpoints/step_NNNNNN/`:

    policy/, critic/   DeepSpeed state (model, optimizer, lr scheduler; ZeRO shards per rank)
    trainer.pt         step, KL controller, return statistics, policy EMA, moving reference,
                       evaluation history (rank 0)
    rank<R>.pt         what differs per rank: RNG states (python, numpy, torch), the replay
                       buffer's shuffle generator, the prompt and PTX stream positions

Everything is first written to `checkpoints/.tmp-step_NNNNNN/`, and only when every rank has
finished is that directory renamed to `step_NNNNNN` (a rename is atomic), so a run killed
while saving leaves the previous checkpoint untouched and resumable; half-written
temporaries are never picked up and are deleted by the next save.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from vlrft.distributed import broadcast_from_rank0
from vlrft.errors import ConfigError

CHECKPOINTS = "checkpoints"
STEP_DIR = re.compile(r"^step_(\d{6,})$")
TEMPORARY_PREFIX = ".tmp-"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoints of a run, oldest first (temporaries are not matched)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name)[1]))


def resume_path(resume: str, run_dir: Path) -> Path | None:
    """`never` -> None; `auto` -> the newest finished checkpoint of the run, or None; anything
    else is a checkpoint directory that must exist."""
    if resume == "never":
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "trainer.pt").is_file():
        raise ConfigError(f"config key 'checkpoint.resume': {path} is not a vlrft checkpoint (no trainer.pt)")
    return path


def temporary_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"{TEMPORARY_PREFIX}{step_dir_name(step)}"


def clear_temporaries(run_dir: Path) -> None:
    """Remove leftovers of saves that were killed half-way (rank 0, before a new save)."""
    root = Path(run_dir) / CHECKPOINTS
    for leftover in root.glob(f"{TEMPORARY_PREFIX}*") if root.is_dir() else []:
        shutil.rmtree(leftover, ignore_errors=True)


def publish(temporary: Path, keep_last: int) -> Path:
    """Rename a fully written temporary into place, then drop all but the newest `keep_last`
    checkpoints (rank 0, after every rank finished writing)."""
    final = temporary.with_name(temporary.name[len(TEMPORARY_PREFIX) :])
    if final.exists():  # the same step saved again: move the old one aside, never lose both
        aside = temporary.with_name(f"{TEMPORARY_PREFIX}old-{final.name}")
        final.rename(aside)
        temporary.rename(final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        temporary.rename(final)
    for old in complete_checkpoints(final.parent.parent)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def discard_after(run_dir: Path, step: int) -> None:
    """Forget what a run did after `step` (rank 0, when resuming from `step`): later checkpoints
    and saved trajectories of the abandoned continuation, and its metric lines, so the resumed
    run's history is one history and rotation never keeps a stale future over fresh work."""
    for later in complete_checkpoints(run_dir):
        if int(STEP_DIR.match(later.name)[1]) > step:
            shutil.rmtree(later, ignore_errors=True)
    trajectories = Path(run_dir) / "trajectories"
    for saved in trajectories.glob("step_*.rank*.jsonl") if trajectories.is_dir() else []:
        if int(saved.name[len("step_") :].split(".")[0]) > step:
            saved.unlink()
    truncate_metrics_after(Path(run_dir) / "metrics.jsonl", step)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        # This rank's own GPU only: touching every visible GPU would open a context on each.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def truncate_metrics_after(path: Path, step: int) -> None:
    """Drop metric lines logged after `step` (a killed run may have logged steps it never
    checkpointed; the resumed run logs them again) and a line the kill cut short. Rewritten
    through a temporary file and a rename, so the log is never half-written."""
    if not path.is_file():
        return

    def keep(line: str) -> bool:
        try:
            return json.loads(line)["step"] <= step
        except (json.JSONDecodeError, KeyError, TypeError):
            return False

    temporary = path.with_name(f"{TEMPORARY_PREFIX}{path.name}")
    temporary.write_text("".join(line for line in path.read_text().splitlines(keepends=True) if keep(line)))
    os.replace(temporary, path)


def checkpoint_step(path: Path) -> int:
    return int(torch.load(Path(path) / "trainer.pt", weights_only=False, map_location="cpu")["step"])


# Keys whose value is baked into a checkpoint's state: resuming with another value would
# silently drop or misuse that state.
STATE_SHAPING_KEYS = ("model.path", "train.seed", "train.ema_beta", "algo.kl.coef", "algo.kl.ref_ema_eta",
                      "critic.enabled", "critic.value_norm", "rollout.rollout_prompts", "train.zero_stage")


def changed_state_keys(saved: dict, current: dict) -> list[str]:
    """The STATE_SHAPING_KEYS whose values differ between two `to_dict` configs."""

    def value(cfg: dict, key: str):
        for part in key.split("."):
            cfg = cfg[part]
        return cfg

    return [key for key in STATE_SHAPING_KEYS if value(saved, key) != value(current, key)]


def resume_decision(resume: str, out_dir: Path, rank: int) -> tuple[Path | None, int]:
    """(checkpoint to resume from or None, its step), decided by rank 0 and broadcast: ranks on
    different nodes may see a shared file system at different moments, and must not disagree
    on whether to resume. A bad `checkpoint.resume` fails on every rank with rank 0's message."""
    decision: tuple = (None, 0, "")
    if rank == 0:
        try:
            path = resume_path(resume, out_dir)
            decision = (str(path) if path else None, checkpoint_step(path) if path else 0, "")
        except ConfigError as err:
            decision = (None, 0, str(err))
    path, step, problem = broadcast_from_rank0(decision)
    if problem:
        raise ConfigError(problem)
    return (Path(path) if path else None), step


def cpu_state_dict(module: torch.nn.Module) -> dict:
    """A state dict of CPU tensors: a checkpoint must load on any rank's device (map_location)."""
    return {name: tensor.detach().cpu() for name, tensor in module.state_dict().items()}
