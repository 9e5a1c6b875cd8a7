"""How a packed micro-batch keeps its samples apart, and the precision the decoder runs in.

Attention (`model.attention`):
- `sdpa`: a block-diagonal causal mask [1, 1, T, T]. Works everywhere; the mask costs O(T^2)
  memory and the kernel still visits the masked blocks.
- `flash_attention_2`: no mask. The varlen flash-attention kernel gets each sample's start
  (cumulative lengths), so memory is O(T) and nothing across samples is computed. Needs a CUDA
  GPU, the flash-attn package and bf16 compute (flash-attention has no fp32 kernel).
- `torch_varlen`: the same, on PyTorch's built-in varlen FlashAttention kernel (torch >= 2.11):
  no extra package to build (see torch_varlen.py).
- `sdpa_segments`: no mask either; each sample's slice of the packed batch goes through causal
  sdpa on its own (cost Σ L_i² instead of T²), on any device and in fp32 (see sdpa_segments.py).
- `auto`: with bf16 compute on a GPU, flash_attention_2 where installed, else torch_varlen where
  it can run; sdpa_segments on the CPU; sdpa otherwise.

Compute precision (`model.compute_dtype`): `bfloat16` runs the decoder (vision tower included)
and the LM head's matmul under torch.autocast; logsumexp, logprobs, entropy and the value head
stay fp32. Under ZeRO 0-2 the parameters stay fp32 (the optimizer's master copy, cast per
matmul by autocast). Under ZeRO-3 the policy and critic use DeepSpeed's bf16 mode instead
(bf16 parameters, gradients summed in fp32, fp32 master weights in the optimizer: see
backends/deepspeed_backend.py): autocast there would keep the bf16 cast of every gathered
weight until backward, a full bf16 copy of the model per rank.
"""

from __future__ import annotations

import contextlib
import importlib.util
from itertools import accumulate

import torch

from vlrft.models.sdpa_segments import SDPA_SEGMENTS
from vlrft.models.shared_keys import SHARED_KEYS
from vlrft.models.torch_varlen import TORCH_VARLEN, torch_varlen_missing

ATTENTION_CHOICES = ("auto", "sdpa", "sdpa_segments", "flash_attention_2", "torch_varlen")
VARLEN_KERNELS = ("flash_attention_2", "torch_varlen")  # mask-free choices, in auto's preference order
SEQUENCE_PARALLEL_ATTENTION = ("sdpa_segments", "torch_varlen")  # those vlrft wraps in Ulysses' exchange
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def flash_attention_missing() -> str:
    """Why the flash-attention kernel cannot run here ("" when it can)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed (pip install 'vlrft[gpu]')"
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        return "the installed flash-attn is not one transformers can use (needs >= 2.3.3)"
    if torch.cuda.get_device_capability() < (8, 0):
        return f"{torch.cuda.get_device_name()} predates Ampere (flash-attention 2 needs compute capability 8.0)"
    return ""


def attention_missing(attention: str) -> str:
    """Why a varlen `model.attention` choice cannot run here ("" when it can)."""
    return flash_attention_missing() if attention == "flash_attention_2" else torch_varlen_missing()


def precision_config_problem(attention: str, compute_dtype: str, zero_stage: int) -> str:
    """Why `model.attention` / `model.compute_dtype` cannot be used as configured, as the one
    line the config error prints ("" when they can)."""
    if attention not in ATTENTION_CHOICES:
        return f"config key 'model.attention' is '{attention}'; valid: {', '.join(ATTENTION_CHOICES)}"
    if compute_dtype not in COMPUTE_DTYPES:
        return f"config key 'model.compute_dtype' is '{compute_dtype}'; valid: {', '.join(COMPUTE_DTYPES)}"
    if compute_dtype == "bfloat16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return f"config key 'model.compute_dtype' bfloat16: {torch.cuda.get_device_name()} has no bf16 support"
    if attention in VARLEN_KERNELS:
        if compute_dtype != "bfloat16":
            return (f"config key 'model.attention' {attention} needs model.compute_dtype: bfloat16 "
                    "(flash-attention has no fp32 kernel)")
        missing = attention_missing(attention)
        if missing:
            return f"config key 'model.attention' {attention} cannot run here: {missing}"
    return ""


def resolve_attention(requested: str, compute_dtype: str, sequence_parallel: bool = False) -> str:
    """The transformers attn_implementation for `model.attention` (config-checked already).
    With `sequence_parallel`, `auto` picks among the implementations that exchange heads for
    tokens (models/ulysses.py): torch_varlen, else sdpa_segments."""
    if requested == "auto":
        kernels = VARLEN_KERNELS if compute_dtype == "bfloat16" else ()
        kernels = tuple(k for k in kernels if k in SEQUENCE_PARALLEL_ATTENTION) if sequence_parallel else kernels
        fallback = "sdpa" if torch.cuda.is_available() and not sequence_parallel else "sdpa_segments"
        requested = next((k for k in kernels if not attention_missing(k)), fallback)
    return {"torch_varlen": TORCH_VARLEN, "sdpa_segments": SDPA_SEGMENTS}.get(requested, requested)


def uses_varlen(backbone: torch.nn.Module) -> bool:
    """Whether the model's attention takes cumulative sequence lengths instead of a mask."""
    implementation = backbone.config._attn_implementation or ""
    return implementation in (TORCH_VARLEN, SDPA_SEGMENTS) or "flash" in implementation


