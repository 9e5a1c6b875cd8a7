"""Token entropy, and the high-entropy token mask (ALGORITHMS.md, "Entropy")."""

from __future__ import annotations

import math

import torch


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) * z over the last dim. logits [..., V] -> [...]."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def entropy_threshold(valid_entropies: torch.Tensor, ratio: float) -> torch.Tensor:
    """The k-th largest entropy, k = max(1, ceil(ratio * N)), over all valid tokens (all ranks)."""
    n = valid_entropies.numel()
    if n == 0:
        return torch.tensor(float("inf"))
    k = min(n, max(1, math.ceil(ratio * n)))
    return torch.topk(valid_entropies, k).values[-1]


def high_entropy_mask(entropy: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """1 where the token's entropy reaches the threshold (ties kept), else 0. Same shape."""
    return (entropy.detach() >= threshold).to(entropy.dtype)
