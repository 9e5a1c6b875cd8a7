"""Advantage estimators (ALGORITHMS.md, "Advantage estimators")."""

from __future__ import annotations

import torch

from vlrft.registry import Registry

ADVANTAGES = Registry("advantage estimator")
# Estimators that compare responses within a group and so need n_samples_per_prompt >= 2.
GROUP_ESTIMATORS = {"grpo", "rloo"}


def group_mean_std(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and Bessel-corrected std of its group's rewards. [N], [N]."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, rewards)
    means = sums / counts
    sq = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, (rewards - means[inverse]) ** 2)
    # Bessel correction (torch default); a group of one has no spread: std 0.
    stds = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return means[inverse], stds[inverse]


@ADVANTAGES.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps); scale_by_std=False gives Dr.GRPO's r_i - mean_g. [N]."""
    mean, std = group_mean_std(rewards, group_ids)
    centred = rewards - mean
    return centred / (std + eps) if scale_by_std else centred


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean_g) (leave-one-out baseline). [N]."""
    mean, _ = group_mean_std(rewards, group_ids)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    size = counts[inverse].to(rewards.dtype)
    return (rewards - mean) * size / (size - 1).clamp(min=1.0)
