"""The advantage estimators behind one call contract, and the one entry point over them.

An estimator is a registered function `(AdvantageInputs, AdvantageOptions) -> (advantages
[N, R], returns [N, R] or None)`; a new one is one `@ADVANTAGES.register("name")` function.
Normalisation happens inside the estimator and only there (docs/algorithms.md);
`advantage_clip` clamps afterwards, in `estimate_advantages`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vlrft.algo.advantages import (
    ADVANTAGES,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
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


@dataclass
class AdvantageInputs:
    scores: torch.Tensor  # [N] shaped sequence rewards
    group_ids: torch.Tensor  # [N] explicit groups (all responses of one prompt)
    mask: torch.Tensor  # [N, R] response tokens that count (float)
    token_terms: torch.Tensor  # [N, R] per-token additions to the reward (dense rewards, -beta*KL)
    values: torch.Tensor | None = None  # [N, R] critic values (gae)
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t  # sum over data-parallel ranks

    def sequence_rewards(self) -> torch.Tensor:
        """Scores plus each response's summed token terms, for sequence-level estimators. [N]."""
        return self.scores + self.token_terms.sum(-1)

    def token_level_rewards(self) -> torch.Tensor:
        """Each score on its response's last token plus the token terms, for token-level ones. [N, R]."""
        return token_rewards(self.scores, self.mask) + self.token_terms

    def broadcast(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """[N] -> [N, R] over each response's tokens."""
        return per_sequence.unsqueeze(-1) * self.mask


@ADVANTAGES.register("grpo")
def _grpo(x: AdvantageInputs, opts: AdvantageOptions):
    return x.broadcast(grpo_advantages(x.sequence_rewards(), x.group_ids, scale_by_std=opts.scale_by_std)), None


@ADVANTAGES.register("rloo")
def _rloo(x: AdvantageInputs, opts: AdvantageOptions):
    return x.broadcast(rloo_advantages(x.sequence_rewards(), x.group_ids)), None


@ADVANTAGES.register("reinforce_pp_baseline")
def _reinforce_pp_baseline(x: AdvantageInputs, opts: AdvantageOptions):
    centred = x.broadcast(reinforce_pp_baseline_advantages(x.sequence_rewards(), x.group_ids))
    return masked_whiten(centred, x.mask, x.reduce_sum), None


@ADVANTAGES.register("reinforce_pp")
def _reinforce_pp(x: AdvantageInputs, opts: AdvantageOptions):
    returns = discounted_returns(x.token_level_rewards(), x.mask, opts.gamma)
    return masked_whiten(returns, x.mask, x.reduce_sum), None


@ADVANTAGES.register("gae")
def _gae(x: AdvantageInputs, opts: AdvantageOptions):
    if x.values is None:
        raise ValueError("the gae estimator needs critic values")
    advantages, returns = gae_advantages(x.token_level_rewards(), x.values, x.mask, opts.gamma, opts.lam)
    return (masked_whiten(advantages, x.mask, x.reduce_sum) if opts.whiten_gae else advantages), returns


def estimate_advantages(
    opts: AdvantageOptions,
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    token_terms: torch.Tensor,
    values: torch.Tensor | None = None,
    reduce_sum=lambda t: t,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages [N, R], returns [N, R] for gae else None) from the named estimator.

    scores [N]: shaped sequence rewards. token_terms [N, R]: per-token additions to the reward
    (dense recipe rewards minus beta * KL when the KL is placed in the reward). Token-level
    estimators (reinforce_pp, gae) consume them per token; sequence-level estimators add
    their sum to the score. `reduce_sum` sums over data-parallel ranks (whitening statistics).
    """
    mask = mask.to(scores.dtype)
    inputs = AdvantageInputs(scores, group_ids, mask, token_terms * mask, values, reduce_sum)
    advantages, returns = ADVANTAGES.get(opts.name)(inputs, opts)
    if opts.clip > 0:
        advantages = advantages.clamp(-opts.clip, opts.clip)
    return advantages * mask, returns
