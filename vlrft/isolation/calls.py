"""Calls of untrusted code that cannot stop training: reward recipes and multi-turn
environments and tools. A call in a worker process (vlrft.workers) is killed at its timeout,
whatever it was doing, and the next call starts a fresh process; a call in a daemon thread of
the trainer cannot be killed, so one that outlives its timeout is abandoned (counted in
`abandoned_calls()`) and the function's further calls fail at once until it ends. Either way
the call's time counts toward the step's budget (isolation/budget.py), which may stop the run
naming the call, and the caller gets an `Outcome`: the value, or one line saying why not.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from vlrft.isolation.budget import STEP_BUDGET
from vlrft.workers import CallFailed, CallTimedOut, Worker, raised_text, uncapped

_abandoned = 0  # calls abandoned at their timeout in a thread (a thread cannot be killed)
_still_running: dict[Callable, list[threading.Thread]] = {}  # fn -> its abandoned threads not yet done
_lock = threading.Lock()


@dataclass(frozen=True)
class Outcome:
    """How a guarded call ended: `failure` None and its `value`, or one line saying why not."""

    value: Any = None
    failure: str | None = None


def abandoned_calls() -> int:
    return _abandoned


def call_in_thread(fn: Callable, args: tuple, kwargs: dict, timeout_s: float, kind: str, what: str) -> Outcome:
    """fn(*args, **kwargs) in a daemon thread with a timeout; a call that outlives it is
    abandoned (a thread cannot be killed; counted in abandoned_calls). While one is still
    running, further calls of `fn` fail at once: abandoned threads do not pile up (one per
    concurrent caller at most). `kind` (reward | environment) and `what` (the call and its
    samples, for messages) feed the step's budget (isolation/budget.py): a call the budget cuts
    short raises CallStalled."""
    with _lock:
        running = [t for t in _still_running.pop(fn, []) if t.is_alive()]
        if running:
            _still_running[fn] = running
            return Outcome(failure="not run: a call abandoned at its timeout is still running")
    outcome: dict = {}

    def work() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
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
            _still_running.setdefault(fn, []).append(worker)
        if by_budget:
            raise STEP_BUDGET.stalled(what)
        return Outcome(failure=f"timed out after {timeout_s:g}s")
    if "error" in outcome:
        return Outcome(failure=raised_text(outcome["error"]))
    return Outcome(outcome["value"])


def call_in_worker(worker: Worker, fn: Callable, args: tuple, timeout_s: float, kind: str, what: str,
                   budgeted: bool = True) -> Outcome:
    """fn(*args) in `worker` with a timeout that kills it (vlrft.workers); as call_in_thread,
    the step's budget may cut it short (CallStalled), unless not `budgeted`."""
    started = time.monotonic()
    try:
        return Outcome(worker.call(fn, args, timeout_s, cap=STEP_BUDGET.limit if budgeted else uncapped))
    except CallTimedOut as timed_out:
        if timed_out.capped:
            raise STEP_BUDGET.stalled(what) from None
        return Outcome(failure=str(timed_out))
    except CallFailed as failure:
        return Outcome(failure=str(failure))
    finally:
        STEP_BUDGET.record(kind, time.monotonic() - started)
