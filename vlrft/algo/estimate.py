"""One entry point over all advantage estimators: scores and per-token terms in, [N, R] out.

Normalisation happens here and only here (ALGORITHMS.md); `advantage_clip` clamps afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrft.algo.advantages import (
    ADVANTAGES,
    WHITENED_ESTIMATORS,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    token_rewards,
)


@dataclass
class AdvantageOptions:
    name: str = "grpo"
    scale_by_std: bool = True  # grpo only (false = Dr.GRPO)
    gamma: float = 1.0  # discount of reinforce_pp and gae
    lam: float = 0.95  # GAE lambda
    whiten_gae: bool = True  # whiten gae advantages over the global batch
    clip: float = 0.0  # clamp advantages to +-clip afterwards; 0 = off


def estimate_advantages(
    opts: AdvantageOptions,
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    token_terms: torch.Tensor,
    values: torch.Tensor | None = None,
    reduce_sum=lambda t: t,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages [N, R], returns [N, R] for gae else None).

    scores [N]: shaped sequence rewards. token_terms [N, R]: per-token additions to the reward
    (dense recipe rewards minus beta * KL when the KL is placed in the reward). Token-level
    estimators (reinforce_pp, gae) consume them per token; sequence-level estimators add
    their sum to the score. `reduce_sum` sums over data-parallel ranks (whitening statistics).
    """
    mask = mask.to(scores.dtype)
    token_terms = token_terms * mask
    returns = None
    if opts.name == "gae":
        if values is None:
            raise ValueError("the gae estimator needs critic values")
        rewards = token_rewards(scores, mask) + token_terms
        advantages, returns = gae_advantages(rewards, values, mask, opts.gamma, opts.lam)
        if opts.whiten_gae:
            advantages = masked_whiten(advantages, mask, reduce_sum)
    elif opts.name == "reinforce_pp":
        advantages = discounted_returns(token_rewards(scores, mask) + token_terms, mask, opts.gamma)
    else:
        sequence = scores + token_terms.sum(-1)  # [N]
        if opts.name == "grpo":
            per_seq = grpo_advantages(sequence, group_ids, scale_by_std=opts.scale_by_std)
        else:
            per_seq = ADVANTAGES.get(opts.name)(sequence, group_ids)
        advantages = per_seq.unsqueeze(-1) * mask  # [N, R] broadcast to tokens
    if opts.name in WHITENED_ESTIMATORS:
        advantages = masked_whiten(advantages, mask, reduce_sum)
    if opts.clip > 0:
        advantages = advantages.clamp(-opts.clip, opts.clip)
    return advantages * mask, returns
