"""One critic update: the clipped value loss over the replay buffer, `train.mini_batches`
optimizer steps per epoch (the policy's split)."""

from __future__ import annotations

import torch

from vlrft.algo import aggregate
from vlrft.algo.value import value_loss
from vlrft.backends.base import TrainBackend
from vlrft.models.collate import response_rows
from vlrft.models.value_model import token_values
from vlrft.distributed import device, world_size
from vlrft.trainer.update import (
    UpdateSettings,
    all_reduce_named,
    backward_guarded,
    loss_mask,
    sample_rows,
    scored_mask,
    drop_bad_micro_batches,
    step_normalisers,
    step_or_skip,
)


def critic_update(backend: TrainBackend, buffer, settings: UpdateSettings, image_check=None) -> dict[str, float]:
    metrics: dict[str, float] = {}
    skipped_steps = 0  # optimizer steps skipped for a non-finite value loss
    plan = [mb for _ in range(settings.epochs) for mb in buffer.mini_batches(settings.mini_batches, shuffle=True)]
    for batches in plan:
        batches, _ = drop_bad_micro_batches(batches, image_check)
        if not batches:
            continue
        total_tokens, total_seqs = step_normalisers(batches)
        here = device()
        sums = {name: torch.zeros((), device=here) for name in ("value_loss", "values", "returns", "squared_error")}
        nonfinite = 0
        for i, batch in enumerate(batches):
            mask = scored_mask(batch, here)  # [S, R] (sequence parallelism: this rank's shard's tokens)
            values = response_rows(batch, token_values(backend.model, batch))  # [S, R]
            old = sample_rows(batch, "values", here)  # [S, R]
            returns = sample_rows(batch, "returns", here)  # [S, R]
            per_token = value_loss(values, old, returns, settings.value_clip)
            loss = aggregate(per_token, mask, settings.loss_agg_mode, total_tokens, total_seqs, settings.max_response_tokens,
                             counted=loss_mask(batch, here))
            nonfinite += not backward_guarded(backend, loss, values, world_size(), boundary=i == len(batches) - 1)
            with torch.no_grad():
                sums["value_loss"] += loss
                sums["values"] += (values * mask).sum()
                sums["returns"] += (returns * mask).sum()
                sums["squared_error"] += ((values - returns) ** 2 * mask).sum()
        grad_norm = step_or_skip(backend, nonfinite, "critic")
        if grad_norm is None:
            skipped_steps += 1
            continue
        totals = all_reduce_named(sums)
        tokens = max(total_tokens, 1.0)
        metrics = {
            "critic/value_loss": totals["value_loss"],
            "critic/values_mean": totals["values"] / tokens,
            "critic/returns_mean": totals["returns"] / tokens,
            "critic/mse": totals["squared_error"] / tokens,
            "critic/grad_norm": grad_norm,
        }
    metrics["critic/skipped_nonfinite_steps"] = float(skipped_steps)
    return metrics
