"""Weights from trainer rank 0 to the rollout ranks of an asynchronous run (docs/async.md): the
split into roles, the routes the weights travel (one broadcast, or a group per rollout rank
with partial rollouts), the trainers' sending side (RolloutRanks) and a rollout rank's taking
side (take_version), which meet on the job's store (VersionBoard)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from vlrft import progress, rank_watch
from vlrft.distributed import (
    EMA_HEADER,
    broadcast_weights,
    global_rank,
    global_world_size,
    new_groups,
    receive_weights,
    take_role,
)
from vlrft.trainer.version_board import VersionBoard

WEIGHTS_SOURCE = 0  # the global rank that broadcasts new weights: trainer rank 0
POLL_S = 0.01  # how often a waiting rollout rank looks at the job's store


def role_ranks(rollout_ranks: int, world: int) -> tuple[list[int], list[int]]:
    """(rollout ranks, trainer ranks) as global ranks: the trainers first, from global rank 0."""
    trainers = world - rollout_ranks
    return list(range(trainers, world)), list(range(trainers))


@dataclass
class WeightsRoutes:
    """How trainer rank 0 sends weights to the rollout ranks: one delivery (a process group of
    trainer rank 0 and the rollout ranks it reaches) at a time. Without partial rollouts one
    delivery reaches them all (a broadcast); with them each rollout rank is a delivery of its
    own, so that it can take a version whenever it looks, whatever its peers are doing."""

    groups: list  # a process group per delivery
    deliveries: list[list[int]]  # each delivery's rollout ranks (global ranks)
    mine: int | None  # a rollout rank: the delivery that reaches it

    @property
    def group(self):
        """A rollout rank's group, where its weights arrive."""
        return self.groups[self.mine]


def take_async_role(rollout_ranks: int, each_rank_on_its_own: bool) -> tuple[str, WeightsRoutes]:
    """Split the world into rollout and trainer ranks (collective: every rank, once). Returns
    (role, the routes of the weights from trainer rank 0, global rank 0)."""
    rollouts, trainers = role_ranks(rollout_ranks, global_world_size())
    me = global_rank()
    role = "rollout" if me in rollouts else "trainer"
    rank_watch.name_roles({r: "rollout" for r in rollouts} | {t: "trainer" for t in trainers})
    take_role(rollouts if role == "rollout" else trainers, [rollouts, trainers])
    deliveries = [[r] for r in rollouts] if each_rank_on_its_own else [rollouts]
    groups = new_groups([[trainers[0], *delivery] for delivery in deliveries])
    mine = next((i for i, delivery in enumerate(deliveries) if me in delivery), None)
    return role, WeightsRoutes(groups, deliveries, mine)


class RolloutRanks:
    """The trainer ranks' engine: `update_weights` sends the new weights to the rollout ranks,
    one delivery after another (WeightsRoutes), each followed, for a version the rollout ranks
    evaluate, by what they evaluate instead of it (`evaluated(version)`: the policy EMA, or
    None). Trainer rank 0 sends; the other trainer ranks take part in ZeRO-3's gathers and
    discard. The first delivery gets `named_tensors` (whose iteration also moves the reference
    and policy EMAs), each further one `resend()`: the same weights, read again (under ZeRO-3,
    gathered again). A version without tensors (a frozen actor's) stays one for every delivery.
    Generation happens elsewhere, so sleep and wake have nothing to do.

    Trainer rank 0 announces a version and serves each delivery once all its rollout ranks are
    ready to take it, in the order they become ready (on the store): with S >= 1 that may be
    after they generate another batch. If `stopping()` turns true meanwhile (a signal: the
    trainers stop after this step), it sends no more and `skipped` is set; the checkpoint the
    trainers save next holds these weights."""

    def __init__(self, routes: WeightsRoutes, source: int, sends: bool, evaluated: Callable[[int], Iterable | None],
                 resend: Callable[[], Iterable]):
        self.routes, self.source, self.sends, self.evaluated, self.resend = routes, source, sends, evaluated, resend
        self.board = VersionBoard() if sends else None
        self.version = 0
        self.stopping: Callable[[], bool] = lambda: False  # set by run_trainer for the steps a signal may end
        self.while_waiting: Callable[[], None] = lambda: None  # set by run_trainer: doubt the peers once signalled
        self.skipped = False

    def resume_at(self, step: int) -> None:
        """A resumed run: the next update_weights sends the checkpoint's policy as version `step`."""
        self.version = step - 1
        if self.sends:
            self.board.advance_to(self.version)

    def update_weights(self, named_tensors) -> None:
        self.version += 1
        if self.sends:
            announced = self.board.announce()
            assert announced == self.version, (announced, self.version)
        has_tensors = False

        def first():
            nonlocal has_tensors
            for item in named_tensors:
                has_tensors = True
                yield item

        waiting = list(range(len(self.routes.deliveries)))
        for number in range(len(waiting)):  # every trainer rank: one pass over the weights per delivery
            weights = first() if number == 0 else self.resend() if has_tensors else iter(())
            delivery = self._next_ready(waiting) if self.sends and not self.skipped else None
            if delivery is None:
                for _ in weights:  # (ZeRO-3's gathers, and the EMAs that move with the first pass)
                    pass
                continue
            waiting.remove(delivery)
            group = self.routes.groups[delivery]
            self.board.send(self.version, delivery)
            broadcast_weights(group, self.source, self.version, weights)
            ema = self.evaluated(self.version)  # (complete now: the EMA moved with the first pass)
            if ema is not None:
                broadcast_weights(group, self.source, self.version, ema, header=EMA_HEADER)

    def _next_ready(self, waiting: list[int]) -> int | None:
        """A delivery of `waiting` whose rollout ranks are all ready for this version (waits on
        the store); None, and `skipped` set, if the trainers stop meanwhile."""
        while True:
            for delivery in waiting:
                if all(self.board.is_ready(self.version, r) for r in self.routes.deliveries[delivery]):
                    return delivery
            if self.stopping():
                self.skipped = True
                return None
            self.while_waiting()  # (after the last step no signal stops this wait: a dead rollout rank must be found)
            time.sleep(POLL_S)

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass


def take_version(trainer, board: VersionBoard, version: int, stop_if_the_trainers_stopped: Callable[[], None]) -> int:
    """A rollout rank takes weights `version`: it waits until trainer rank 0 has announced it,
    says it is ready, waits until trainer rank 0 begins the broadcast, and loads it into its
    engine. Each wait is on the store, where it also looks for the trainers' stop."""

    def wait_until(done: Callable[[], bool]) -> None:
        while not done():
            stop_if_the_trainers_stopped()
            time.sleep(POLL_S)

    with progress.during(f"taking weights version {version} from trainer rank 0"):
        wait_until(lambda: board.newest() >= version)
        board.ready(version, global_rank())
        wait_until(lambda: board.sending(trainer.weights.mine) >= version)
        return receive_weights(trainer.weights.group, WEIGHTS_SOURCE, version,
                               lambda named: trainer.guards.digests.update(named, f"at weights version {version}"))
