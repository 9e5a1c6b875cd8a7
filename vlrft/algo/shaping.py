"""Reward shaping before advantages (docs/algorithms.md, "Reward shaping and sample filters")."""

from __future__ import annotations

import torch


def transform_rewards(rewards: torch.Tensor, bias: float, scale: float, max_abs: float) -> torch.Tensor:
    """r' = clip((r - bias) * scale, -max_abs, max_abs); max_abs = 0 means no clipping. [N]."""
    shaped = (rewards - bias) * scale
    return shaped.clamp(-max_abs, max_abs) if max_abs > 0 else shaped


def zero_truncated(rewards: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Responses that hit max_new_tokens without a stop token get reward 0. [N]."""
    return torch.where(truncated, torch.zeros_like(rewards), rewards)


ZERO_REWARD_WARN_STEPS = 3  # consecutive all-zero steps after which a run warns (always on)


class ZeroRewardWatch:
    """Counts consecutive steps whose rewards were all exactly zero (usually a broken verifier)."""

    def __init__(self, patience: int):
        self.patience = patience  # 0 = never stop
        self.streak = 0

    def update(self, all_zero: bool) -> bool:
        """Record one step; True when the streak reached the patience."""
        self.streak = self.streak + 1 if all_zero else 0
        return self.patience > 0 and self.streak >= self.patience

    def warn_now(self) -> bool:
        """True once per streak, at ZERO_REWARD_WARN_STEPS steps, unless the patience stops the
        run first."""
        stops_first = 0 < self.patience <= ZERO_REWARD_WARN_STEPS
        return self.streak == ZERO_REWARD_WARN_STEPS and not stops_first


def groups_with_spread(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: True for responses whose group's rewards are not all equal. [N] bool.

    An all-equal group has zero advantage under any group baseline: it only dilutes the batch.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1 if len(inverse) else 0
    high = torch.full((groups,), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, inverse, rewards, "amax")
    low = torch.full((groups,), torch.inf, dtype=rewards.dtype).scatter_reduce(0, inverse, rewards, "amin")
    return (high > low)[inverse]


def best_of_n(rewards: torch.Tensor, group_ids: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` highest-reward responses of each group (ties: earliest first), in input order."""
    chosen = []
    for gid in torch.unique(group_ids):
        members = torch.nonzero(group_ids == gid).squeeze(-1)
        # Stable sort by descending reward keeps the earlier of equal responses.
        order = torch.sort(-rewards[members], stable=True).indices
        chosen.append(members[order[:keep]])
    return torch.sort(torch.cat(chosen)).values if chosen else torch.zeros(0, dtype=torch.long)


def approx_kl(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """0.5 * (logp - old_logp)^2 per token (TRL PPO's approximate KL to the rollout policy)."""
    return 0.5 * (logp - old_logp) ** 2


def should_stop_early(ratio_mean: float, kl_mean: float, early_stop_ratio: float, target_kl: float) -> bool:
    """Stop the remaining update epochs once the policy moved too far from the rollout policy.

    AReaL's importance-ratio bound and TRL's target KL; 0 disables either check.
    """
    return (early_stop_ratio > 0 and ratio_mean > early_stop_ratio) or (target_kl > 0 and kl_mean > target_kl)
