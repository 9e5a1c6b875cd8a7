"""The environments of a rank's trajectories, held in one worker process (vlrft.workers), so
that a timeout really ends a hung construction, reset or step.

Each trajectory's environment lives in the worker under a key; construction, reset and step
are calls into it, one at a time, each with `rollout.environment_timeout_s`. A call that times
out kills the worker: its trajectory fails with the timeout, and every other environment held
in that worker is lost with it: its trajectory's next call fails in one line naming the call
that timed out (both count as environment failures). The next construction starts a fresh
worker. Anything a call returns (a Step with its PIL images) comes back pickled.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

from vlrft.multiturn.environment import Environment, EnvironmentFailure, resolve_environment
from vlrft.isolation.calls import call_in_worker
from vlrft.workers import START_TIMEOUT_S, CallFailed, Worker


@dataclass(frozen=True)
class Held:
    """A trajectory's environment in the worker: its key, and the worker process it lives in."""

    key: int
    generation: int


class EnvironmentHost:
    """Constructs, resets and steps environments `name(**args)` in this rank's worker process."""

    def __init__(self, name: str, args: dict, timeout_s: float):
        self.name, self.args, self.timeout_s = name, args, timeout_s
        self.worker = Worker(prepare=(load, (name,)))
        self._keys = itertools.count()
        self._lost: dict[int, str] = {}  # worker generation -> the call that ended that worker

    def probe(self) -> str:
        """Build one environment and drop it: its `observation_role` (default "tool"), or the
        EnvironmentFailure of a bad `environment_args`. Part of starting the worker, so under
        its start limit, not a call's timeout."""
        key = next(self._keys)
        try:
            role = self.worker.call(construct, (self.name, self.args, key), START_TIMEOUT_S)
        except CallFailed as failure:
            raise EnvironmentFailure(str(failure)) from None
        self.release([Held(key, self.worker.generation)])
        return role

    def construct(self, what: str) -> Held:
        """A fresh environment in the worker; its handle."""
        key = next(self._keys)
        self._call(construct, (self.name, self.args, key), what)
        return Held(key, self.worker.generation)

    def reset(self, held: Held, sample: dict, what: str) -> None:
        self._call_held(held, reset, (held.key, sample), what)

    def step(self, held: Held, action: str, what: str) -> Any:
        """What the environment's `step` returned (checked by the caller: environment.as_step)."""
        return self._call_held(held, step, (held.key, action), what)

    def release(self, helds: list[Held]) -> None:
        """Drop finished trajectories' environments from the worker. Outside the step's budget
        and never a failure: a release that times out kills the worker, which frees them too."""
        alive = [h.key for h in helds if h.generation == self.worker.generation]
        if alive and self.worker.running:
            try:
                self.worker.call(release, (alive,), self.timeout_s)
            except CallFailed:
                pass
        self._lost.clear()

    def _call_held(self, held: Held, fn: Callable, args: tuple, what: str) -> Any:
        if held.generation != self.worker.generation or not self.worker.running:
            ended = self._lost.get(held.generation, "it was stopped")
            raise EnvironmentFailure(f"not run: its environment was lost with its worker process ({ended})")
        return self._call(fn, args, what)

    def _call(self, fn: Callable, args: tuple, what: str) -> Any:
        outcome = call_in_worker(self.worker, fn, args, self.timeout_s, "environment", what)
        if not self.worker.running:  # this call ended the worker, and every environment in it
            self._lost[self.worker.generation] = f"{what}: {outcome.failure}"
        if outcome.failure is not None:
            raise EnvironmentFailure(outcome.failure)
        return outcome.value


# ---- in the worker: the environments, by key

_held: dict[int, Environment] = {}


def load(name: str) -> None:
    resolve_environment(name)


def construct(name: str, args: dict, key: int) -> str:
    """Build and hold an environment; its observation_role (how the template wraps observations)."""
    environment = resolve_environment(name)(**args)
    _held[key] = environment
    return getattr(environment, "observation_role", "tool")


def reset(key: int, sample: dict) -> None:
    _held[key].reset(sample)


def step(key: int, action: str) -> Any:
    return _held[key].step(action)


def release(keys: list[int]) -> None:
    for key in keys:
        _held.pop(key, None)
