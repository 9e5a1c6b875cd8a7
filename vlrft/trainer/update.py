"""One policy update: epochs over the replay buffer, micro-batch accumulation, one step per epoch."""

from __future__ import annotations

import torch

from vlrft.algo import KL_ESTIMATORS, aggregate, normaliser_counts
from vlrft.algo.entropy import entropy_threshold, high_entropy_mask
from vlrft.algo.losses import policy_loss
from vlrft.backends.base import TrainBackend
from vlrft.config import Config
from vlrft.experience.collate import scatter_responses
from vlrft.experience.replay_buffer import ReplayBuffer, pad_micro_batch_count
from vlrft.models.forward import token_logprobs
from vlrft.trainer.distributed import all_gather_1d, all_reduce_max_int, all_reduce_sum


def policy_update(backend: TrainBackend, buffer: ReplayBuffer, cfg: Config, world_size: int) -> dict[str, float]:
    algo = cfg.algo
    kl_fn = KL_ESTIMATORS.get(algo.kl.estimator)
    metrics: dict[str, float] = {}
    need_entropy = algo.entropy_coef > 0 or algo.high_entropy_token_ratio > 0
    for _ in range(cfg.train.ppo_epochs):
        batches = buffer.micro_batches(shuffle=True)
        batches = pad_micro_batch_count(batches, all_reduce_max_int(len(batches)), buffer.pad_id)
        # Global denominators of this optimizer step: all micro-batches, all ranks.
        local = sum(normaliser_counts(b.response_mask) for b in batches if not b.dummy)
        total_tokens, total_seqs = all_reduce_sum(local).tolist()
        step_loss = torch.zeros(1)  # sum of micro-batch shares = this step's loss
        sums = torch.zeros(5)  # token sums of: pg loss, kl, clip hits, ratio, entropy
        for i, batch in enumerate(batches):
            mask = batch.response_mask.float() * (0.0 if batch.dummy else 1.0)  # [B, L]
            if need_entropy:
                logp, entropy = token_logprobs(backend.model, batch, cfg.rollout.temperature, with_entropy=True)
            else:
                logp = token_logprobs(backend.model, batch, cfg.rollout.temperature)  # [B, L]
                entropy = torch.zeros_like(logp)
            old = scatter_responses(batch, [e.old_logprobs for e in batch.samples])  # [B, L]
            adv = scatter_responses(batch, [e.advantages for e in batch.samples])  # [B, L]
            pg, clip_hit = policy_loss(
                algo.policy_loss, logp, old, adv, mask, algo.clip_eps_low, algo.clip_eps_high, algo.dual_clip_c
            )
            if algo.high_entropy_token_ratio > 0:
                # Threshold over this micro-batch's valid tokens on every rank; only the
                # policy-gradient term is masked, the denominator stays the full token count.
                valid = all_gather_1d(entropy.detach()[mask.bool()])
                pg = pg * high_entropy_mask(entropy, entropy_threshold(valid, algo.high_entropy_token_ratio))
            token_loss = pg - algo.entropy_coef * entropy
            kl = torch.zeros_like(pg)
            if algo.kl.coef > 0:
                ref = scatter_responses(batch, [e.ref_logprobs for e in batch.samples])  # [B, L]
                kl = kl_fn(logp, ref)
                token_loss = token_loss + algo.kl.coef * kl
            loss = aggregate(
                token_loss, mask, algo.loss_agg_mode, total_tokens, total_seqs, cfg.rollout.max_new_tokens
            )
            # DeepSpeed averages gradients over ranks; the loss is already globally normalised.
            backend.backward(loss * world_size, boundary=i == len(batches) - 1)
            with torch.no_grad():
                ratio = torch.exp((logp - old).clamp(-20, 20))
                step_loss += loss
                sums += torch.stack(
                    [(pg * mask).sum(), (kl * mask).sum(), (clip_hit * mask).sum(), (ratio * mask).sum(), (entropy * mask).sum()]
                )
        grad_norm = backend.step()
        sums = all_reduce_sum(sums) / max(total_tokens, 1.0)  # token means
        metrics = {
            "train/loss": float(all_reduce_sum(step_loss)),
            "train/pg_loss": float(sums[0]),
            "train/kl": float(sums[1]),
            "train/clip_frac": float(sums[2]),
            "train/ratio_mean": float(sums[3]),
            **({"train/entropy": float(sums[4])} if need_entropy else {}),
            "train/grad_norm": grad_norm,
        }
    return metrics
