"""Rollout correction: the engine samples from its own numerics (vLLM kernels, bf16, a stale or
differently sharded copy of the weights), not exactly from the trainer's old policy. With
r_t = pi_old(t) / pi_engine(t) per sampled token (docs/algorithms.md, "Rollout correction"):

- `tis`: truncated importance sampling, weight min(r_t, cap) on the policy-gradient term;
- `mis`: masked importance sampling at sequence level, a response whose geometric-mean ratio
  exp(mean_t log r_t) leaves [low, high] is left out of the policy-gradient term;
- `icepop`: two-sided token masking, tokens with r_t outside [low, high] carry no gradient;
- `behaviour`: no weight; the PPO ratio is taken against the engine's logprobs instead of the
  trainer's old ones, so its clip bounds each update around the policy that sampled (verl's
  bypass mode). For stale samples (async training) the clip then stops pushing tokens that the
  updates since sampling already pushed past 1 +- eps.

The weights multiply only the policy-gradient term; the loss denominators keep every token.
"""

from __future__ import annotations

import torch

ROLLOUT_CORRECTIONS = ("none", "tis", "mis", "icepop", "behaviour")


def correction_weights(
    old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, mode: str, cap: float, low: float, high: float
) -> torch.Tensor:
    """Per-token weights of the policy-gradient term, [N, R] (0 on padding)."""
    mask = mask.to(old_logp.dtype)
    log_ratio = (old_logp - engine_logp).clamp(-20.0, 20.0) * mask  # [N, R] log pi_old / pi_engine
    ratio = torch.exp(log_ratio)
    if mode in ("none", "behaviour"):  # (behaviour: the update's ratio uses the engine's logprobs)
        weights = torch.ones_like(ratio)
    elif mode == "tis":
        weights = ratio.clamp(max=cap)
    elif mode == "icepop":
        weights = ((ratio >= low) & (ratio <= high)).to(ratio.dtype)
    elif mode == "mis":
        sequence = torch.exp(log_ratio.sum(-1) / mask.sum(-1).clamp(min=1.0))  # [N] geometric mean
        weights = ((sequence >= low) & (sequence <= high)).to(ratio.dtype).unsqueeze(-1).expand_as(ratio)
    else:
        raise ValueError(f"unknown rollout correction '{mode}'; valid: {', '.join(ROLLOUT_CORRECTIONS)}")
    return weights * mask


def mismatch_sums(old_logp: torch.Tensor, engine_logp: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sums for the mismatch metrics over valid tokens: [tokens, k3 KL(engine || old), weight,
    weight^2, masked (weight 0) tokens]. k3 = r - 1 - log r with r = pi_old / pi_engine, an
    unbiased, non-negative estimate from tokens the engine sampled."""
    mask = mask.to(old_logp.dtype)
    log_ratio = (old_logp - engine_logp).clamp(-20.0, 20.0)
    k3 = (torch.exp(log_ratio) - 1.0 - log_ratio) * mask
    return torch.stack([
        mask.sum(), k3.sum(), (weights * mask).sum(), (weights ** 2 * mask).sum(), ((weights == 0).float() * mask).sum(),
    ])
