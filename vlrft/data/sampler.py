"""Rank-aware, resumable prompt sampler.

Every epoch is a seeded permutation of the dataset shared by all ranks; step s takes the
global slice [s*P, (s+1)*P) of the (epoch-concatenated) stream and each rank keeps its own
contiguous part, so the stream position is one integer (consumed prompts) and resuming is exact.
"""

from __future__ import annotations

import torch


class PromptSampler:
    def __init__(self, n_rows: int, global_prompts: int, rank: int, world_size: int, seed: int):
        self.n_rows = n_rows
        self.global_prompts = global_prompts
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.consumed = 0  # global prompts consumed so far
        self._perm_epoch, self._perm = -1, None

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, self.n_rows)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm_epoch, self._perm = epoch, torch.randperm(self.n_rows, generator=g).tolist()
        return self._perm[offset]

    def next_indices(self) -> list[tuple[int, int]]:
        """(stream position, row index) pairs for this rank's share of the next step.

        The stream position is unique over the whole run, so it serves as the group id of the
        prompt's responses even when a row is drawn twice.
        """
        per_rank = self.global_prompts // self.world_size
        start = self.consumed + self.rank * per_rank
        self.consumed += self.global_prompts
        return [(p, self._index(p)) for p in range(start, start + per_rank)]
