"""Entropy control by covariance, KL-Cov (Cui et al., "The Entropy Mechanism of Reinforcement
Learning for Reasoning Language Models", arXiv 2505.22617): a policy's entropy falls when the
tokens it already rates likely get high advantages. Per valid token,

    cov_t = (A_t - mean(A)) * (log pi_t - mean(log pi))      (detached; means over all ranks' tokens)

and the ceil(ratio * N) tokens of largest cov_t (N valid tokens on all ranks; ties kept) get
coef * |log pi_t - log pi_old_t| added to their loss, which holds those tokens near the rollout
policy instead of sharpening it further (`algo.kl_cov_ratio`, `algo.kl_cov_coef`)."""

from __future__ import annotations

import math
from typing import Callable

import torch


def covariances(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """cov_t of this rank's valid tokens ([V], in mask order), with means over every rank's
    valid tokens (`gather` concatenates a 1-D tensor over ranks)."""
    valid = mask.bool()
    a, lp = advantages.detach()[valid], logp.detach()[valid]
    return (a - gather(a).mean()) * (lp - gather(lp).mean())


def kl_cov_terms(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 ratio: float, coef: float, gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The per-token extra loss ([S, R] like `logp`): coef * |logp - old| on the chosen tokens,
    0 elsewhere; gradient through `logp` only."""
    cov = covariances(logp, advantages, mask, gather)
    every = gather(cov)  # all ranks' tokens
    chosen = torch.zeros_like(logp)
    if every.numel() == 0 or ratio <= 0:
        return chosen
    k = min(every.numel(), math.ceil(ratio * every.numel()))
    threshold = torch.topk(every, k).values[-1]
    chosen[mask.bool()] = (cov >= threshold).to(logp.dtype)
    return coef * (logp - old_logp.detach()).abs() * chosen
