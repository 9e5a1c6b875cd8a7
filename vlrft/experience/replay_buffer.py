"""ReplayBuffer: holds one step's experience and packs it into token-budget micro-batches.

A sample's pixel inputs travel with it, concatenated in sample order.
"""

from __future__ import annotations

import torch

from vlrft.models.packing import micro_batches, prompt_groups
from vlrft.types import Experience, MicroBatch


class ReplayBuffer:
    def __init__(self, micro_batch_tokens: int, seed: int, share_prompts: bool = False):
        self.micro_batch_tokens = micro_batch_tokens
        self.share_prompts = share_prompts
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
        shuffle, then consecutive near-equal runs of samples. With shared prompts the shuffle
        moves whole groups (a group's responses stay side by side, so a mini-batch holds few
        prompts). A mini-batch left without samples on this rank (fewer samples than `count`)
        runs dummies, so the rank joins every step."""
        groups = prompt_groups(self.items, self.share_prompts)
        order = torch.randperm(len(groups), generator=self.generator).tolist() if shuffle else range(len(groups))
        samples = [self.items[i] for g in order for i in groups[g]]
        bounds = [round(k * len(samples) / count) for k in range(count + 1)]
        placeholder = self.items[0] if self.items else None
        return [micro_batches(samples[start:end], self.micro_batch_tokens, placeholder, self.share_prompts)
                for start, end in zip(bounds, bounds[1:])]
