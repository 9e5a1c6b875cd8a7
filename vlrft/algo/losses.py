"""Per-token policy losses (docs/algorithms.md, "Policy losses").

Every registered loss has one call contract: (logp, old_logp, advantages, mask, settings) ->
(per-token loss, per-token clip indicator), all [B, L]; aggregation happens elsewhere. PPO and
GSPO share the clipped surrogate and differ only in the importance ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrft.registry import Registry

POLICY_LOSSES = Registry("policy loss")  # name -> loss(logp, old_logp, advantages, mask, settings)

LOG_RATIO_CLAMP = 20.0  # |log ratio| beyond this is clamped (and carries no gradient)


@dataclass
class LossSettings:
    eps_low: float = 0.2  # clip range [1 - eps_low, 1 + eps_high] (gmpo: [-eps_low, eps_high] in log space)
    eps_high: float = 0.2
    dual_clip_c: float = 0.0  # ppo / gspo: cap -c*A for A < 0 (0 = off)
    sapo_tau_pos: float = 1.0  # sapo: gate temperature where A > 0
    sapo_tau_neg: float = 1.05  # sapo: gate temperature where A <= 0


def token_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """rho_t = exp(clamp(logp_t - old_logp_t, -20, 20))."""
    return torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


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
    inside = (raw.abs() <= LOG_RATIO_CLAMP).to(logp.dtype).unsqueeze(-1)  # [B, 1] 0 where the clamp binds
    seq_log_ratio = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).unsqueeze(-1)  # [B, 1]
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


@POLICY_LOSSES.register("ppo")
def ppo_loss(logp, old_logp, advantages, mask, s: LossSettings):
    """-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), token ratio."""
    return clipped_surrogate(token_ratio(logp, old_logp), advantages, s.eps_low, s.eps_high, s.dual_clip_c)


@POLICY_LOSSES.register("gspo")
def gspo_loss(logp, old_logp, advantages, mask, s: LossSettings):
    """The clipped surrogate on GSPO's sequence ratio (token form)."""
    return clipped_surrogate(sequence_ratio(logp, old_logp, mask), advantages, s.eps_low, s.eps_high, s.dual_clip_c)


@POLICY_LOSSES.register("cispo")
def cispo_loss(logp, old_logp, advantages, mask, s: LossSettings):
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(rho, 1 - eps_low, 1 + eps_high)) A logp.
    The importance weight is clipped and detached, so no token's gradient is dropped: each
    is scaled by its clipped weight."""
    ratio = token_ratio(logp, old_logp)
    weight = ratio.clamp(1.0 - s.eps_low, 1.0 + s.eps_high).detach()
    clip_hit = (ratio < 1.0 - s.eps_low) | (ratio > 1.0 + s.eps_high)
    return -weight * advantages * logp, clip_hit.float()


@POLICY_LOSSES.register("sapo")
def sapo_loss(logp, old_logp, advantages, mask, s: LossSettings):
    """SAPO (arXiv 2511.20347): -(4/tau) sigmoid(tau (rho - 1)) A, tau = tau_pos where A > 0,
    tau_neg elsewhere. A soft gate instead of a clip: at rho = 1 the gradient is PPO's, and it
    fades smoothly as rho leaves 1. Nothing is clipped (indicator 0)."""
    ratio = token_ratio(logp, old_logp)
    tau = torch.where(advantages > 0, s.sapo_tau_pos, s.sapo_tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return -gate * advantages, torch.zeros_like(ratio)


@POLICY_LOSSES.register("gmpo")
def gmpo_loss(logp, old_logp, advantages, mask, s: LossSettings):
    """GMPO (arXiv 2507.20673): the geometric mean of the token ratios. Per token, delta =
    logp - old is clipped to [-eps_low, eps_high] in log space, pessimistically for the sign of
    A (sign(A) min(sign(A) delta, sign(A) clip(delta))); the sequence ratio is exp(mean_t of
    that), and every token of the sequence carries -A * ratio (a sequence-level objective:
    use loss_agg_mode seq-mean-token-mean)."""
    mask = mask.to(logp.dtype)
    delta = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    sign = torch.sign(advantages)
    clipped = delta.clamp(-s.eps_low, s.eps_high)
    pessimistic = sign * torch.minimum(sign * delta, sign * clipped)  # [B, L]
    seq_ratio = torch.exp((pessimistic * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))
    return -advantages * seq_ratio, (pessimistic != delta).float()


def policy_loss(
    name: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    settings: LossSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss of the named policy loss and the clipped-token indicator, both [B, L]."""
    return POLICY_LOSSES.get(name)(logp, old_logp, advantages, mask, settings)
