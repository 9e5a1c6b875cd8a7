"""Per-token policy losses (ALGORITHMS.md, "Policy losses").

Every loss takes per-token tensors [B, L] (logp, old_logp, advantages, mask) and returns the
per-token loss and a clipped-token indicator, both [B, L]; aggregation happens elsewhere.
"""

from __future__ import annotations

import torch

from vlrft.registry import Registry

POLICY_LOSSES = Registry("policy loss")


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    return torch.exp((logp - old_logp).clamp(-20.0, 20.0))


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, dual_clip_c: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(rho*A, clip(rho)*A), with the dual clip min(., -c*A) for A < 0 when c > 0."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    clip_hit = clipped < unclipped
    if dual_clip_c > 0:
        cap = -dual_clip_c * advantages  # only binds where A < 0 and the ratio is large
        capped = (advantages < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        clip_hit = clip_hit | capped
    return loss, clip_hit.float()


@POLICY_LOSSES.register("ppo")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level PPO clip (clip-higher when eps_high > eps_low; dual clip when c > 0)."""
    return clipped_surrogate(importance_ratio(logp, old_logp), advantages, eps_low, eps_high, dual_clip_c)


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO, token form: log s_t = logp - sg(logp) + sg(mean_t(logp - old_logp)) per sequence.

    The value of s_t is the sequence ratio exp(mean delta) on every token; its gradient is that
    of logp_t scaled by s, so the update equals the sequence-level GSPO gradient.
    """
    mask = mask.to(logp.dtype)
    delta = (logp - old_logp) * mask  # [B, L]
    seq_log_ratio = delta.sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
    seq_log_ratio = seq_log_ratio.clamp(-20.0, 20.0).detach().unsqueeze(-1)  # [B, 1]
    ratio = torch.exp(logp - logp.detach() + seq_log_ratio)  # [B, L]
    return clipped_surrogate(ratio, advantages, eps_low, eps_high, dual_clip_c)
