"""Reward shaping before advantages (ALGORITHMS.md, "Reward shaping and sample filters")."""

from __future__ import annotations

import torch


def transform_rewards(rewards: torch.Tensor, bias: float, scale: float, max_abs: float) -> torch.Tensor:
    """r' = clip((r - bias) * scale, -max_abs, max_abs); max_abs = 0 means no clipping. [N]."""
    shaped = (rewards - bias) * scale
    return shaped.clamp(-max_abs, max_abs) if max_abs > 0 else shaped


def zero_truncated(rewards: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Responses that hit max_new_tokens without a stop token get reward 0. [N]."""
    return torch.where(truncated, torch.zeros_like(rewards), rewards)


class ZeroRewardWatch:
    """Counts consecutive steps whose rewards were all exactly zero (usually a broken verifier)."""

    def __init__(self, patience: int):
        self.patience = patience  # 0 = never stop
        self.streak = 0

    def update(self, all_zero: bool) -> bool:
        """Record one step; True when the streak reached the patience."""
        self.streak = self.streak + 1 if all_zero else 0
        return self.patience > 0 and self.streak >= self.patience
