"""`model.attention: torch_varlen`: PyTorch's own varlen FlashAttention kernel
(`torch.nn.attention.varlen.varlen_attn`, torch >= 2.11) behind transformers' attention
interface, so a packed micro-batch runs mask-free on a GPU without the flash-attn package.

Registered with transformers under `TORCH_VARLEN` (a name without "flash", so transformers
treats it as a custom kernel: it builds no mask for it and sends the Qwen-VL vision tower's
windows one at a time). Calls that carry sample starts (vlrft's packed decoder forward) go to
the varlen kernel; the rest (vision windows, right-padded batches) go to sdpa with causality
from the module, which is exact for them: a vision window attends within itself, and a
right-padded row's real tokens never see the padding after them.
"""

from __future__ import annotations

import inspect

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vlrft.models.shared_keys import gather_shared_keys
from vlrft.models.ulysses import ulysses

TORCH_VARLEN = "vlrft_torch_varlen"

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None
# Releases whose kernel has no enable_gqa (2.11 among them) need as many key/value heads as
# query heads; later ones share them.
NATIVE_GQA = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters


def torch_varlen_missing() -> str:
    """Why PyTorch's varlen kernel cannot run here ("" when it can)."""
    if varlen_attn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs torch >= 2.11)"
    if "window_size" not in inspect.signature(varlen_attn).parameters:  # 2.10's took is_causal
        return f"torch {torch.__version__}'s varlen_attn predates its window_size argument (needs torch >= 2.11)"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    if torch.cuda.get_device_capability() < (8, 0):
        return f"{torch.cuda.get_device_name()} predates Ampere (FlashAttention needs compute capability 8.0)"
    return ""


def torch_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           sliding_window=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                           max_length_q=None, max_length_k=None, shared_key_index=None, **kwargs):
    """transformers' attention signature: query [1, H, T, D], key/value [1, Hkv, T, D] ->
    ([1, T, H, D], None). With shared prompts the keys are gathered per segment first
    (models/shared_keys.py); the kernel's causal window is aligned at each run's end."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout or sliding_window:
        raise ValueError(f"model.attention torch_varlen supports neither attention dropout nor sliding windows "
                         f"({type(module).__name__}: dropout {dropout}, sliding_window {sliding_window})")
    key, value = gather_shared_keys(key, value, shared_key_index)
    # The kernel runs in bf16/fp16 only; rotary embeddings leave q and k fp32 under autocast.
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # [T, H, D]
    gqa = {}
    if k.shape[1] != q.shape[1]:
        if NATIVE_GQA:
            gqa = {"enable_gqa": True}
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, scale=scaling,
                      window_size=(-1, 0) if getattr(module, "is_causal", True) else (-1, -1), **gqa)
    return out.unsqueeze(0), None


AttentionInterface.register(TORCH_VARLEN, ulysses(torch_varlen_attention))
