"""Per-token policy losses (ALGORITHMS.md, "Policy losses").

PPO and GSPO share the clipped surrogate and differ only in the importance ratio, so the
registry maps a loss name to its ratio. Tensors are [B, L] (logp, old_logp, advantages, mask);
aggregation happens elsewhere.
"""

from __future__ import annotations

import torch

from vlrft.registry import Registry

POLICY_LOSSES = Registry("policy loss")  # name -> ratio(logp, old_logp, mask) [B, L]


@POLICY_LOSSES.register("ppo")
def token_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rho_t = exp(clamp(logp_t - old_logp_t, -20, 20))."""
    return torch.exp((logp - old_logp).clamp(-20.0, 20.0))


@POLICY_LOSSES.register("gspo")
def sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO, token form: log s_t = logp - sg(logp) + sg(mean_t(logp - old_logp)) per sequence.

    The value of s_t is the sequence ratio exp(mean delta) on every token; its gradient is that
    of logp_t scaled by s, so the update equals the sequence-level GSPO gradient.
    Past the +-20 clamp the sequence objective has no gradient (the clamp is flat there), so
    neither has the token form: the gradient path is cut for those sequences, as PPO's clamp
    cuts it per token.
    """
    mask = mask.to(logp.dtype)
    delta = (logp - old_logp) * mask  # [B, L]
    raw = (delta.sum(-1) / mask.sum(-1).clamp(min=1.0)).detach()  # [B]
    inside = (raw.abs() <= 20.0).to(logp.dtype).unsqueeze(-1)  # [B, 1] 0 where the clamp binds
    seq_log_ratio = raw.clamp(-20.0, 20.0).unsqueeze(-1)  # [B, 1]
    return torch.exp(inside * (logp - logp.detach()) + seq_log_ratio)  # [B, L]


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


def policy_loss(
    name: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss of the named policy loss and the clipped-token indicator, both [B, L]."""
    ratio = POLICY_LOSSES.get(name)(logp, old_logp, mask)
    return clipped_surrogate(ratio, advantages, eps_low, eps_high, dual_clip_c)