def block_causal_mask(lengths: list[int], device: torch.device | str = "cpu", parents: list[int] | None = None) -> torch.Tensor:
    """True where a token may attend: earlier-or-same tokens of its own segment and, for a
    segment continuing a shared prompt (`parents[i]` >= 0), every token of that prompt.
    [1, 1, T, T], built where it is used (T^2 booleans: never copied between devices)."""
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))  # [T]
    position = torch.arange(segment.shape[0], device=device)  # [T]
    mask = (segment[:, None] == segment[None, :]) & (position[:, None] >= position[None, :])  # [T, T]
    if parents is not None and max(parents, default=-1) >= 0:
        parent = torch.tensor(parents, device=device)[segment]  # [T] each token's segment's prompt (-1: none)
        mask |= parent[:, None] == segment[None, :]
    return mask[None, None]


def varlen_kwargs(lengths: list[int], parents: list[int] | None = None) -> dict:
    """The kwargs transformers forwards to the varlen kernels: segment starts and the longest.
    With shared prompts (`parents[i]` >= 0: segment i continues prompt segment `parents[i]`)
    each segment's keys are its prompt's tokens then its own: `shared_key_index` lists them
    (positions in the row, segment after segment) and `cu_seq_lens_k` their starts; causality is
    aligned at the end (a segment's query i sees its keys up to its prompt's length + i)."""
    starts = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32)  # [S + 1]
    kwargs = {"cu_seq_lens_q": starts, "cu_seq_lens_k": starts, "max_length_q": max(lengths), "max_length_k": max(lengths)}
    if parents is None or max(parents, default=-1) < 0:
        return kwargs
    keys = [torch.arange(starts[i], starts[i + 1]) for i in range(len(lengths))]
    keys = [torch.cat([keys[p], own]) if p >= 0 else own for p, own in zip(parents, keys)]
    key_lengths = [len(k) for k in keys]
    return kwargs | {"cu_seq_lens_k": torch.tensor([0, *accumulate(key_lengths)], dtype=torch.int32),
                     "max_length_k": max(key_lengths), SHARED_KEYS: torch.cat(keys)}


def check_shared_prefix_support(backbone: torch.nn.Module, shared: bool) -> None:
    """Only the implementations that read a shared-prompt layout may run one: sdpa (the block
    mask), sdpa_segments, torch_varlen and flash_attention_2 (each segment's gathered keys).
    Others would drop it silently: flex or eager attention, another flash kernel."""
    implementation = backbone.config._attn_implementation or ""
    if shared and implementation not in ("sdpa", SDPA_SEGMENTS, TORCH_VARLEN, "flash_attention_2"):
        raise ValueError(f"train.share_prompts: attention '{implementation}' cannot run a shared-prompt micro-batch; "
                         f"set model.attention to auto, sdpa, sdpa_segments, torch_varlen or flash_attention_2, "
                         f"or train.share_prompts: false")


def decoder_autocast(model: torch.nn.Module):
    """Autocast to the model's compute dtype (set by the loader), or nothing for fp32."""
    dtype = getattr(model, "compute_dtype", torch.float32)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=next(model.parameters()).device.type, dtype=dtype)
