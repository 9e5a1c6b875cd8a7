"""Ulysses' exchange inside the attention functions vlrft registers with transformers
(sdpa_segments, torch_varlen): a packed call of a sharded decoder (models/sequence_parallel.py)
trades each rank's 1/N of the tokens of every head for every token of H/N heads before
attention, and back after it.

The shard travels as a keyword argument of the decoder's forward, which transformers hands
down to every attention call, and which gradient checkpointing keeps for the recompute in the
backward (a flag set around the forward would be gone by then)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from vlrft.distributed import all_to_all


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place among the `size` ranks of `group` that share each micro-batch."""

    group: object  # a torch.distributed process group
    index: int
    size: int

    def bounds(self, padded_length: int) -> tuple[int, int]:
        per = padded_length // self.size
        return self.index * per, (self.index + 1) * per


def ulysses(attention):
    """A transformers attention function that, inside a sharded decoder and for a packed call
    (segment starts given), runs `attention` on every token of H/N heads: query, key and value
    [1, H, T/N, D] -> [1, H/N, T, D], output [1, T, H/N, D] -> [1, T/N, H, D]. The key/value heads
    split as the query heads do, so each rank keeps the model's heads-per-key-head ratio."""

    @functools.wraps(attention)
    def exchanged(module, query, key, value, attention_mask, *args, sequence_shard: SequenceShard | None = None, **kwargs):
        if sequence_shard is None or kwargs.get("cu_seq_lens_q") is None:
            return attention(module, query, key, value, attention_mask, *args, **kwargs)
        query, key, value = (all_to_all(t.contiguous(), 1, 2, sequence_shard.group) for t in (query, key, value))  # heads out, tokens in
        out, weights = attention(module, query, key, value, attention_mask, *args, **kwargs)
        return all_to_all(out.contiguous(), 1, 2, sequence_shard.group), weights  # tokens out, heads in

    return exchanged
