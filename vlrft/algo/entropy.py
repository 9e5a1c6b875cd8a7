"""Token entropy, and the high-entropy token mask (docs/algorithms.md, "Entropy")."""

from __future__ import annotations

import math

import torch


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) * z over the last dim. logits [..., V] -> [...].

    Computed on z' = z - max(z) (H does not change under a shift), with logsumexp(z') =
    log1p(sum of exp(z') over all but one maximal entry): for a confident token both terms are
    then small numbers known to full relative precision, instead of two large ones whose
    difference is the tiny entropy (or a log(1 + tiny) rounded in fp32). The max's own term is
    exactly 1 in value but not a constant: `at_max - 1` (0) keeps its gradient in the sum, which
    the shift's detached max would otherwise leave out of the max logit's gradient."""
    logits = logits.float()
    top = logits.max(dim=-1, keepdim=True)
    shifted = logits - top.values.detach()  # [..., V] <= 0, 0 at the max
    exps = torch.exp(shifted)
    at_max = exps.gather(-1, top.indices).squeeze(-1)  # [...] exp(0) = 1
    rest = exps.scatter(-1, top.indices, 0.0).sum(-1) + (at_max - 1.0)  # [...] sum of all terms, less 1
    return torch.log1p(rest) - (exps * shifted).sum(-1) / (1.0 + rest)


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
