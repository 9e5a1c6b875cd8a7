"""Per-token KL estimators between the policy and the reference (docs/algorithms.md, "KL")."""

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


# The exact KL over the vocabulary needs both models' logits, not just the sampled tokens'
# logprobs, so it is not in the registry of per-token estimators above.
FULL_KL = "full"


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """sum_v pi(v) (log pi(v) - log pi_ref(v)) per position, from [..., V] logits. [...].

    Computed over chunks of positions, so at most one chunk of [chunk, V] softmax exists at a
    time besides the logits themselves.
    """
    flat, ref_flat = logits.reshape(-1, logits.shape[-1]), ref_logits.reshape(-1, ref_logits.shape[-1])
    out = []
    for start in range(0, flat.shape[0], chunk_size):
        logp = torch.log_softmax(flat[start : start + chunk_size].float(), dim=-1)
        ref_logp = torch.log_softmax(ref_flat[start : start + chunk_size].float(), dim=-1)
        out.append((logp.exp() * (logp - ref_logp)).sum(-1))
    return (torch.cat(out) if out else flat.new_zeros(0)).reshape(logits.shape[:-1])


class FixedKLController:
    def __init__(self, coef: float):
        self.coef = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = state["coef"]


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. (arXiv 1909.08593): beta <- beta * (1 + clip(KL/target - 1, +-0.2) * n / horizon)."""

    def __init__(self, coef: float, target: float, horizon: int):
        super().__init__(coef)
        self.target, self.horizon = target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * n_steps / self.horizon
