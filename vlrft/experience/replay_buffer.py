"""ReplayBuffer: holds one step's experience and packs it into token-budget micro-batches.

A sample's pixel inputs travel with it, concatenated in sample order.
"""

from __future__ import annotations

import torch

from vlrft.models.packing import micro_batches
from vlrft.types import Experience, MicroBatch


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
        micro-batches, as many on every rank (a collective, models/packing.micro_batches): one
        shuffle, then consecutive near-equal runs of samples. A mini-batch left without samples
        on this rank (fewer samples than `count`) runs dummies, so the rank joins every step."""
        order = torch.randperm(len(self.items), generator=self.generator).tolist() if shuffle else range(len(self))
        samples = [self.items[i] for i in order]
        bounds = [round(k * len(samples) / count) for k in range(count + 1)]
        placeholder = self.items[0] if self.items else None
        return [micro_batches(samples[start:end], self.micro_batch_tokens, placeholder)
                for start, end in zip(bounds, bounds[1:])]
