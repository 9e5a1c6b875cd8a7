"""Loss aggregation with explicit global normalisers (docs/algorithms.md, "Loss aggregation").

A micro-batch's loss is divided by a normaliser counted over the *whole* optimizer step (all
micro-batches, all ranks), so the step's gradient does not depend on how it was split.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def normaliser_counts(mask: torch.Tensor, sequences: int | None = None) -> torch.Tensor:
    """(valid tokens, sequences) of one micro-batch as a float tensor [2].

    Summed over the micro-batches and ranks of an optimizer step, it gives the global
    denominators that `aggregate` divides by. `sequences` defaults to every row of the mask
    (an empty response still counts as a sequence); rows left out of the loss are not counted.
    """
    rows = mask.shape[0] if sequences is None else sequences
    return torch.stack([mask.sum().float(), torch.tensor(float(rows))])


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, total_tokens: float, total_seqs: float, max_new_tokens: int,
    counted: torch.Tensor | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the step loss. loss, mask: [B, R]; totals are global.
    `counted` ([B, R], default `mask`): the tokens a sequence's mean divides by, where `mask`
    holds only some of them (sequence parallelism: the tokens this rank scores)."""
    counted = (mask if counted is None else counted).to(loss.dtype)
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / max(total_tokens, 1.0)
    per_seq_sum = (loss * mask).sum(-1)  # [B]
    if mode == "seq-mean-token-mean":
        # An empty sequence contributes 0 (clamp avoids 0/0 -> NaN).
        return (per_seq_sum / counted.sum(-1).clamp(min=1.0)).sum() / max(total_seqs, 1.0)
    if mode == "seq-mean-token-sum":
        return per_seq_sum.sum() / max(total_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return per_seq_sum.sum() / (max(total_seqs, 1.0) * max_new_tokens)
    raise ValueError(f"unknown loss_agg_mode '{mode}'; valid: {', '.join(LOSS_AGG_MODES)}")
