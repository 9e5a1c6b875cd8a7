"""Run by test_async_training under torchrun (2 ranks): rank 0 broadcasts weights versions 1 and
3 to rank 1, which expects 1 and then 2. Prints what rank 1 received and the error."""

import torch

from vlrft.distributed import (
    WeightsError,
    broadcast_weights,
    exit_process,
    init_distributed,
    new_groups,
    receive_weights,
    received_weights,
)


class RecordingEngine:  # test double: what an engine's update_weights was handed
    def __init__(self):
        self.received = {}

    def update_weights(self, named_tensors):
        self.received.update(named_tensors)


def main() -> None:
    me, _ = init_distributed()
    (group,) = new_groups([[0, 1]])
    weights = {"a.weight": torch.arange(6, dtype=torch.float32).view(2, 3), "b.bias": torch.tensor([0.5, -1.5], dtype=torch.bfloat16)}
    if me == 0:
        broadcast_weights(group, 0, 1, iter(weights.items()))
        broadcast_weights(group, 0, 3, iter([]))
    else:
        engine = RecordingEngine()
        assert receive_weights(group, 0, 1, engine.update_weights) == 1
        for name, tensor in weights.items():
            assert torch.equal(engine.received[name], tensor) and engine.received[name].dtype == tensor.dtype, name
        print("received version 1:", sorted(engine.received))
        try:
            receive_weights(group, 0, 2, engine.update_weights)
        except WeightsError as err:
            print(f"error: {err}")
            list(received_weights(group, 0))  # the rest of the broadcast: its end mark
    exit_process(0)


if __name__ == "__main__":
    main()
