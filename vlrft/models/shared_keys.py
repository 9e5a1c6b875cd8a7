"""The keys of a shared-prompt micro-batch (models/packing.pack with `share`): a response
segment attends to its prompt's tokens and then its own, so the varlen kernels get, besides the
segment starts of the queries, the rows of each segment's keys (`SHARED_KEYS`, built by
attention.varlen_kwargs) and the starts of those runs (`cu_seq_lens_k`). Causality is aligned
at the end of each run: query i of a response segment of length R after a prompt of length P
sees keys 0 .. P + i, exactly what it sees after its own copy of the prompt.

sdpa_segments and torch_varlen gather the keys themselves; transformers' own flash_attention_2
is wrapped here to do the same (registered under its name at import)."""

from __future__ import annotations

import torch
from transformers import AttentionInterface

SHARED_KEYS = "shared_key_index"  # the kwarg transformers forwards to the attention function


def gather_shared_keys(key: torch.Tensor, value: torch.Tensor, index: torch.Tensor | None):
    """Key and value rows [1, Hkv, T, D] laid out run by run ([1, Hkv, K, D]), or as they are
    without shared prompts (`index` None)."""
    if index is None:
        return key, value
    index = index.to(key.device)
    return key[:, :, index], value[:, :, index]


def end_aligned_causal_mask(queries: int, keys: int, device) -> torch.Tensor | None:
    """[1, 1, q, k] True where query i may see key j (j <= keys - queries + i), or None when the
    run has no prompt before it (plain causal attention)."""
    if queries == keys:
        return None
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)[None, None]


_FLASH_ATTENTION_2 = AttentionInterface._global_mapping.get("flash_attention_2")


def flash_attention_2_sharing(module, query, key, value, attention_mask, shared_key_index=None, **kwargs):
    """transformers' flash_attention_2, with a shared-prompt micro-batch's keys gathered run by
    run first: flash-attn's varlen kernel takes query and key runs of unequal lengths
    (`cu_seq_lens_k`) and aligns its causal window at each run's end (flash-attn >= 2.1)."""
    key, value = gather_shared_keys(key, value, shared_key_index)
    return _FLASH_ATTENTION_2(module, query, key, value, attention_mask, **kwargs)


if _FLASH_ATTENTION_2 is not None:
    AttentionInterface.register("flash_attention_2", flash_attention_2_sharing)
