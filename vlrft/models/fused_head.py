"""Which LM head computes the response tokens' logprobs and entropy (`model.fused_head`).

`chunked` (models/chunked.py): the head's matmul, then logsumexp and entropy in fp32, 1,024
tokens at a time, each chunk recomputed in backward. It runs everywhere and is the reference.

`liger`: Liger-Kernel's `LigerFusedLinearScaledCrossEntropyFunction` (liger-kernel >= 0.8.2;
`liger_kernel.ops`): for hidden [N, H], weight [V, H] and targets [N] it returns the negative
logprob of each target under softmax(hidden @ weight.T / temperature) (fp32) and the entropy
of that distribution (in the input dtype), and its backward takes a gradient through both (the
entropy bonus, `algo.entropy_coef`, trains through it). On a Hopper GPU (compute capability
9.0) it runs Liger's CuTe DSL kernel, which never writes the [N, V] logits to memory (bf16
only; it needs `nvidia-cutlass-dsl`, liger-kernel's `cutedsl` extra); on other CUDA GPUs Liger
runs its own chunked PyTorch version of the same function. The logprob's normaliser is
accumulated in fp32 in both; the returned entropy is rounded to bf16 (about 3 significant
digits), then taken to fp32 here. The Hopper kernel's backward computes the weight's gradient
even for a frozen head (LoRA), which is then dropped.

`auto`: `liger` where Liger runs its fused kernel (a Hopper GPU, bf16 compute, liger-kernel
and nvidia-cutlass-dsl installed), `chunked` elsewhere. Liger is imported only when chosen,
never on a CPU.

The fused function reads `lm_head.weight` itself instead of calling the module, so ZeRO-3's
per-module gathering never runs for it: the weight is gathered here (GatheredParameters, every
rank reading) and copied into the compute dtype, the copy that the kernel keeps for backward
(the partition is released on leaving the context; ~0.5 GB for a 152k x 1536 head in bf16).
The copy is differentiable, so the gradient reaches the parameter, and with tied embeddings
(`lm_head.weight` is the embedding) the embedding. Each call gathers once, and the callers make
one call per micro-batch on every rank (forward.py's dummy call included), as ZeRO-3's
collective gathers need.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util

import torch
from packaging.version import Version

from vlrft.errors import ConfigError
from vlrft.models.chunked import LOGIT_CHUNK_TOKENS, chunked_token_stats

FUSED_HEADS = ("auto", "liger", "chunked")
LIGER_MIN_VERSION = "0.8.2"  # the first release with LigerFusedLinearScaledCrossEntropyFunction
INSTALL = "pip install -e '.[gpu]'"


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def liger_missing(compute_dtype: str) -> str:
    """Why Liger's head cannot run here, as the end of a sentence; '' when it can."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (this machine has none)"
    if compute_dtype != "bfloat16":
        return f"needs model.compute_dtype bfloat16, not {compute_dtype} (Liger's Hopper kernel is bf16-only)"
    if importlib.util.find_spec("liger_kernel") is None:
        return f"needs liger-kernel, which is not installed: {INSTALL}"
    version = importlib.metadata.version("liger-kernel")
    if Version(version) < Version(LIGER_MIN_VERSION):
        return f"needs liger-kernel >= {LIGER_MIN_VERSION} (installed: {version}): {INSTALL}"
    if _hopper() and importlib.util.find_spec("cutlass") is None:
        return ("on a Hopper GPU needs nvidia-cutlass-dsl, where Liger runs its CuTe kernel: "
                "pip install 'liger-kernel[cutedsl]'")
    return ""


def fused_head_problem(requested: str, compute_dtype: str) -> str:
    """Why `model.fused_head` cannot be used as configured, as the one-line config error; ''
    when it can."""
    if requested not in FUSED_HEADS:
        return f"config key 'model.fused_head' is '{requested}'; valid: {', '.join(FUSED_HEADS)}"
    missing = liger_missing(compute_dtype) if requested == "liger" else ""
    return f"config key 'model.fused_head' liger {missing}" if missing else ""


def resolve_fused_head(requested: str, compute_dtype: str, head: torch.nn.Module) -> str:
    """'liger' or 'chunked': the head `policy_forward` runs for a model whose LM head is `head`
    (set as the model's `fused_head` attribute). Liger's function is a bias-free linear layer
    and nothing else: a head that is not one (an adapted head, model.lora) keeps the chunked
    head under auto, and is refused under liger."""
    plain = type(head) is torch.nn.Linear and head.bias is None
    if requested == "liger" and not plain:
        kind = f"{type(head).__module__}.{type(head).__qualname__}"
        raise ConfigError(f"config key 'model.fused_head' liger needs a bias-free torch.nn.Linear LM head, not {kind}")
    if requested == "auto":
        return "liger" if plain and not liger_missing(compute_dtype) and _hopper() else "chunked"
    return requested


def head_token_stats(
    causal_lm: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
    chunk_tokens: int = LOGIT_CHUNK_TOKENS, also: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each target, entropy of its distribution, both [N] fp32; the logprobs of the
    ids in `also` [N, k], [N, 0] without it) from hidden [N, H] through `causal_lm.lm_head`, by
    the head its `fused_head` attribute names (chunked if unset; only it gives `also`'s)."""
    if getattr(causal_lm, "fused_head", "chunked") == "liger":
        if also is not None:
            raise ValueError("model.fused_head liger gives the sampled token's logprob only, not other ids'")
        dtype = getattr(causal_lm, "compute_dtype", torch.bfloat16)
        logp, entropy = liger_token_stats(hidden, targets, causal_lm.lm_head.weight, temperature, dtype)
        return logp, entropy, logp.new_zeros(logp.shape[0], 0)
    return chunked_token_stats(hidden, targets, causal_lm.lm_head, temperature, chunk_tokens, also)


def _liger_function():
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

    return LigerFusedLinearScaledCrossEntropyFunction


def _gathered(weight: torch.nn.Parameter):
    """The full weight for the block's duration where ZeRO-3 partitions it; else nothing to do."""
    if not hasattr(weight, "ds_id"):  # not a ZeRO-3 parameter
        return contextlib.nullcontext()
    from vlrft.backends.deepspeed_backend import gathered_for_reading  # (DeepSpeed is imported there only)

    return gathered_for_reading([weight])


def liger_token_stats(
    hidden: torch.Tensor, targets: torch.Tensor, weight: torch.nn.Parameter, temperature: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Liger's fused head: (logprob, entropy) [N] fp32 from hidden [N, H] and weight [V, H] in
    `dtype` (the compute dtype)."""
    if hidden.shape[0] == 0:  # Liger refuses empty inputs; forward.py's dummy call covers gathering
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    with _gathered(weight):
        # Under ZeRO-3 a copy even where the cast is a no-op (bf16 weights): the kernel runs
        # after the block, and its backward later, when the partition is released again.
        weight = weight.to(dtype, copy=hasattr(weight, "ds_id"))
    nll, entropy = _liger_function().apply(
        hidden.to(dtype).contiguous(), weight, targets.contiguous(), float(temperature),
        -100,  # ignore_index: no target is ignored (they are all response tokens)
        1,  # m_tiles_per_cluster: accepted for compatibility, no effect
        True,  # return_entropy
    )
    return -nll.float(), entropy.float()
