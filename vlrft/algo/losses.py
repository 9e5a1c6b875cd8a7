"""Per-token policy losses (ALGORITHMS.md, "Policy losses")."""

from __future__ import annotations

import torch

from vlrft.registry import Registry

POLICY_LOSSES = Registry("policy loss")


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    return torch.exp((logp - old_logp).clamp(-20.0, 20.0))


@POLICY_LOSSES.register("ppo")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A) per token, and the clipped-token indicator."""
    ratio = importance_ratio(logp, old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    clip_hit = (clipped < unclipped).float()
    return loss, clip_hit
