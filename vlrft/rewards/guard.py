"""Calling a recipe so that nothing it does can stop training: a timeout and checked output.

Each call runs in a daemon worker thread. A call that raises, returns something malformed or
outlives its timeout becomes a `RecipeFailure`; the mix then uses the recipe's fallback. A
thread cannot be killed, so a hung call is abandoned (and counted in `abandoned_calls()`);
recipes that execute untrusted code must use the subprocess sandbox (vlrft.rewards.sandbox),
which enforces its own time and memory limits.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from typing import Callable

from vlrft.rewards.budget import STEP_BUDGET

_abandoned = 0  # threads still running a timed-out call (they cannot be killed)
_lock = threading.Lock()


class RecipeFailure(RuntimeError):
    """One failed recipe call; the message is one line saying why."""


def abandoned_calls() -> int:
    return _abandoned


def call_in_thread(fn: Callable, timeout_s: float, kind: str, what: str) -> dict | None:
    """fn() in a daemon thread: {"value": result} or {"error": what it raised}, or None when it
    outlived `timeout_s` (abandoned: a thread cannot be killed; counted in abandoned_calls).
    `kind` (reward | environment) and `what` (the call and its samples, for messages) feed the
    step's budget (rewards/budget.py): a call the budget cuts short raises CallStalled."""
    outcome: dict = {}

    def work() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - anything the call raises is its failure
            outcome["error"] = err

    limit, by_budget = STEP_BUDGET.limit(timeout_s)
    worker = threading.Thread(target=work, daemon=True, name=f"vlrft-{kind}")
    started = time.monotonic()
    worker.start()
    worker.join(limit)
    STEP_BUDGET.record(kind, time.monotonic() - started)
    if worker.is_alive():
        global _abandoned
        with _lock:
            _abandoned += 1
        if by_budget:
            raise STEP_BUDGET.stalled(what)
        return None
    return outcome


def failure_text(outcome: dict | None, timeout_s: float) -> str | None:
    """One line saying why a `call_in_thread` call failed, or None when it returned."""
    if outcome is None:
        return f"timed out after {timeout_s:g}s"
    if "error" in outcome:
        err = outcome["error"]
        return f"raised {type(err).__name__}: {_one_line(str(err))}"
    return None


def call_recipe(
    fn: Callable, completions: list[str], samples: list[dict], kwargs: dict, timeout_s: float, what: str = "a reward recipe"
) -> list:
    """fn(completions, samples, **kwargs) with a wall-clock timeout; its checked score list.
    `what` names the call in a budget stop (rewards/budget.py)."""
    outcome = call_in_thread(lambda: fn(completions, samples, **kwargs), timeout_s, "reward", what)
    problem = failure_text(outcome, timeout_s)
    if problem is not None:
        raise RecipeFailure(problem)
    return check_scores(outcome["value"], len(completions))


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


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
