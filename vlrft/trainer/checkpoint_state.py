"""What vlrft's own checkpoint files must hold for a resume to use them.

Rank 0 checks `trainer.pt` and every `rank<R>.pt` before any rank loads a file
(trainer/checkpoint.py, `check_checkpoint`): each field the resume reads, its type, and its
shape where that is cheap. RNG states are restored into throwaway generators, by the same code
that restores them on each rank (`restore_rng`), so a state its rank would refuse is refused
here. A file of the wrong shape is then one line naming it, on every rank, instead of a crash
on the one rank that reads it while the others wait for it.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import torch

from vlrft.json_shape import exceeds


def restore_rng(state: dict, python, numpy, generator: torch.Generator) -> None:
    """Set python's, numpy's and torch's random streams from a saved `state` (checkpoint.rng_state):
    into the global ones on resume, into throwaway ones to check a state."""
    python.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    numpy.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    generator.set_state(state["torch"])


def is_int(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_ints(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(item) for item in value)


def is_tensors(value: Any) -> bool:
    """A state dict: tensors by name."""
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())


def is_reals_dict(*names: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, dict) and all(is_real(value.get(name)) for name in names)


def is_evaluations(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(entry, (tuple, list)) and len(entry) == 2 and is_int(entry[0]) and is_real(entry[1]) for entry in value)


def rng_problem(state: Any) -> str | None:
    """Why `state` is not a random state `set_rng_state` restores, or None."""
    if not isinstance(state, dict):
        return f"is a {type(state).__name__}, not a dict of random states"
    python = state.get("python")
    if not (isinstance(python, tuple) and len(python) == 3 and (python[2] is None or isinstance(python[2], float))):
        return "has no python random state (version, 625 ints, cached gaussian)"
    try:
        restore_rng(state, random.Random(), np.random.RandomState(), torch.Generator())
        if "cuda" in state:
            cuda = state["cuda"]
            if not (isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8 and cuda.dim() == 1):
                return "has a CUDA random state that is not a 1-D uint8 tensor"
            if torch.cuda.is_available():
                torch.Generator(device="cuda").set_state(cuda)
    except Exception as err:  # noqa: BLE001 - each library refuses a bad state with its own type
        return f"is not a random state this rank can restore ({type(err).__name__}: {' '.join(str(err).split())[:120]})"
    return None


def field_problem(state: dict, checks: list[tuple[str, Callable[[Any], bool], str]]) -> str | None:
    """The first field of `state` failing its check (name, check, what it must be), in words."""
    for name, ok, what in checks:
        if name not in state:
            return f"it has no field '{name}'"
        if not ok(state[name]):
            return f"its field '{name}' must be {what} (it holds a {type(state[name]).__name__})"
    return None


# A saved config is compared with the run's key by key at resume (run_start.changed_keys):
# walks and comparisons that recurse once per level. A real one nests about 6 levels (recipe
# kwargs and environment arguments a few more); unpickling nests without recursing, so a file
# can hold one deeper than Python's recursion limit.
CONFIG_MAX_DEPTH = 32
CONFIG_MAX_VALUES = 100_000


def is_config(value: Any) -> bool:
    return isinstance(value, dict) and exceeds(value, CONFIG_MAX_DEPTH, CONFIG_MAX_VALUES) is None


def trainer_state_problem(state: Any, config: dict) -> str | None:
    """Why `state` (trainer.pt) is not one this run (`config`, a to_dict config) can resume
    from, or None."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a dict of trainer state"
    value_norm = config["critic"]["value_norm"] != "none"
    ema = config["train"]["ema_beta"] > 0
    moving_reference = config["algo"]["kl"]["ref_ema_eta"] > 0
    return field_problem(state, [
        ("step", is_int, "a step number (an int >= 0)"),
        ("world_size", lambda value: is_int(value, 1), "a number of ranks (an int >= 1)"),
        ("config", is_config, f"a config (a dict nesting at most {CONFIG_MAX_DEPTH} levels)"),
        ("kl_controller", is_reals_dict("coef"), "a KL controller's state (a dict with a number 'coef')"),
        ("return_stats", *when(value_norm, is_reals_dict("mean_acc", "sq_acc", "weight"),
                               "value-normalisation statistics (numbers 'mean_acc', 'sq_acc', 'weight')")),
        ("policy_ema", *when(ema, is_tensors, "tensors by name (the policy EMA)")),
        ("reference", *when(moving_reference, is_tensors, "tensors by name (the moving reference)")),
        ("eval_history", is_evaluations, "a list of (step, accuracy) pairs"),
        ("zero_reward_streak", is_int, "a number of steps (an int >= 0)"),
    ])


def when(used: bool, check: Callable[[Any], bool], what: str) -> tuple[Callable[[Any], bool], str]:
    """A field's check and its words where the run uses the field; else None, which the trainer
    writes then (a resume restores such a field only when it is not None)."""
    return (check, what) if used else (lambda value: value is None, "None")


def rank_state_problem(state: Any, trains: bool) -> str | None:
    """Why `state` (a rank<R>.pt; `trains`: its rank trains, else an async run's rollout rank)
    is not one its rank can resume from, or None."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a dict of rank state"
    if "rng" not in state:
        return "it has no field 'rng'"
    problem = rng_problem(state["rng"])
    if problem:
        return f"its field 'rng' {problem}"
    checks = [("prompts_consumed", is_int, "a number of prompts (an int >= 0)")]
    if trains:
        checks += [("buffer_generator", is_generator_state, "a torch generator's state"),
                   ("ptx_position", is_int, "a stream position (an int >= 0)")]
    if "dropped_rows" in state:  # absent from checkpoints older than the field
        checks.append(("dropped_rows", is_ints, "a list of row numbers (ints >= 0)"))
    return field_problem(state, checks)


def is_generator_state(value: Any) -> bool:
    """A state the replay buffer's torch.Generator takes (tried on a throwaway one)."""
    try:
        torch.Generator().set_state(value)
    except (TypeError, RuntimeError, ValueError):
        return False
    return True
