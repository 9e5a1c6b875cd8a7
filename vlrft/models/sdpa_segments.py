"""`model.attention: sdpa_segments`: a packed micro-batch without a [T, T] mask, on any device
and in any dtype. Each sample's slice of the packed queries, keys and values goes through causal
SDPA on its own (samples of equal length batched into one call), so attention costs Σ L_i²
instead of T² and nothing across samples is computed: a larger `train.micro_batch_tokens` no
longer makes attention slower per token.
`auto` picks it on the CPU, where no varlen FlashAttention kernel runs.

Registered with transformers under `SDPA_SEGMENTS`, like torch_varlen.py: transformers builds no
mask for it and forwards the packed batch's sample starts (`cu_seq_lens_q`). Calls without
them (the Qwen-VL vision tower's windows, right-padded batches) go to plain sdpa, exact there.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

SDPA_SEGMENTS = "vlrft_sdpa_segments"


def sdpa_segments_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, cu_seq_lens_q=None, **kwargs):
    """transformers' attention signature: query [1, H, T, D], key/value [1, Hkv, T, D] ->
    ([1, T, H, D], None)."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if sliding_window:
        raise ValueError(f"model.attention sdpa_segments does not support sliding windows "
                         f"({type(module).__name__}: sliding_window {sliding_window})")
    starts = cu_seq_lens_q.tolist()
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    by_length: dict[int, list[int]] = {}  # samples of one length share one batched sdpa call
    for i, length in enumerate(lengths):
        by_length.setdefault(length, []).append(i)
    # One split per tensor, not a slice per sample: each slice's backward would zero-fill a
    # gradient as large as the whole micro-batch.
    split_q, split_k, split_v = (t.split(lengths, dim=2) for t in (query, key, value))
    parts: list = [None] * len(lengths)
    for members in by_length.values():
        q, k, v = (torch.cat([split[i] for i in members]) for split in (split_q, split_k, split_v))  # [n, H(kv), L, D]
        out = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling)[0]  # [n, L, H, D], causal
        for i, row in zip(members, out.split(1)):
            parts[i] = row
    return torch.cat(parts, dim=1), None


AttentionInterface.register(SDPA_SEGMENTS, sdpa_segments_attention)
