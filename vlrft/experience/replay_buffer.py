"""ReplayBuffer: holds one step's experience and packs it into token-budget micro-batches.

A sample's pixel inputs travel with it, concatenated in sample order.
"""

from __future__ import annotations

import torch

from vlrft.experience.packing import pack, split_by_token_budget
from vlrft.types import Experience, MicroBatch


def pad_micro_batch_count(batches: list[MicroBatch], count: int) -> list[MicroBatch]:
    """Append dummy repeats up to `count`, so every rank runs the same number of forwards.

    ZeRO-3 gathers parameters inside each forward and ZeRO-2 reduces gradients inside each
    backward: a rank with fewer micro-batches than its peers would hang the collective.
    """
    if not batches:
        raise ValueError("cannot pad an empty list of micro-batches")
    extra = [pack(batches[-1].samples, dummy=True) for _ in range(count - len(batches))]
    return batches + extra


class ReplayBuffer:
    def __init__(self, micro_batch_tokens: int, seed: int):
        self.micro_batch_tokens = micro_batch_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.items: list[Experience] = []

    def add(self, experiences: list[Experience]) -> None:
        self.items.extend(experiences)

    def clear(self) -> None:
        self.items = []

    def __len__(self) -> int:
        return len(self.items)

    def micro_batches(self, shuffle: bool) -> list[MicroBatch]:
        return self.mini_batches(1, shuffle)[0]

    def mini_batches(self, count: int, shuffle: bool) -> list[list[MicroBatch]]:
        """The buffer in `count` mini-batches (one optimizer step each), each as packed
        micro-batches: one shuffle, then consecutive near-equal runs of samples. A mini-batch
        left without samples (fewer samples than `count` on this rank) is one dummy
        micro-batch, so this rank still joins every step's collectives."""
        order = torch.randperm(len(self.items), generator=self.generator).tolist() if shuffle else range(len(self))
        samples = [self.items[i] for i in order]
        bounds = [round(k * len(samples) / count) for k in range(count + 1)]
        out = []
        for start, end in zip(bounds, bounds[1:]):
            groups = split_by_token_budget(samples[start:end], self.micro_batch_tokens)
            out.append([pack(g) for g in groups] or [pack(self.items[:1], dummy=True)])
        return out
