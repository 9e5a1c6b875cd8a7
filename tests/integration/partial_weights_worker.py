"""Run by test_async_training under torchrun (3 ranks): trainer rank 0 sends weights versions
1-3 to rollout ranks 1 and 2, as `train.partial_rollouts` does, while the rollout ranks run
collectives of their own in between. Argument: "own" (each rollout rank is a delivery of its
own, partial rollouts' routes) or "shared" (one broadcast to both; the first scenario then
deadlocks, and the test's timeout says so).

- Version 1: rank 1 takes it at once (a mid-batch take), then joins an all-reduce of the rollout
  ranks that rank 2 entered first; rank 2 takes the version after that all-reduce.
- Version 2: a version without tensors (a frozen actor's), to rank 1, then rank 2.
- Version 3: rank 2 is ready first; rank 1 says ready only after rank 2 received it.
Prints what each rank received and, on rank 0, the order of its deliveries and its passes."""

import sys
from types import SimpleNamespace

import torch

from vlrft.distributed import all_reduce_sum, exit_process, global_rank, init_distributed
from vlrft.trainer.version_board import VersionBoard
from vlrft.engines.weight_digest import DigestCheck
from vlrft.trainer.weights_delivery import RolloutRanks, take_async_role, take_version


class RecordingEngine:  # test double: what an engine's update_weights was handed
    def __init__(self):
        self.received = []

    def update_weights(self, named_tensors):
        self.received.append({name: tensor.tolist() for name, tensor in named_tensors})


def weights_of(version: int) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.full((3,), float(version))), ("b", torch.tensor([-float(version)]))]


def trainer(routes) -> None:
    first_passes, resends, deliveries = [], [], []

    def first_pass(version):  # its iteration is where the EMAs move: it must run once per version
        first_passes.append(version)
        yield from weights_of(version)

    current = {"version": 0}
    engine = RolloutRanks(routes, 0, True, lambda version: None,
                          lambda: resends.append(current["version"]) or iter(weights_of(current["version"])))
    send = engine.board.send
    engine.board.send = lambda version, delivery: deliveries.append((version, routes.deliveries[delivery])) or send(version, delivery)
    for version in (1, 2, 3):
        current["version"] = version
        engine.update_weights(first_pass(version) if version != 2 else iter(()))
    print(f"first passes {first_passes}; resends {resends}; deliveries {deliveries}", flush=True)


def rollout(routes, me: int) -> None:
    engine = RecordingEngine()  # (no digests: DigestCheck passes the weights through unchecked)
    holder = SimpleNamespace(weights=routes, engine=engine, guards=SimpleNamespace(digests=DigestCheck(engine, "recording")))
    board = VersionBoard()
    take = lambda version: take_version(holder, board, version, lambda: None)  # noqa: E731
    # Version 1.
    if me == 1:
        take(1)
    all_reduce_sum(torch.ones(1))
    if me == 2:
        take(1)
    # Version 2.
    if me == 1:
        take(2)
    all_reduce_sum(torch.ones(1))
    if me == 2:
        take(2)
    # Version 3.
    if me == 2:
        take(3)
    all_reduce_sum(torch.ones(1))
    if me == 1:
        take(3)
    print(f"rank {me} received {holder.engine.received}", flush=True)


def main() -> None:
    init_distributed()
    role, routes = take_async_role(2, each_rank_on_its_own=sys.argv[1] == "own")
    if role == "trainer":
        trainer(routes)
    else:
        rollout(routes, global_rank())
    exit_process(0)


if __name__ == "__main__":
    main()
