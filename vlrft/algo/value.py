"""Critic math: the clipped value loss and running return statistics (docs/algorithms.md, "Critic")."""

from __future__ import annotations

import math

import torch

from vlrft.algo.advantages import masked_moments

VALUE_NORMS = ("none", "exp", "ma")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) per token; clip 0 = unclipped. [N, R]."""
    plain = (values - returns) ** 2
    if clip <= 0:
        return 0.5 * plain
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped)


class ReturnStats:
    """Running mean/std of returns, so the critic can predict normalised returns (AReaL).

    `exp`: exponential averages of E[x] and E[x^2] with decay `beta`, debiased (so the first
    batch's statistics are used as they are); `ma`: cumulative averages over all batches.
    """

    def __init__(self, mode: str, beta: float = 0.99995, eps: float = 1e-5):
        if mode not in ("exp", "ma"):
            raise ValueError(f"unknown value normalisation '{mode}'; valid: exp, ma")
        self.mode, self.beta, self.eps = mode, beta, eps
        self.mean_acc = self.sq_acc = self.weight = 0.0

    def update(self, x: torch.Tensor, mask: torch.Tensor, reduce_sum=lambda t: t) -> None:
        count, total, squares = masked_moments(x, mask, reduce_sum)
        if count == 0:
            return
        if self.mode == "exp":
            b = self.beta
            self.mean_acc = b * self.mean_acc + (1 - b) * total / count
            self.sq_acc = b * self.sq_acc + (1 - b) * squares / count
            self.weight = b * self.weight + (1 - b)
        else:
            self.mean_acc += total
            self.sq_acc += squares
            self.weight += count

    @property
    def mean(self) -> float:
        return self.mean_acc / self.weight if self.weight else 0.0

    @property
    def std(self) -> float:
        if not self.weight:
            return 1.0
        return max(math.sqrt(max(self.sq_acc / self.weight - self.mean**2, 0.0)), self.eps)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std + self.mean

    def state_dict(self) -> dict:
        return {"mean_acc": self.mean_acc, "sq_acc": self.sq_acc, "weight": self.weight}

    def load_state_dict(self, state: dict) -> None:
        self.mean_acc, self.sq_acc, self.weight = state["mean_acc"], state["sq_acc"], state["weight"]
