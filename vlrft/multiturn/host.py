"""The environments of a rank's trajectories, held in `rollout.environment_workers` worker
processes (vlrft.workers), so that a timeout really ends a hung construction, reset or step, and
so that the calls of one turn run at the same time: an environment that waits on something (a
sandbox, a web page, a simulator) waits once per turn, not once per trajectory.

Each trajectory's environment lives in one worker (round robin) under a key; construction,
reset and step are calls into it, each with `rollout.environment_timeout_s`. A worker serves
one call at a time, from its own thread (`submit`, `each`), so calls into different workers
overlap, and the rank can go on with other work while they run. A call that times out kills
its worker: its trajectory fails with the timeout, and every other environment held in that
worker is lost with it: its trajectory's next call fails in one line naming the call that
timed out (both count as environment failures). The next construction in that worker starts
a fresh process. Anything a call returns (a Step with its PIL images) comes back pickled.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from vlrft.multiturn.environment import Environment, EnvironmentFailure, resolve_environment
from vlrft.isolation.calls import call_in_worker
from vlrft.workers import START_TIMEOUT_S, CallFailed, Worker


@dataclass(frozen=True)
class Held:
    """A trajectory's environment: its key, the worker it lives in and that worker's process."""

    key: int
    worker: int
    generation: int


class EnvironmentHost:
    """Constructs, resets and steps environments `name(**args)` in this rank's worker processes."""

    def __init__(self, name: str, args: dict, timeout_s: float, workers: int = 1):
        self.name, self.args, self.timeout_s = name, args, timeout_s
        self.workers = [Worker(prepare=(load, (name,))) for _ in range(workers)]
        self._keys = itertools.count()
        self._next_worker = 0  # where workers_for's round robin goes on
        self._lost: dict[tuple[int, int], str] = {}  # (worker, generation) -> the call that ended that process
        # One thread per worker process: its calls queue there in order, and calls into
        # different workers run at the same time.
        self._queues = [ThreadPoolExecutor(1, thread_name_prefix=f"vlrft-environment-{i}") for i in range(workers)]

    def probe(self) -> str:
        """Build one environment and drop it: its `observation_role` (default "tool"), or the
        EnvironmentFailure of a bad `environment_args`. Part of starting the first worker, so
        under its start limit, not a call's timeout."""
        key = next(self._keys)
        try:
            role = self.workers[0].call(construct, (self.name, self.args, key), START_TIMEOUT_S)
        except CallFailed as failure:
            raise EnvironmentFailure(str(failure)) from None
        self.release([Held(key, 0, self.workers[0].generation)])
        return role

    def submit(self, jobs: list[tuple[int, Callable[[], Any]]]) -> list[Future]:
        """Start the jobs, each a (worker index, function making calls into that worker), without
        waiting: one worker's jobs run in order (after what was submitted to it before),
        different workers' at the same time. Their futures, in the jobs' order."""
        return [self._queues[worker].submit(job) for worker, job in jobs]

    def each(self, jobs: list[tuple[int, Callable[[], Any]]]) -> list[Any]:
        """`submit` the jobs and wait: what each job returned, in the jobs' order; what a job
        raises (a stalled step's CallStalled) is raised here once every job has ended."""
        return results(self.submit(jobs))

    def workers_for(self, count: int) -> list[int]:
        """The workers of `count` new trajectories: round robin, going on from where the last
        batch's ended, so that batches in flight at the same time (an asynchronous rollout rank's)
        spread over the workers instead of queueing in the first ones."""
        first, self._next_worker = self._next_worker, (self._next_worker + count) % len(self.workers)
        return [(first + i) % len(self.workers) for i in range(count)]

    def construct(self, what: str, worker: int = 0, budgeted: bool = True) -> Held:
        """A fresh environment in worker `worker`; its handle. `budgeted`: the step's budget for
        reward and environment calls may cut this call short (as the other calls' same flag)."""
        key = next(self._keys)
        self._call(worker, construct, (self.name, self.args, key), what, budgeted)
        return Held(key, worker, self.workers[worker].generation)

    def reset(self, held: Held, sample: dict, what: str, budgeted: bool = True) -> None:
        self._call_held(held, reset, (held.key, sample), what, budgeted)

    def step(self, held: Held, action: str, what: str, budgeted: bool = True) -> Any:
        """What the environment's `step` returned (checked by the caller: environment.as_step)."""
        return self._call_held(held, step, (held.key, action), what, budgeted)

    def release(self, helds: list[Held]) -> None:
        """Drop finished trajectories' environments from their workers, in each worker's queue
        (after its calls already queued; not waited for). Outside the step's budget and never a
        failure: a release that times out kills the worker, which frees them too."""
        for index in {h.worker for h in helds}:
            keys = [(h.key, h.generation) for h in helds if h.worker == index]
            self._queues[index].submit(self._release_in, index, keys)

    def _release_in(self, index: int, keys: list[tuple[int, int]]) -> None:
        worker = self.workers[index]
        alive = [key for key, generation in keys if generation == worker.generation]
        if alive and worker.running:
            try:
                worker.call(release, (alive,), self.timeout_s)
            except CallFailed:
                pass

    def stop(self) -> None:
        """End every worker process (they also end with this object and at exit)."""
        for worker in self.workers:
            worker.stop()
        for queue in self._queues:
            queue.shutdown(wait=False)

    def _call_held(self, held: Held, fn: Callable, args: tuple, what: str, budgeted: bool) -> Any:
        worker = self.workers[held.worker]
        if held.generation != worker.generation or not worker.running:
            ended = self._lost.get((held.worker, held.generation), "it was stopped")
            raise EnvironmentFailure(f"not run: its environment was lost with its worker process ({ended})")
        return self._call(held.worker, fn, args, what, budgeted)

    def _call(self, index: int, fn: Callable, args: tuple, what: str, budgeted: bool) -> Any:
        worker = self.workers[index]
        outcome = call_in_worker(worker, fn, args, self.timeout_s, "environment", what, budgeted)
        if not worker.running:  # this call ended the worker, and every environment in it
            self._lost[(index, worker.generation)] = f"{what}: {outcome.failure}"
        if outcome.failure is not None:
            raise EnvironmentFailure(outcome.failure)
        return outcome.value


def results(futures: list[Future]) -> list[Any]:
    """The futures' results in order, once every one has ended; the first error is raised then."""
    for future in futures:
        future.exception()  # waits
    return [future.result() for future in futures]


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
