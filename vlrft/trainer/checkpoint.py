"""Training checkpoints: written atomically, rotated, found again for `checkpoint.resume`.

A checkpoint is a directory `output.dir/checkpoints/step_NNNNNN/`:

    policy/, critic/   DeepSpeed state (model, optimizer, lr scheduler; ZeRO shards per rank)
    trainer.pt         step, KL controller, return statistics, policy EMA, moving reference,
                       evaluation history (rank 0)
    rank<R>.pt         what differs per rank: RNG states (python, numpy, torch), the replay
                       buffer's shuffle generator, the prompt and PTX stream positions (an
                       async run's rollout ranks: RNG states and prompt position, written by
                       their trainers)

Everything is first written to `checkpoints/.tmp-step_NNNNNN/`, and only when every rank has
finished is that directory renamed to `step_NNNNNN` (a rename is atomic), so a run killed
while saving leaves the previous checkpoint untouched and resumable; half-written
temporaries are never picked up and are deleted by the next save. Files and directories are
fsynced before the rename and the parent after it: after a power loss a `step_NNNNNN` that
exists is complete, not a directory of empty files.

Every file a resume reads loads with `weights_only=True`: resuming from a directory never runs
code pickled into it. vlrft's own `.pt` files hold tensors and plain Python data only;
DeepSpeed's (policy/, critic/) also the few DeepSpeed classes of DEEPSPEED_STATE_CLASSES
(trainer/checkpoint_read.py), which vlrft's checkpoint engine allows and nothing else
(backends/deepspeed_backend.py).

Before anything is discarded or any rank loads a file, rank 0 checks everything the resume will
read (`check_checkpoint`): the tree holds regular files and directories only (walked without
following links), every pickle unpickles within PROBE_TIMEOUT_S in a killable worker with
nothing but allow-listed names (trainer/checkpoint_probe.py), and every field the resume uses
from trainer.pt and the rank files has its type and shape (trainer/checkpoint_state.py). A
refused checkpoint stops every rank with the same line; each rank checks again where it opens
its files, and a failure while restoring what it loaded is one line naming the file.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlrft.distributed import broadcast_from_rank0
from vlrft.errors import ConfigError
from vlrft.trainer.checkpoint_read import DEEPSPEED_STATE_DIRS, PickleProbe, checkpoint_files, load_state
from vlrft.trainer.checkpoint_state import rank_state_problem, restore_rng, trainer_state_problem
from vlrft.trainer.weights_delivery import role_ranks
from vlrft.trajectory.records import TRAJECTORY_NAME

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
    return sorted(found, key=checkpoint_step)


def checkpoint_step(checkpoint: Path) -> int:
    """The step of a finished checkpoint's directory (step_000040 -> 40)."""
    return int(STEP_DIR.match(checkpoint.name)[1])


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


def checkpoint_due(step: int, save_steps: int, total_steps: int) -> bool:
    """Every `save_steps` steps and at the last one (0: only on a signal). The last step's
    checkpoint tells a rerun that the run finished, and lets a longer `train.total_steps`
    go on from the end."""
    return save_steps > 0 and (step % save_steps == 0 or step == total_steps)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of `step` is published."""
    return Path(run_dir) / CHECKPOINTS / step_dir_name(step)


def temporary_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"{TEMPORARY_PREFIX}{step_dir_name(step)}"


def clear_temporaries(run_dir: Path) -> None:
    """Remove leftovers of saves that were killed half-way (rank 0, before a new save)."""
    root = Path(run_dir) / CHECKPOINTS
    for leftover in root.glob(f"{TEMPORARY_PREFIX}*") if root.is_dir() else []:
        shutil.rmtree(leftover, ignore_errors=True)


def fsync_path(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file under `root` (DeepSpeed's too), then every directory, deepest first:
    a rename is only durable once what it points at and the entries naming it are on disk."""
    for here, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(here, name))
        fsync_path(here)


