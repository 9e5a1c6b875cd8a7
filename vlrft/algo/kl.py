"""Per-token KL estimators between the policy and the reference (ALGORITHMS.md, "KL")."""

from __future__ import annotations

import torch

from vlrft.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("abs")
def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return (logp - ref_logp).abs()


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """exp(-d) + d - 1 with d = logp - ref_logp: unbiased, non-negative (Schulman's k3)."""
    d = (logp - ref_logp).clamp(-20.0, 20.0)
    return (torch.exp(-d) + d - 1.0).clamp(max=10.0)
