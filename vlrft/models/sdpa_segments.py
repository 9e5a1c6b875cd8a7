"""`model.attention: sdpa_segments`: a packed micro-batch without a [T, T] mask, on any device
and in any dtype. Each segment's slice of the packed queries, keys and values goes through causal
SDPA on its own (segments of equal shape batched into one call), so attention costs Σ L_i²
instead of T² and nothing across samples is computed: a larger `train.micro_batch_tokens` no
longer makes attention slower per token. A response after a shared prompt attends to the
prompt's keys, then its own (models/shared_keys.py): R × (P + R).
`auto` picks it on the CPU, where no varlen FlashAttention kernel runs.

Registered with transformers under `SDPA_SEGMENTS`, like torch_varlen.py: transformers builds no
mask for it and forwards the packed batch's sample starts (`cu_seq_lens_q`). Calls without
them (the Qwen-VL vision tower's windows, right-padded batches) go to plain sdpa, exact there.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vlrft.models.shared_keys import end_aligned_causal_mask, gather_shared_keys
from vlrft.models.ulysses import ulysses

SDPA_SEGMENTS = "vlrft_sdpa_segments"


# Eager inside a compiled layer (models/compiled_layers.py): its Python walk over the segments
# would otherwise make every new set of segment lengths a new graph.
@torch.compiler.disable
def sdpa_segments_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, cu_seq_lens_q=None, cu_seq_lens_k=None, shared_key_index=None, **kwargs):
    """transformers' attention signature: query [1, H, T, D], key/value [1, Hkv, T, D] ->
    ([1, T, H, D], None)."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if sliding_window:
        raise ValueError(f"model.attention sdpa_segments does not support sliding windows "
                         f"({type(module).__name__}: sliding_window {sliding_window})")
    key, value = gather_shared_keys(key, value, shared_key_index)
    lengths = run_lengths(cu_seq_lens_q)
    key_lengths = lengths if shared_key_index is None else run_lengths(cu_seq_lens_k)
    by_shape: dict[tuple[int, int], list[int]] = {}  # segments of one shape share one batched sdpa call
    for i, shape in enumerate(zip(lengths, key_lengths)):
        by_shape.setdefault(shape, []).append(i)
    # One split per tensor, not a slice per segment: each slice's backward would zero-fill a
    # gradient as large as the whole micro-batch.
    split_q = query.split(lengths, dim=2)
    split_k, split_v = (t.split(key_lengths, dim=2) for t in (key, value))
    parts: list = [None] * len(lengths)
    for (length, key_length), members in by_shape.items():
        q, k, v = (torch.cat([split[i] for i in members]) for split in (split_q, split_k, split_v))  # [n, H(kv), L, D]
        mask = end_aligned_causal_mask(length, key_length, query.device)  # None: causal from the module
        out = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling)[0]  # [n, L, H, D]
        for i, row in zip(members, out.split(1)):
            parts[i] = row
    return torch.cat(parts, dim=1), None


def run_lengths(starts: torch.Tensor) -> list[int]:
    starts = starts.tolist()
    return [b - a for a, b in zip(starts, starts[1:])]


AttentionInterface.register(SDPA_SEGMENTS, ulysses(sdpa_segments_attention))
