"""Where the async roles meet without a collective: the job's key-value store (weights versions
announced and taken, batches received, evaluations, a stop)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from vlrft.distributed import PROCESS_GROUP_TIMEOUT, watch_store


class VersionBoard:
    """The newest weights version trainer rank 0 has announced, on the job's key-value store: a
    rollout rank reads it without joining a collective (between two decoding steps, or before it
    waits for a broadcast), says it is ready for it, and takes the broadcast once trainer rank 0
    has seen every rollout rank of its delivery ready and begun sending to that delivery. Until
    then trainer rank 0 waits on the store, not inside the broadcast, so that a signal can still
    stop the trainers at once. Also where the trainers post the step they stopped after, so that
    no rollout rank waits for a broadcast that will not come."""

    KEY = "vlrft/async/weights_version"
    STOP_KEY = "vlrft/async/stopped_after"
    RECEIVED_KEY = "vlrft/async/received_from/"  # + a rollout rank's global rank: its batches received
    EVALUATION_KEY = "vlrft/async/evaluation/"  # + a weights version: its held-out metrics
    READY_KEY = "vlrft/async/ready_for/"  # + a weights version / a rollout rank's global rank: it waits to take it
    SENDING_KEY = "vlrft/async/sending_to/"  # + a delivery: the newest version trainer rank 0 began to send it
    POLL_S = 0.05  # how often a wait for an evaluation looks again

    def __init__(self):
        self.store = watch_store(PROCESS_GROUP_TIMEOUT.total_seconds())

    def announce(self) -> int:
        """One more version is about to be broadcast; returns its number."""
        return self.store.add(self.KEY, 1)

    def newest(self) -> int:
        return self.store.add(self.KEY, 0)

    def advance_to(self, version: int) -> None:
        """Count `version` as announced already (a resumed run starts from its checkpoint's)."""
        self.store.add(self.KEY, version - self.newest())

    def ready(self, version: int, rollout_rank: int) -> None:
        """Rollout rank `rollout_rank` (global) waits to take `version`: it takes the broadcast
        once trainer rank 0 is sending it to its delivery."""
        self.store.add(f"{self.READY_KEY}{version}/{rollout_rank}", 1)

    def is_ready(self, version: int, rollout_rank: int) -> bool:
        return self.store.add(f"{self.READY_KEY}{version}/{rollout_rank}", 0) > 0

    def send(self, version: int, delivery: int) -> None:
        """Trainer rank 0 begins to send `version` to delivery `delivery` (its rollout ranks are ready)."""
        self.store.add(f"{self.SENDING_KEY}{delivery}", version - self.sending(delivery))

    def sending(self, delivery: int) -> int:
        return self.store.add(f"{self.SENDING_KEY}{delivery}", 0)

    def stop(self, step: int) -> None:
        self.store.add(self.STOP_KEY, step)

    def stopped_after(self) -> int:
        """The step the trainers stopped after; 0 while they go on."""
        return self.store.add(self.STOP_KEY, 0)

    def post_evaluation(self, version: int, metrics: dict[str, float]) -> None:
        """The evaluation of weights `version` (rollout rank 0), for trainer rank 0 to log."""
        self.store.set(f"{self.EVALUATION_KEY}{version}", json.dumps(metrics))

    def has_evaluation(self, version: int) -> bool:
        return self.store.check([f"{self.EVALUATION_KEY}{version}"])

    def evaluation(self, version: int, while_waiting: Callable[[], None]) -> dict[str, float]:
        """The evaluation of weights `version`: looks until it is posted, calling `while_waiting`
        between two looks. Not one blocking get: a signal's Python handler runs only once the
        store's call returns, so a rank stopped by torchrun after the evaluating rank died would
        only learn of it at the store's timeout."""
        deadline = time.monotonic() + PROCESS_GROUP_TIMEOUT.total_seconds()  # (as long as one get would wait)
        while not self.has_evaluation(version):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no evaluation of weights version {version} came within {PROCESS_GROUP_TIMEOUT}")
            while_waiting()
            time.sleep(self.POLL_S)
        return json.loads(self.store.get(f"{self.EVALUATION_KEY}{version}"))

    def acknowledge(self, source: int) -> None:
        """A trainer received one more batch from rollout rank `source` (a global rank)."""
        self.store.add(self.RECEIVED_KEY + str(source), 1)

    def received(self, source: int) -> int:
        """Batches of rollout rank `source` received so far (gloo's sends cannot be polled)."""
        return self.store.add(self.RECEIVED_KEY + str(source), 0)