def publish(temporary: Path, keep_last: int) -> Path:
    """Rename a fully written temporary into place, then drop all but the newest `keep_last`
    checkpoints (rank 0, after every rank finished writing)."""
    final = temporary.with_name(temporary.name[len(TEMPORARY_PREFIX) :])
    fsync_tree(temporary)
    if final.exists():  # the same step saved again: move the old one aside, never lose both
        aside = temporary.with_name(f"{TEMPORARY_PREFIX}old-{final.name}")
        final.rename(aside)
        temporary.rename(final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        temporary.rename(final)
    fsync_path(final.parent)  # the rename itself
    fsync_path(final.parent.parent)  # `checkpoints/` may be new
    for old in complete_checkpoints(final.parent.parent)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def discard_after(run_dir: Path, step: int, evaluation_at_step: bool = False) -> None:
    """Forget what a run did after `step` (rank 0, when resuming from `step`): later checkpoints
    and saved trajectories of the abandoned continuation, and its metric lines, so the resumed
    run's history is one history and rotation never keeps a stale future over fresh work.
    `evaluation_at_step`: also the evaluation logged at `step` (the resumed run makes it again)."""
    for later in complete_checkpoints(run_dir):
        if checkpoint_step(later) > step:
            shutil.rmtree(later, ignore_errors=True)
    trajectories = Path(run_dir) / "trajectories"
    for saved in trajectories.iterdir() if trajectories.is_dir() else []:
        named = TRAJECTORY_NAME.fullmatch(saved.name)  # a name vlrft did not write is not its to delete
        if named and int(named[1]) > step and not saved.is_dir():
            saved.unlink()
    truncate_metrics_after(Path(run_dir) / "metrics.jsonl", step, evaluation_at_step)


def rng_state() -> dict:
    # numpy's key array as a list of ints: an ndarray would need numpy globals to unpickle.
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (kind, keys.tolist(), int(pos), int(has_gauss), float(gauss))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        # This rank's own GPU only: touching every visible GPU would open a context on each.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    restore_rng(state, random, np.random, torch.default_generator)  # (torch.set_rng_state's generator)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def truncate_metrics_after(path: Path, step: int, evaluation_at_step: bool = False) -> None:
    """Drop metric lines logged after `step` (a killed run may have logged steps it never
    checkpointed; the resumed run logs them again) and a line the kill cut short; with
    `evaluation_at_step`, also a line of `step` holding only evaluation metrics. Rewritten
    through a temporary file and a rename, so the log is never half-written."""
    if not path.is_file():
        return

    def keep(line: str) -> bool:
        try:
            record = json.loads(line)
            if evaluation_at_step and record["step"] == step and all(k == "step" or k.startswith("eval/") for k in record):
                return False
            return record["step"] <= step
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return False

    temporary = path.with_name(f"{TEMPORARY_PREFIX}{path.name}")
    temporary.write_text("".join(line for line in path.read_text().splitlines(keepends=True) if keep(line)))
    fsync_path(temporary)
    os.replace(temporary, path)


# A probe unpickles one pickle of at most 64 MiB (checkpoint_probe.MAX_PICKLE_BYTES): a real one
# takes milliseconds (docs/checkpoints.md); the limits only end one that is not vlrft's.
PROBE_TIMEOUT_S = 60.0
PROBE_MEMORY_BYTES = 4 << 30


# Keys whose value is baked into a checkpoint's state: resuming with another value would
# silently drop or misuse that state.
# (train.mode and rollout.ranks decide which ranks wrote which rank files.)
STATE_SHAPING_KEYS = ("model.path", "train.seed", "train.ema_beta", "algo.kl.coef", "algo.kl.ref_ema_eta",
                      "critic.enabled", "critic.value_norm", "rollout.rollout_prompts", "train.zero_stage",
                      "train.mode", "rollout.ranks")
# Keys newer than some checkpoints: a config saved before them had their default.
DEFAULT_IF_ABSENT = {"train.mode": "sync", "rollout.ranks": 0}
PLAIN = (str, int, float, bool, type(None))  # a config value's types
ABSENT = object()  # a saved config's missing key: equal to no value


def changed_state_keys(saved: dict, current: dict) -> list[str]:
    """The STATE_SHAPING_KEYS whose values differ between two `to_dict` configs (`saved` read
    from a checkpoint: a key missing there, or not a plain value, differs)."""

    def value(cfg: Any, key: str):
        for part in key.split("."):
            if not isinstance(cfg, dict) or part not in cfg:
                return DEFAULT_IF_ABSENT.get(key, ABSENT)
            cfg = cfg[part]
        return cfg

    def same(key: str) -> bool:
        old = value(saved, key)
        return isinstance(old, PLAIN) and old == value(current, key)

    return [key for key in STATE_SHAPING_KEYS if not same(key)]


def check_resumable(path: Path, state: dict, config: dict, world_size: int) -> None:
    """Refuse a resume whose saved state this run could not use as it is (one-line ConfigError)."""
    changed = changed_state_keys(state["config"], config)
    if changed:
        raise ConfigError(
            f"cannot resume from {path}: config keys {', '.join(changed)} differ from the checkpoint's; "
            "keep them, or start over with checkpoint.resume=never"
        )
    if state["world_size"] != world_size:
        raise ConfigError(
            f"checkpoint {path} was written by {state['world_size']} ranks; resume it with the same number "
            f"(this run has {world_size})"
        )
    rank_files = [f"rank{r}.pt" for r in range(world_size)]
    state_dirs = DEEPSPEED_STATE_DIRS[: 1 + bool(config["critic"]["enabled"])]
    missing = [name for name in rank_files if not (path / name).is_file()] + [d for d in state_dirs if not (path / d).is_dir()]
    if missing:
        raise ConfigError(f"checkpoint {path} is incomplete: no {', '.join(missing)}")


def check_checkpoint(path: Path, config: dict, world_size: int) -> int:
    """Check everything a resume from `path` will read, on rank 0, before anything is discarded or
    any rank loads a file (a refusal is a one-line ConfigError naming the file); the
    checkpoint's step. The tree (`checkpoint_files`: no links, no special files), then each
    pickle in a killable worker (`PickleProbe`) before this process loads it, then what
    trainer.pt and each rank file hold (trainer/checkpoint_state.py) and whether this run can
    resume from them (`check_resumable`)."""
    files = checkpoint_files(path)
    trainer_file = path / "trainer.pt"
    if trainer_file not in files:
        raise ConfigError(f"checkpoint {path} is incomplete: no trainer.pt")
    with PickleProbe(PROBE_TIMEOUT_S, PROBE_MEMORY_BYTES) as probe:
        probe.check(trainer_file, deepspeed=False)
        state = load_state(trainer_file, mmap=True)  # probed: it unpickles in time; its tensors stay unread
        refuse_if(trainer_file, "trainer state", trainer_state_problem(state, config))
        check_resumable(path, state, config, world_size)
        rank_files = [path / f"rank{r}.pt" for r in range(world_size)]
        for rank_file in rank_files:
            probe.check(rank_file, deepspeed=False)
        for file in files:
            if file.suffix == ".pt" and file.relative_to(path).parts[0] in DEEPSPEED_STATE_DIRS:
                probe.check(file, deepspeed=True)
    asynchronous = config["train"]["mode"] == "async"
    rollouts = role_ranks(config["rollout"]["ranks"], world_size)[0] if asynchronous else []
    for r, rank_file in enumerate(rank_files):
        refuse_if(rank_file, "rank state", rank_state_problem(load_state(rank_file), trains=r not in rollouts))
    return state["step"]


def refuse_if(path: Path, what: str, problem: str | None) -> None:
    if problem:
        raise ConfigError(f"checkpoint file {path} is not a vlrft {what}: {problem}")


def resume_decision(resume: str, out_dir: Path, rank: int, config: dict, world_size: int) -> tuple[Path | None, int]:
    """(checkpoint to resume from or None, its step), decided by rank 0 and broadcast: ranks on
    different nodes may see a shared file system at different moments, and must not disagree
    on whether to resume. The checkpoint is checked (`check_checkpoint`) here, before the caller
    discards anything after it; a bad `checkpoint.resume` or a refused resume fails on every rank
    with rank 0's message."""
    decision: tuple = (None, 0, "")
    if rank == 0:
        try:
            path = resume_path(resume, out_dir)
            step = check_checkpoint(path, config, world_size) if path is not None else 0
            decision = (str(path) if path else None, step, "")
        except ConfigError as err:
            decision = (None, 0, str(err))
    path, step, problem = broadcast_from_rank0(decision)
    if problem:
        raise ConfigError(problem)
    return (Path(path) if path else None), step


def cpu_state_dict(module: torch.nn.Module) -> dict:
    """A state dict of CPU tensors: a checkpoint must load on any rank's device (map_location)."""
    return {name: tensor.detach().cpu() for name, tensor in module.state_dict().items()}
