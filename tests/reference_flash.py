"""A test double of the flash-attn package: the same entry points and signatures, computed by
per-sample scaled-dot-product attention in plain torch, so transformers' real flash-attention
integration (and vlrft's varlen inputs to it) runs on a CPU. Installed by the
`reference_flash` fixture for one test; the shipped path imports the real package."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F


class ReferenceFlash:
    def __init__(self):
        self.calls: list[tuple[str, list[int] | None, torch.dtype]] = []  # (kind, sample starts, q dtype)

    @staticmethod
    def _attend(q, k, v, causal, scale):  # q [Lq, H, D], k and v [Lk, Hkv, D]
        # flash-attn >= 2.1 aligns the causal window at the end: query i sees keys up to Lk - Lq + i.
        allowed = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril(k.shape[0] - q.shape[0])
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed if causal else None, scale=scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        starts, key_starts = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert max_seqlen_q == max(b - a for a, b in zip(starts, starts[1:])) and starts[-1] == q.shape[0]
        assert max_seqlen_k == max(b - a for a, b in zip(key_starts, key_starts[1:])) and key_starts[-1] == k.shape[0]
        self.calls.append(("varlen", starts, q.dtype))
        return torch.cat([self._attend(q[a:b], k[c:d], v[c:d], causal, softmax_scale)
                          for (a, b), (c, d) in zip(zip(starts, starts[1:]), zip(key_starts, key_starts[1:]))])

    def flash_attn_func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        self.calls.append(("dense", None, q.dtype))
        return torch.stack([self._attend(qi, ki, vi, causal, softmax_scale) for qi, ki, vi in zip(q, k, v)])

    def kernels_seen(self, kind: str) -> list[list[int] | None]:
        return [starts for k, starts, _ in self.calls if k == kind]


@pytest.fixture
def reference_flash(monkeypatch):
    from transformers import PreTrainedModel
    import transformers.modeling_flash_attention_utils as flash_utils

    flash = ReferenceFlash()
    package = types.ModuleType("flash_attn")
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    package.flash_attn_func = flash.flash_attn_func
    package.flash_attn_varlen_func = flash.flash_attn_varlen_func
    package.flash_attn_with_kvcache = None
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input, padding.unpad_input = flash_utils._pad_input, flash_utils._unpad_input
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.bert_padding", padding)
    monkeypatch.setattr(flash_utils, "is_flash_attn_2_available", lambda: True)
    # transformers loads the kernels once per implementation name and keeps them: start afresh.
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    # The load-time check refuses a CPU and a package without metadata.
    monkeypatch.setattr(PreTrainedModel, "_flash_attn_can_dispatch", lambda self, *args, **kwargs: True)
    return flash
