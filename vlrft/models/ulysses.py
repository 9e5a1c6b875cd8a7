"""Ulysses' exchange inside the attention functions vlrft registers with transformers
(sdpa_segments, torch_varlen): while a sharded decoder runs (models/sequence_parallel.py), a
packed call trades each rank's 1/N of the tokens of every head for every token of H/N heads
before attention, and back after it."""

from __future__ import annotations

import contextlib
import contextvars
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


# Set while a sharded decoder runs: the attention functions exchange heads for tokens then.
_ACTIVE: contextvars.ContextVar[SequenceShard | None] = contextvars.ContextVar("vlrft_sequence_shard", default=None)


@contextlib.contextmanager
def exchanging_heads(shard: SequenceShard):
    active = _ACTIVE.set(shard)
    try:
        yield
    finally:
        _ACTIVE.reset(active)


def ulysses(attention):
    """A transformers attention function that, inside a sharded decoder and for a packed call
    (segment starts given), runs `attention` on every token of H/N heads: query, key and value
    [1, H, T/N, D] -> [1, H/N, T, D], output [1, T, H/N, D] -> [1, T/N, H, D]. The key/value heads
    split as the query heads do, so each rank keeps the model's heads-per-key-head ratio."""

    @functools.wraps(attention)
    def exchanged(module, query, key, value, attention_mask, *args, **kwargs):
        shard = _ACTIVE.get()
        if shard is None or kwargs.get("cu_seq_lens_q") is None:
            return attention(module, query, key, value, attention_mask, *args, **kwargs)
        query, key, value = (all_to_all(t.contiguous(), 1, 2, shard.group) for t in (query, key, value))  # heads out, tokens in
        out, weights = attention(module, query, key, value, attention_mask, *args, **kwargs)
        return all_to_all(out.contiguous(), 1, 2, shard.group), weights  # tokens out, heads in

    return exchanged
