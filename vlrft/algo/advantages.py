"""Advantage estimators (docs/algorithms.md, "Advantage estimators")."""

from __future__ import annotations

import torch

from vlrft.registry import Registry

# name -> estimator(AdvantageInputs, AdvantageOptions) -> (advantages [N, R], returns [N, R] | None);
# the estimators are registered in estimate.py, on top of the math below.
ADVANTAGES = Registry("advantage estimator")
# Estimators that compare responses within a group and so need n_samples_per_prompt >= 2.
GROUP_ESTIMATORS = {"grpo", "rloo", "reinforce_pp_baseline"}


# A group whose rewards spread less than this (relative to their size) holds equal rewards
# computed along different float paths (1.0 + 0.1 vs 0.1 + 1.0): no signal, only rounding.
ROUNDING_SPREAD = 1e-6


def group_mean_std(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and Bessel-corrected std of its group's rewards, in float64. [N], [N].

    float64 makes the mean of equal float32 rewards exactly that reward (sums of float32
    values are exact in float64), so an all-equal group centres to exactly 0."""
    rewards = rewards.double()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, rewards)
    means = sums / counts
    sq = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, (rewards - means[inverse]) ** 2)
    # Bessel correction (torch default); a group of one has no spread: std 0.
    stds = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return means[inverse], stds[inverse]


def centred_rewards(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_i - mean_g, std_g) in float64, with groups whose spread is rounding noise set to
    exactly 0 (see ROUNDING_SPREAD). [N], [N]."""
    mean, std = group_mean_std(rewards, group_ids)
    centred = rewards.double() - mean
    noise = std <= ROUNDING_SPREAD * mean.abs().clamp(min=1.0)
    return torch.where(noise, torch.zeros_like(centred), centred), std


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps); scale_by_std=False gives Dr.GRPO's r_i - mean_g. [N].
    An all-equal group (or one whose spread is rounding noise) gives exactly 0."""
    centred, std = centred_rewards(rewards, group_ids)
    return (centred / (std + eps) if scale_by_std else centred).to(rewards.dtype)


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean_g) (leave-one-out baseline). [N]."""
    centred, _ = centred_rewards(rewards, group_ids)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    size = counts[inverse].double()
    return (centred * size / (size - 1).clamp(min=1.0)).to(rewards.dtype)


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean_g (no std scaling here: the batch whitening that follows scales). [N]."""
    return centred_rewards(rewards, group_ids)[0].to(rewards.dtype)


def token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's score placed on its last valid token; zeros elsewhere. [N], [N, R] -> [N, R].
    Valid tokens need not be a prefix: a multi-turn response has observation tokens between turns."""
    out = torch.zeros(mask.shape, dtype=scores.dtype)
    positions = torch.arange(mask.shape[-1]).expand(mask.shape)  # [N, R]
    last = torch.where(mask > 0, positions, -1).amax(-1) if mask.shape[-1] else torch.full((mask.shape[0],), -1)  # [N]
    rows = torch.nonzero(last >= 0).squeeze(-1)  # an empty response has nowhere to put a score
    out[rows, last[rows]] = scores[rows]
    return out


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over valid tokens, G_{t+1} being the next valid token's: masked
    positions (padding, observation tokens between turns) are skipped, as in GAE. [N, R]."""
    rewards = rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}. [N, R] each.

    V after the last valid token is 0; masked positions are skipped. Returns (A, R = A + V),
    both before any whitening.
    """
    mask = mask.to(rewards.dtype)
    values = values * mask
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        # A padded position passes the running values through unchanged.
        next_adv = torch.where(m > 0, adv_t, next_adv)
        next_value = torch.where(m > 0, values[:, t], next_value)
        advantages[:, t] = adv_t * m
    return advantages, (advantages + values) * mask


def masked_moments(x: torch.Tensor, mask: torch.Tensor, reduce_sum=lambda t: t) -> tuple[float, float, float]:
    """(count, sum, sum of squares) of the valid entries, summed over ranks by `reduce_sum`."""
    mask = mask.to(x.dtype)
    count, total, squares = reduce_sum(torch.stack([mask.sum(), (x * mask).sum(), (x * x * mask).sum()])).tolist()
    return count, total, squares


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, reduce_sum=lambda t: t, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mu) * rsqrt(var + eps) over the valid entries of the global batch. [N, R].

    `reduce_sum` sums a tensor over data-parallel ranks, so every rank whitens with the same
    statistics; var uses Bessel's correction. Two passes (mean, then squared deviations from
    it): the one-pass E[x^2] - mean^2 cancels catastrophically when the mean is large.
    """
    mask = mask.to(x.dtype)
    count, total = reduce_sum(torch.stack([mask.sum(), (x * mask).sum()])).tolist()
    if count < 2:
        return x * mask  # one value has no spread to normalise by
    mean = total / count
    squared_deviations = float(reduce_sum(((x - mean) ** 2 * mask).sum().reshape(1)))
    var = squared_deviations / (count - 1)
    return (x - mean) * torch.rsqrt(torch.tensor(var + eps, dtype=x.dtype)) * mask
