"""Calling a recipe so that nothing it does can stop training: a timeout and checked output.

A recipe runs in a worker process of its own (vlrft.workers; one per recipe per rank, one call
at a time): a call past its timeout kills the process, whatever the recipe was doing, and the
next call starts a fresh one (counted in vlrft.workers.killed_calls). A recipe marked
`recipe.runs_in_trainer = True` runs in a daemon thread of the trainer instead: the model-based
built-ins (a worker would load a second copy of the model and a second CUDA context on the
trainer's GPU) and `remote` (a network call bounded by its own deadline). A thread cannot be
killed, so a hung call there is abandoned (vlrft/isolation/calls.py), and the recipe's
calls fail at once until it ends. Either way a call that raises, returns something malformed
or outlives its timeout becomes a `RecipeFailure`; the mix then uses the recipe's fallback.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

from vlrft.isolation.calls import Outcome, call_in_thread, call_in_worker
from vlrft.rewards.loading import resolve_recipe
from vlrft.workers import Worker


class RecipeFailure(RuntimeError):
    """One failed recipe call; the message is one line saying why."""


def runs_in_trainer(recipe: Callable) -> bool:
    """Whether the recipe asked to run in a trainer thread (`recipe.runs_in_trainer = True`)."""
    return getattr(recipe, "runs_in_trainer", False) is True


def call_recipe(
    fn: Callable, completions: list[str], samples: list[dict], kwargs: dict, timeout_s: float, what: str = "a reward recipe"
) -> list:
    """fn(completions, samples, **kwargs) in a trainer thread with a wall-clock timeout; its
    checked score list. `what` names the call in a budget stop (isolation/budget.py)."""
    outcome = call_in_thread(fn, (completions, samples), kwargs, timeout_s, "reward", what)
    return _scores(outcome, len(completions))


def recipe_worker(name: str) -> Worker:
    """The worker process that runs the recipe a config names (it imports the recipe at start)."""
    return Worker(prepare=(load_recipe, (name,)))


def call_recipe_in_worker(
    worker: Worker, name: str, completions: list[str], samples: list[dict], kwargs: dict, timeout_s: float, what: str
) -> list:
    """The recipe `name` on the batch in its worker process (recipe_worker), with a timeout
    that kills it; its checked score list."""
    outcome = call_in_worker(worker, run_recipe, (name, completions, samples, kwargs), timeout_s, "reward", what)
    return _scores(outcome, len(completions))


# In the worker: the recipe is found by its config name (loading.py), as the trainer found it.
def load_recipe(name: str) -> None:
    resolve_recipe(name)


def run_recipe(name: str, completions: list[str], samples: list[dict], kwargs: dict) -> Any:
    return resolve_recipe(name)(completions, samples, **kwargs)


def _scores(outcome: Outcome, count: int) -> list:
    if outcome.failure is not None:
        raise RecipeFailure(outcome.failure)
    return check_scores(outcome.value, count)


def check_scores(scores, count: int) -> list:
    """A list of `count` items, each None, a finite number, a list of finite numbers (dense) or
    a dict of named finite numbers (components); else a RecipeFailure saying what is wrong."""
    try:
        scores = list(scores)
    except TypeError:
        raise RecipeFailure(f"returned {type(scores).__name__}, not a list of scores") from None
    if len(scores) != count:
        raise RecipeFailure(f"returned {len(scores)} scores for {count} completions")
    for i, score in enumerate(scores):
        if score is None:
            continue
        values = score.values() if isinstance(score, dict) else score if isinstance(score, (list, tuple)) else [score]
        for value in values:
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise RecipeFailure(f"score {i} is {value!r}, not a finite number")
    return scores
