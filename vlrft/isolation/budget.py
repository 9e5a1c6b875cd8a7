"""The wall-clock budget of one step's reward and environment calls on a rank
(`guards.step_reward_budget_s`), and the slowest call of the step (a metric).

Each call already has its own timeout (a recipe's `timeout_s`, `rollout.environment_timeout_s`)
after which it is a counted failure and training goes on. That bounds one call, not a step: a
recipe that times out on every batch, or an environment that answers each turn just inside its
timeout, can hold a step for hours while every call "works". The budget bounds the sum: a call
still running when the step's budget is spent stops the run, naming the call and its samples.
The trainer starts the budget at the beginning of each step; a process that never starts it (the
reward server) has no budget.
"""

from __future__ import annotations

import threading
import time

from vlrft.errors import VlrftError

CALL_KINDS = ("reward", "environment")


class CallStalled(VlrftError, RuntimeError):
    """A reward or environment call outlived the step's budget: the run stops (one line)."""


class StepBudget:
    def __init__(self) -> None:
        self.seconds = 0.0  # 0 = no budget
        self.deadline: float | None = None
        self.slowest = dict.fromkeys(CALL_KINDS, 0.0)  # seconds of the step's slowest call, by kind
        self._lock = threading.Lock()  # a turn's environment calls record from several threads

    def start(self, seconds: float) -> None:
        """A new step: the budget is `seconds` from now (0 = none); the slowest calls reset."""
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds if seconds > 0 else None
        self.slowest = dict.fromkeys(CALL_KINDS, 0.0)

    def limit(self, timeout_s: float) -> tuple[float, bool]:
        """(how long a call may run: its own timeout or what is left of the budget, whichever is
        shorter; whether the budget is the shorter)."""
        if self.deadline is None:
            return timeout_s, False
        left = max(self.deadline - time.monotonic(), 0.0)
        return min(timeout_s, left), left < timeout_s

    def record(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.slowest[kind] = max(self.slowest[kind], seconds)

    def stalled(self, what: str) -> CallStalled:
        return CallStalled(
            f"{what} was still running when the step's budget for reward and environment calls ran out "
            f"({self.seconds:g} s, guards.step_reward_budget_s): stopping instead of waiting on it"
        )


# One per process: calls are made deep inside the reward mix and the multi-turn loop, and a
# rank runs one step at a time.
STEP_BUDGET = StepBudget()
