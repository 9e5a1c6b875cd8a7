"""The environments of a rank's trajectories, each alone in a worker process (vlrft.workers), so
that a timeout really ends a hung construction, reset or step and costs nothing but that
trajectory; and so that the calls of one turn run at the same time: an environment that waits
on something (a sandbox, a web page, a simulator) waits once per turn, not once per trajectory.

A worker holds one trajectory's environment at a time: a trajectory takes an idle worker (or
starts one) when its environment is built, and gives it back when it is released; the worker
then serves a later trajectory, so a rank keeps as many processes as it had trajectories in
flight at once. Workers are forked from the host's zygote (vlrft.worker_zygote), a fresh
interpreter that has imported the environment's module: a start costs a millisecond, and the
imports' memory is shared. Construction, reset and step are calls into the trajectory's
worker, each with `rollout.environment_timeout_s`; a call that times out kills its worker, and
with it only its own trajectory's environment (the next construction there forks a fresh
process). Calls run in a pool of `rollout.environment_workers` threads, that many at a time
(`submit`, `each`), so the rank can go on with other work while they run; a CPU-bound
environment or a sandboxed tool is not run by every trajectory at once. Anything a call
returns (a Step with its PIL images) comes back pickled.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from PIL import Image

from vlrft.multiturn.environment import Environment, EnvironmentFailure, resolve_environment
from vlrft.isolation.calls import call_in_worker
from vlrft.worker_zygote import Zygote
from vlrft.workers import START_TIMEOUT_S, CallFailed, Worker


@dataclass(frozen=True)
class Held:
    """A trajectory's environment: its key, the worker holding it and that worker's process."""

    key: int
    worker: Worker
    generation: int


class EnvironmentHost:
    """Constructs, resets and steps environments `name(**args)`, each in a worker process of its
    own; `concurrent_calls` calls run at the same time."""

    def __init__(self, name: str, args: dict, timeout_s: float, concurrent_calls: int = 1):
        self.name, self.args, self.timeout_s = name, args, timeout_s
        self.zygote = Zygote(prepare=(load, (name,)))  # what every worker is forked from
        self.workers: list[Worker] = []  # every worker started, idle or holding an environment
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._calls = ThreadPoolExecutor(concurrent_calls, thread_name_prefix="vlrft-environment")

    def probe(self) -> str:
        """Build one environment and drop it: its `observation_role` (default "tool"), or the
        EnvironmentFailure of a bad `environment_args`. Part of starting the first worker, so
        under its start limit, not a call's timeout."""
        worker, key = self._take(), next(self._keys)
        try:
            role = worker.call(construct, (self.name, self.args, key), START_TIMEOUT_S)
        except CallFailed as failure:
            self._give_back(worker)
            raise EnvironmentFailure(str(failure)) from None
        self.release([Held(key, worker, worker.generation)])  # idle: the first trajectory's worker
        return role

    def submit(self, jobs: list[Callable[[], Any]]) -> list[Future]:
        """Start the jobs (functions making calls into environments) without waiting; they run
        `concurrent_calls` at a time, in order. Their futures, in the jobs' order."""
        return [self._calls.submit(job) for job in jobs]

    def each(self, jobs: list[Callable[[], Any]]) -> list[Any]:
        """`submit` the jobs and wait: what each job returned, in the jobs' order; what a job
        raises (a stalled step's CallStalled) is raised here once every job has ended."""
        return results(self.submit(jobs))

    def construct(self, what: str, budgeted: bool = True) -> Held:
        """A fresh environment in a worker of its own; its handle. `budgeted`: the step's budget
        for reward and environment calls may cut this call short (as the other calls' same flag)."""
        worker, key = self._take(), next(self._keys)
        try:
            self._call(worker, construct, (self.name, self.args, key), what, budgeted)
        except BaseException:  # its failure, or the step's budget: the worker is free again
            self._give_back(worker)
            raise
        return Held(key, worker, worker.generation)

    def reset(self, held: Held, sample: dict, what: str, budgeted: bool = True) -> None:
        self._call_held(held, reset, (held.key, sample), what, budgeted)

    def step(self, held: Held, action: str, what: str, budgeted: bool = True) -> Any:
        """What the environment's `step` returned (checked by the caller: environment.as_step)."""
        return self._call_held(held, step, (held.key, action), what, budgeted)

    def release(self, helds: list[Held]) -> list[Future]:
        """Give finished trajectories' workers back for later trajectories, now, and drop their
        environments there in jobs after those already submitted (their futures: a rollout does
        not wait for them). A later trajectory's construction that comes first drops it itself,
        and the release is a no-op. Never a failure: a release that times out kills the worker,
        which frees the environment too, and the next construction there starts a fresh one."""
        for held in helds:
            self._give_back(held.worker)
        return [self._calls.submit(self._release_in, held) for held in helds]

    def _release_in(self, held: Held) -> None:
        if held.generation == held.worker.generation and held.worker.running:
            try:
                held.worker.call(release, (held.key,), self.timeout_s)
            except CallFailed:
                pass

    def stop(self) -> None:
        """End every worker process (they also end with this object and at exit)."""
        for worker in self.workers:
            worker.stop()
        self.zygote.stop()
        self._calls.shutdown(wait=False)

    def _take(self) -> Worker:
        """An idle worker, or a new one when none is."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
            worker = Worker(zygote=self.zygote)
            self.workers.append(worker)
            return worker

    def _give_back(self, worker: Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    def _call_held(self, held: Held, fn: Callable, args: tuple, what: str, budgeted: bool) -> Any:
        if held.generation != held.worker.generation or not held.worker.running:
            raise EnvironmentFailure("not run: its worker process was stopped")
        return self._call(held.worker, fn, args, what, budgeted)

    def _call(self, worker: Worker, fn: Callable, args: tuple, what: str, budgeted: bool) -> Any:
        outcome = call_in_worker(worker, fn, args, self.timeout_s, "environment", what, budgeted)
        if outcome.failure is not None:
            raise EnvironmentFailure(outcome.failure)
        return outcome.value


def results(futures: list[Future]) -> list[Any]:
    """The futures' results in order, once every one has ended; the first error is raised then."""
    for future in futures:
        future.exception()  # waits
    return [future.result() for future in futures]


