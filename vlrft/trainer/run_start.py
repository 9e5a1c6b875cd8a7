"""What a run does with its output directory when it starts (rank 0 decides, every rank follows).

- A checkpoint to resume from (`checkpoint.resume`) at or past `train.total_steps`: the run is
  finished; every rank stops at once with one line (`AlreadyFinished`), nothing trained,
  nothing discarded.
- A checkpoint to resume from: keys that would change what the saved state means are refused
  (checkpoint.STATE_SHAPING_KEYS); every other key that changes what the run computes and
  differs from the checkpoint's config is named in one warning line, and the run goes on with
  the new value. Keys of WHERE_OUTPUTS_GO change no number and are not named.
- No checkpoint (`never`, or `auto` in a directory without one): the run starts over, and what
  a previous run left there (checkpoints, saved trajectories, metric lines) is removed first,
  with one line saying so: an old checkpoint would otherwise be the newest one `auto` finds
  later, and old metric lines would interleave with the new run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlrft.config import Config, to_dict
from vlrft.distributed import barrier
from vlrft.trainer.checkpoint import (
    STATE_SHAPING_KEYS,
    complete_checkpoints,
    discard_after,
    resume_decision,
)
from vlrft.trainer.checkpoint_read import load_state
from vlrft.trajectory.records import TRAJECTORY_NAME

# Config sections that say where outputs go and what is written, not what is computed.
WHERE_OUTPUTS_GO = ("output", "checkpoint", "logging", "trajectory", "guards")
SHOWN_CHARS = 40  # of a changed value in the warning line


class AlreadyFinished(Exception):
    """The checkpoint a run would resume from is at or past `train.total_steps`. Not an error:
    the CLI prints the message and exits 0."""


def flat(config: Any, prefix: str = "") -> dict[str, Any]:
    """A `to_dict` config as {dotted key: value}; lists and the values of free-form dicts
    (kwargs, environment_args) are compared whole."""
    if not isinstance(config, dict) or not config or prefix.endswith(("kwargs", "args", "by_data_source")):
        return {prefix: config}
    out: dict[str, Any] = {}
    for key, value in config.items():
        out |= flat(value, f"{prefix}.{key}" if prefix else str(key))
    return out


def changed_keys(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for each key that changes what a resumed run computes
    and differs from the checkpoint's config. Refused keys (STATE_SHAPING_KEYS) never get
    here; a key the saved config lacks (written before the key existed) cannot be compared."""
    old, new = flat(saved), flat(current)
    return [(key, old[key], value) for key, value in new.items()
            if key in old and old[key] != value
            and key.split(".")[0] not in WHERE_OUTPUTS_GO and key not in STATE_SHAPING_KEYS]


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def changed_keys_line(path: Path, changes: list[tuple[str, Any, Any]]) -> str:
    named = ", ".join(f"{key} ({shown(old)} -> {shown(new)})" for key, old, new in changes)
    return (f"vlrft: warning: resuming from {path} with config keys changed since it was saved: {named}; "
            "the run goes on with the new values (docs/checkpoints.md, 'Resuming with changed keys')")


def forget_previous_run(run_dir: Path) -> str:
    """Remove what a previous run left in `run_dir` (its checkpoints, saved trajectories and
    metric lines); what was removed, in words, or "" if there was nothing."""
    checkpoints = complete_checkpoints(run_dir)
    trajectories = run_dir / "trajectories"
    saved = [p for p in trajectories.iterdir() if TRAJECTORY_NAME.fullmatch(p.name)] if trajectories.is_dir() else []
    metrics = run_dir / "metrics.jsonl"
    lines = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    removed = [f"{len(checkpoints)} checkpoints (the last at {checkpoints[-1].name})"] if checkpoints else []
    removed += [f"{len(saved)} trajectory files"] if saved else []
    removed += [f"{lines} metric lines"] if lines else []
    if removed:
        discard_after(run_dir, -1)  # everything after step -1: all of it
    return ", ".join(removed)


def start_run(cfg: Config, out_dir: Path, rank: int, world_size: int) -> tuple[Path | None, int]:
    """(checkpoint to resume from or None, its step), after the run directory is ready for the
    run (module docstring). Raises AlreadyFinished on every rank when there is nothing to train."""
    config = to_dict(cfg)
    resume_from, step = resume_decision(cfg.checkpoint.resume, out_dir, rank, config, world_size)
    total = cfg.train.total_steps
    if resume_from is not None and step >= total:
        raise AlreadyFinished(
            f"vlrft: {out_dir} already finished at step {step} (train.total_steps={total}, checkpoint {resume_from.name}): "
            "nothing to train; another output.dir or checkpoint.resume=never starts over")
    line = ""
    if rank == 0 and resume_from is not None:
        changes = changed_keys(load_state(resume_from / "trainer.pt", mmap=True)["config"], config)
        line = changed_keys_line(resume_from, changes) if changes else ""
        # (Async runs evaluate the step they resume at again: its first evaluation arrived after the save.)
        discard_after(out_dir, step, evaluation_at_step=cfg.train.mode == "async")
    elif rank == 0:
        removed = forget_previous_run(out_dir)
        line = f"vlrft: starting over in {out_dir}: removed the previous run's {removed}" if removed else ""
    if line:
        print(line, flush=True)
    barrier()  # no rank reads the directory before rank 0 has made it ready
    return resume_from, step
