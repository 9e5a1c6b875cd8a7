"""A multi-turn rollout in flight (`multi_turn_steps` driven a turn at a time): its environment
calls run in the environment host's threads while whoever holds it does other work. An
asynchronous rollout rank with partial rollouts holds several (docs/async.md): its batch, and
the next ones, whose turns it decodes while its batch waits on its environments."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait
from typing import Callable, Generator

from vlrft.multiturn.host import EnvironmentHost, results
from vlrft.types import Rollout

POLL_S = 0.01  # how long a rollout waiting on its calls waits before it asks for other work again


class InFlight:
    def __init__(self, steps: Generator[list, list, list[Rollout]], host: EnvironmentHost):
        self.steps, self.host = steps, host
        self.rollouts: list[Rollout] | None = None  # its trajectories, once it has ended
        self.pending = host.submit(next(steps))  # its environment calls running now

    @property
    def finished(self) -> bool:
        return self.rollouts is not None

    def ready(self) -> bool:
        """Whether it can go on: every environment call it waits on has answered."""
        return not self.finished and all(call.done() for call in self.pending)

    def advance(self) -> None:
        """Hand it its calls' answers and run it to its next calls (one turn's decoding) or to its end."""
        try:
            self.pending = self.host.submit(self.steps.send(results(self.pending)))
        except StopIteration as end:
            self.rollouts, self.pending = end.value, []

    def finish(self, meanwhile: Callable[[], bool] | None = None) -> list[Rollout]:
        """Run it to its end: its trajectories. While its calls run, `meanwhile()` does other
        work and says whether it did any (False: nothing to do now, so this waits a little); it
        is asked once before the first wait too, so that work it can start (a rollout rank's
        next batch) starts with this one."""
        if meanwhile is not None:
            meanwhile()
        while not self.finished:
            while not self.ready():
                if meanwhile is None:
                    wait(self.pending)
                elif not meanwhile():
                    running = [call for call in self.pending if not call.done()]
                    wait(running, timeout=POLL_S, return_when=FIRST_COMPLETED)
            self.advance()
        return self.rollouts