# ---- in the worker: the one environment it holds, under its key

_held: tuple[int, Environment] | None = None
_factory: tuple[str, Callable[..., Environment]] | None = None  # (name, what it names), found by `load`


def load(name: str) -> None:
    """In the zygote: what every worker will need, found once for all of them: the environment's
    factory (its module's top level runs here, once per rank: a file named `file.py:Class`
    would run again at each construction otherwise), and PIL's plugins of the common image
    formats (an environment that opens an image would import them in each worker)."""
    global _factory
    _factory = (name, resolve_environment(name))
    Image.preinit()


def construct(name: str, args: dict, key: int) -> str:
    """Build and hold an environment; its observation_role (how the template wraps observations).
    The environment of the worker's trajectory before is dropped first if its release has not
    come yet: a worker holds one environment at a time."""
    global _held
    _held = None
    factory = _factory[1] if _factory is not None and _factory[0] == name else resolve_environment(name)
    environment = factory(**args)
    _held = (key, environment)
    return getattr(environment, "observation_role", "tool")


def _environment(key: int) -> Environment:
    if _held is None or _held[0] != key:  # never, unless the host lost track of its workers
        raise LookupError("its environment is not in its worker process")
    return _held[1]


def reset(key: int, sample: dict) -> None:
    _environment(key).reset(sample)


def step(key: int, action: str) -> Any:
    return _environment(key).step(action)


def release(key: int) -> None:
    global _held
    if _held is not None and _held[0] == key:
        _held = None
