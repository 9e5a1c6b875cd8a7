"""One critic update: the clipped value loss over the replay buffer, `train.mini_batches`
optimizer steps per epoch (the policy's split)."""

from __future__ import annotations

import torch

from vlrft.algo import aggregate
from vlrft.algo.value import value_loss
from vlrft.backends.base import TrainBackend
from vlrft.config import Config
from vlrft.models.collate import response_rows
from vlrft.models.value_model import token_values
from vlrft.distributed import all_reduce_sum, device
from vlrft.trainer.update import (
    backward_guarded,
    loss_mask,
    sample_rows,
    drop_bad_micro_batches,
    step_normalisers,
    step_or_skip,
)


def critic_update(backend: TrainBackend, buffer, cfg: Config, world_size: int, image_check=None) -> dict[str, float]:
    metrics: dict[str, float] = {}
    skipped_steps = 0  # optimizer steps skipped for a non-finite value loss
    plan = [mb for _ in range(cfg.train.ppo_epochs) for mb in buffer.mini_batches(cfg.train.mini_batches, shuffle=True)]
    for batches in plan:
        batches, _ = drop_bad_micro_batches(batches, image_check)
        if not batches:
            continue
        total_tokens, total_seqs = step_normalisers(batches)
        here = device()
        sums = torch.zeros(4, device=here)  # loss share, token sums of: values, returns, squared error
        nonfinite = 0
        for i, batch in enumerate(batches):
            mask = loss_mask(batch, here)  # [S, R]
            values = response_rows(batch, token_values(backend.model, batch))  # [S, R]
            old = sample_rows(batch, "values", here)  # [S, R]
            returns = sample_rows(batch, "returns", here)  # [S, R]
            per_token = value_loss(values, old, returns, cfg.critic.value_clip)
            loss = aggregate(per_token, mask, cfg.algo.loss_agg_mode, total_tokens, total_seqs, cfg.rollout.max_response_tokens())
            nonfinite += not backward_guarded(backend, loss, values, world_size, boundary=i == len(batches) - 1)
            with torch.no_grad():
                sums += torch.stack([loss, (values * mask).sum(), (returns * mask).sum(), ((values - returns) ** 2 * mask).sum()])
        grad_norm = step_or_skip(backend, nonfinite, "critic")
        if grad_norm is None:
            skipped_steps += 1
            continue
        sums = all_reduce_sum(sums)
        tokens = max(total_tokens, 1.0)
        metrics = {
            "critic/value_loss": float(sums[0]),
            "critic/values_mean": float(sums[1]) / tokens,
            "critic/returns_mean": float(sums[2]) / tokens,
            "critic/mse": float(sums[3]) / tokens,
            "critic/grad_norm": grad_norm,
        }
    metrics["critic/skipped_nonfinite_steps"] = float(skipped_steps)
    return metrics
