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

import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from vlrft.config import ConfigError

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
    if final.exists():  # a re-run of the same step after a resume: replace it
        shutil.rmtree(final)
    temporary.rename(final)
    for old in complete_checkpoints(final.parent.parent)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def truncate_metrics_after(path: Path, step: int) -> None:
    """Drop metric lines logged after `step`: a killed run may have logged steps it never
    checkpointed, and the resumed run logs them again."""
    if not path.is_file():
        return
    import json

    kept = [line for line in path.read_text().splitlines(keepends=True) if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(kept))
