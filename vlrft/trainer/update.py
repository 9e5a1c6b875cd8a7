"""One policy update: epochs over the replay buffer, each split into `train.mini_batches`
optimizer steps, with micro-batch accumulation inside each step."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vlrft.algo import KL_ESTIMATORS, aggregate, normaliser_counts
from vlrft.algo.entropy import entropy_threshold, high_entropy_mask
from vlrft.algo.correction import correction_weights
from vlrft.algo.cov_control import kl_cov_terms
from vlrft.algo.distill import distill_loss_terms, top_k_jsd
from vlrft.algo.kl import FULL_KL, full_kl
from vlrft.algo.losses import LossSettings, policy_loss
from vlrft.algo.shaping import approx_kl, should_stop_early
from vlrft.backends.base import TrainBackend
from vlrft.console import say
from vlrft.experience.maker import CorrectionSettings
from vlrft.models.collate import (
    engine_logprob_rows, gather_responses, pad_rows, response_rows, rollout_of, scatter_responses,
)
from vlrft.metrics.flops import FlopCount, throughput_metrics
from vlrft.models.packing import micro_batches
from vlrft.models.sequence_parallel import combine, local_tokens, run_shard
from vlrft.models.forward import policy_forward
from vlrft.distributed import all_gather_1d, all_reduce_sum, device, rank, world_size
from vlrft.types import MicroBatch, Rollout


@dataclass(frozen=True)
class UpdateSettings:
    """Everything the policy and critic updates read (trainer/build.update_settings makes it
    from the config; the key each field comes from is named beside it)."""

    epochs: int  # train.ppo_epochs
    mini_batches: int  # train.mini_batches: optimizer steps per epoch
    micro_batch_tokens: int  # train.micro_batch_tokens
    temperature: float  # rollout.temperature: logprobs are of the sampling distribution
    max_response_tokens: int  # rollout's longest response: seq-mean-token-sum-norm's constant
    policy_loss: str  # algo.policy_loss
    loss: LossSettings  # algo.clip_eps_low/high, dual_clip_c, sapo_tau_pos/neg
    loss_agg_mode: str  # algo.loss_agg_mode
    kl_in_loss: bool  # algo.kl.placement == "loss" (active while the KL coefficient is > 0)
    kl_estimator: str  # algo.kl.estimator (FULL_KL: against the reference's logits)
    correction: CorrectionSettings  # algo.rollout_correction*
    entropy_coef: float = 0.0  # algo.entropy_coef
    high_entropy_token_ratio: float = 0.0  # algo.high_entropy_token_ratio
    moe_aux_coef: float = 0.0  # algo.moe_aux_coef
    ptx_coef: float = 0.0  # algo.ptx_coef
    early_stop_ratio: float = 0.0  # algo.early_stop_ratio
    target_kl: float = 0.0  # algo.target_kl
    value_clip: float = 0.2  # critic.value_clip
    distill_loss_coef: float = 0.0  # algo.distill.coef with a teacher and algo.distill.mode loss; else 0
    distill_jsd_coef: float = 0.0  # algo.distill.coef with a teacher and algo.distill.mode jsd; else 0
    distill_jsd_beta: float = 0.5  # algo.distill.beta
    kl_cov_ratio: float = 0.0  # algo.kl_cov_ratio
    kl_cov_coef: float = 1.0  # algo.kl_cov_coef

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef > 0 or self.high_entropy_token_ratio > 0


# The per-step sums the policy update all-reduces in one collective, by metric name.
POLICY_SUMS = ("pg_loss", "kl", "clip_frac", "ratio_mean", "entropy", "ptx_nll", "moe_aux_loss", "distill_jsd", "model_flops",
               "tokens")


def all_reduce_named(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sum each named scalar over the ranks, in one collective."""
    totals = all_reduce_sum(torch.stack([sums[name].reshape(()) for name in sums])).tolist()
    return dict(zip(sums, totals))


def loss_mask(batch: MicroBatch, on: torch.device | str = "cpu") -> torch.Tensor:
    """Response tokens that count in the loss, in the loss layout (a row per sample, responses
    left-aligned): not padding, not dummies, not masked out, not an environment's observation
    (multi-turn). [S, R] on `on`."""
    keep = [0.0 if batch.dummy else float(getattr(s, "in_loss", True)) for s in batch.samples]
    return pad_rows([rollout_of(s).trained_mask() * k for s, k in zip(batch.samples, keep)], device=on)


def scored_mask(batch: MicroBatch, on: torch.device | str = "cpu") -> torch.Tensor:
    """`loss_mask` at the tokens this rank scores: all of them, or with sequence parallelism its
    shard's (every token's loss and sums counted once in the group). [S, R] on `on`."""
    mask = loss_mask(batch, on)
    if run_shard() is None:
        return mask
    local = local_tokens(batch.input_ids.shape[1], run_shard(), on)[None].to(mask.dtype)  # [1, T]
    return mask * response_rows(batch, local)


def sample_rows(batch: MicroBatch, field: str, on: torch.device | str = "cpu") -> torch.Tensor:
    """A per-token Experience field ([R_i] each, kept on the CPU between the experience pass
    and the update) in the loss layout, moved to `on` in one copy. [S, R]."""
    return pad_rows([getattr(e, field) for e in batch.samples], device=on)


def teacher_top_k(batch: MicroBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Distillation's jsd mode: the teacher's top-k ids of each response token in the batch's
    layout ([B, L, k], for the forward) and their teacher logprobs per sample ([R_i, k] each).
    An empty response (a placeholder, a dummy) has none: [0, k]."""
    k = next((e.teacher_topk_ids.shape[1] for e in batch.samples if getattr(e, "teacher_topk_ids", None) is not None), 1)

    def rows(field: str, dtype: torch.dtype) -> list[torch.Tensor]:
        return [getattr(e, field) if len(rollout_of(e).response_ids) else torch.zeros(0, k, dtype=dtype) for e in batch.samples]

    return scatter_responses(batch, rows("teacher_topk_ids", torch.int32)), rows("teacher_topk_logprobs", torch.float32)


def keep_policy_terms(batch: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """Store the update forward's logprobs and entropy ([B, L], detached) as the samples' old
    logprobs and entropy (the batch feeds one optimizer step: the rollout policy is the one
    being updated), kept on the CPU like the experience pass's. Returns the logprobs, whole
    (with sequence parallelism, summed over the group)."""
    if batch.dummy:
        return logp
    logp, entropy = combine(logp), combine(entropy)  # (every rank of the group)
    if not batch.owned:
        return logp
    for sample, old, h in zip(batch.samples, gather_responses(batch, logp, "cpu"), gather_responses(batch, entropy, "cpu")):
        sample.old_logprobs, sample.entropy = old, h
    return logp


def drop_bad_micro_batches(batches: list[MicroBatch], check) -> tuple[list[MicroBatch], int]:
    """Remove micro-batches that would crash the forward (a sample's image tokens do not match
    its pixel patches). The decision is all-reduced: a micro-batch index bad on any rank is
    skipped on every rank, so the ranks keep running the same collectives."""
    if check is None:
        return batches, 0
    local = torch.zeros(len(batches))
    for i, batch in enumerate(batches):
        problem = None if batch.dummy else check.first_problem(batch.samples)
        if problem is not None:
            say(f"vlrft: skipping a micro-batch: {problem}")
            local[i] = 1.0
    bad = (all_reduce_sum(local) > 0).tolist()
    return [b for b, skip in zip(batches, bad) if not skip], int(sum(bad))


def backward_guarded(backend: TrainBackend, loss: torch.Tensor, anchor: torch.Tensor, scale: float, boundary: bool) -> bool:
    """Backward of one micro-batch's loss; False when the loss is not finite. Then `anchor`
    (a tensor wired through the model, e.g. its logprobs) times NaN is backpropagated instead:
    the step's gradients are certainly non-finite, which `step_or_skip` needs, and this rank
    makes the same backward (and gradient collectives) as its peers."""
    finite = bool(torch.isfinite(loss.detach()).all())
    backend.backward((loss if finite else anchor.sum() * float("nan")) * scale, boundary=boundary)
    return finite


def step_or_skip(backend: TrainBackend, nonfinite: int, what: str) -> float | None:
    """The optimizer step, unless some rank had a non-finite micro-batch loss in it (`nonfinite`
    on this rank; all-reduced, so every rank steps or skips together). A skipped step drops
    the gradients and leaves parameters, optimizer state and lr schedule as they were.
    Returns the gradient norm, or None when skipped."""
    per_rank = torch.zeros(world_size())
    per_rank[rank()] = nonfinite
    per_rank = all_reduce_sum(per_rank)  # [world] non-finite micro-batch losses per rank
    if per_rank.sum() == 0:
        return backend.step()
    backend.skip_step()
    if rank() == 0:
        ranks = ", ".join(str(r) for r in per_rank.nonzero().flatten().tolist())
        say(
            f"vlrft: skipped a {what} optimizer step: non-finite loss in {int(per_rank.sum())} micro-batch(es) "
            f"on rank {ranks}; parameters and optimizer state unchanged",
        )
    return None


def step_normalisers(batches: list[MicroBatch]) -> tuple[float, float]:
    """(valid tokens, sequences) in the loss over all micro-batches and all ranks (each counted
    by the rank that owns it)."""
    local = torch.zeros(2)
    for b in batches:
        if not b.dummy and b.owned:
            local += normaliser_counts(loss_mask(b), sequences=sum(getattr(s, "in_loss", True) for s in b.samples))
    total_tokens, total_seqs = all_reduce_sum(local).tolist()
    return total_tokens, total_seqs


@torch.no_grad()
def policy_drift(model, batches: list[MicroBatch], temperature: float) -> tuple[float, float]:
    """Mean importance ratio and approximate KL to the rollout policy over all valid tokens."""
    here = device()
    sums = torch.zeros(3, device=here)
    for batch in batches:
        mask = scored_mask(batch, here)  # [S, R]
        logp = response_rows(batch, policy_forward(model, batch, temperature).logp)  # [S, R]
        old = sample_rows(batch, "old_logprobs", here)  # [S, R]
        ratio = torch.exp((logp - old).clamp(-20, 20))
        sums += torch.stack([(ratio * mask).sum(), (approx_kl(logp, old) * mask).sum(), mask.sum()])
    ratio_sum, kl_sum, count = all_reduce_sum(sums).tolist()
    return ratio_sum / max(count, 1.0), kl_sum / max(count, 1.0)


def ptx_batches(examples: list[Rollout], micro_batch_tokens: int) -> tuple[list[MicroBatch], float]:
    """This step's supervised micro-batches (same count on every rank) and the global token count."""
    batches = micro_batches(examples, micro_batch_tokens)
    if not batches:
        return [], 0.0
    tokens = all_reduce_sum(torch.tensor([sum(loss_mask(b).sum() for b in batches if b.owned)], dtype=torch.float32))
    return batches, float(tokens)


def policy_update(
    backend: TrainBackend,
    buffer,
    settings: UpdateSettings,
    kl_coef: float = 0.0,
    reference: torch.nn.Module | None = None,
    ptx: list[Rollout] = (),
    image_check=None,
    old_from_update: bool = False,
) -> dict[str, float]:
    """`ppo_epochs` passes over the buffer, `train.mini_batches` optimizer steps each. `kl_coef`
    is the controller's current beta (used when the KL is in the loss); `ptx` are this rank's
    supervised examples for the step (in every optimizer step); `image_check` (an
    ImageTokenCheck) guards each micro-batch before its forward. Step metrics are the last
    optimizer step's. Without the experience pass's policy forward (`old_from_update`, one
    optimizer step per batch) the forward here fills each sample's old logprobs and entropy."""
    metrics: dict[str, float] = {}
    epochs_run = skipped = nonfinite = steps = 0
    started, counter, work = time.perf_counter(), FlopCount.of(backend.module), {"model_flops": 0.0, "tokens": 0.0}
    extra, ptx_tokens = ptx_batches(list(ptx), settings.micro_batch_tokens)  # the same in every step
    for epoch in range(settings.epochs):
        mini_batches = []
        for batches in buffer.mini_batches(settings.mini_batches, shuffle=True):
            batches, bad = drop_bad_micro_batches(batches, image_check)
            skipped += bad
            mini_batches.append(batches)
        if epoch > 0 and (settings.early_stop_ratio > 0 or settings.target_kl > 0):
            ratio, kl = policy_drift(backend.model, [b for mb in mini_batches for b in mb], settings.temperature)
            metrics |= {"train/drift_ratio": ratio, "train/drift_kl": kl}
            if should_stop_early(ratio, kl, settings.early_stop_ratio, settings.target_kl):
                break
        for batches in mini_batches:
            if not batches:
                continue
            step_metrics = _one_step(backend, batches, extra, ptx_tokens, settings, kl_coef, reference, old_from_update, counter)
            nonfinite += 0 if step_metrics else 1  # a skipped step has no loss metrics
            for name in work:
                work[name] += step_metrics.pop(name, 0.0)
            metrics |= step_metrics
            steps += 1
        epochs_run += any(mini_batches)
    metrics["train/epochs_run"] = float(epochs_run)
    metrics["train/optimizer_steps"] = float(steps)
    metrics["train/skipped_micro_batches"] = float(skipped)
    metrics["train/skipped_nonfinite_steps"] = float(nonfinite)
    return metrics | update_throughput(work["model_flops"], work["tokens"], started)


def update_throughput(flops: float, tokens: float, started: float) -> dict[str, float]:
    """Tokens per second per GPU and MFU of the update (metrics/flops.py), on CUDA."""
    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()  # the update's kernels finished, not only launched
    return throughput_metrics(flops, tokens, time.perf_counter() - started, world_size(), torch.cuda.get_device_name())


def behaviour_rows(samples: list, old: torch.Tensor) -> torch.Tensor:
    """The engine's logprob of each response token, [S, R] like `old`; a sample whose engine
    reported none (the step API's responses, a placeholder) keeps its `old` row."""
    engine = engine_logprob_rows(samples, old.shape[1], device=old.device)
    reported = torch.tensor([rollout_of(s).logprobs is not None for s in samples], device=old.device)
    return torch.where(reported[:, None], engine, old)


def _one_step(backend, batches, ptx, ptx_tokens, settings: UpdateSettings, kl_coef, reference, old_from_update,
              counter: FlopCount) -> dict[str, float]:
    """One optimizer step over the micro-batches; its metrics, or {} when it was skipped for a
    non-finite loss. `old_from_update`: the old logprobs are this forward's own, detached.
    `counter` counts the step's model FLOPs and tokens (all ranks: `model_flops`, `tokens`)."""
    temperature = settings.temperature
    kl_in_loss = kl_coef > 0 and settings.kl_in_loss
    full = settings.kl_estimator == FULL_KL
    correction = settings.correction
    total_tokens, total_seqs = step_normalisers(batches)  # global denominators of this step
    work = [(False, b) for b in batches] + [(True, b) for b in ptx]
    here = device()  # the loss and its sums stay on the rank's device
    step_loss = torch.zeros(1, device=here)  # sum of micro-batch shares = this step's loss
    sums = {name: torch.zeros((), device=here) for name in POLICY_SUMS}  # token sums, except ptx_nll, moe_aux_loss and the work counts
    nonfinite = 0  # micro-batches of this step whose loss was NaN or infinite
    for i, (is_ptx, batch) in enumerate(work):
        mask = scored_mask(batch, here)  # [S, R] the loss layout: a row per sample, responses left-aligned
        # A rank runs 1/N of each micro-batch of its sequence-parallel group.
        shards = run_shard().size if run_shard() is not None else 1
        sums["model_flops"] += counter.micro_batch(batch) / shards
        row_tokens = batch.input_ids.numel() if batch.attention_mask is None else float(batch.attention_mask.sum())
        sums["tokens"] += row_tokens / shards
        jsd = settings.distill_jsd_coef > 0 and not is_ptx
        top_ids, teacher_top = teacher_top_k(batch) if jsd else (None, None)
        # The supervised term is the NLL of the model itself: no sampling temperature.
        out = policy_forward(
            backend.model,
            batch,
            1.0 if is_ptx else temperature,
            moe_aux=settings.moe_aux_coef > 0 and not is_ptx,
            keep_logits=kl_in_loss and full and not is_ptx,
            top_ids=top_ids,
        )
        logp = response_rows(batch, out.logp)  # [S, R]
        if is_ptx:
            nll = -(logp * mask).sum() / max(ptx_tokens, 1.0)
            loss = settings.ptx_coef * nll
            sums["ptx_nll"] += nll.detach()
        else:
            entropy = response_rows(batch, out.entropy) if settings.needs_entropy else torch.zeros_like(logp)  # [S, R]
            if old_from_update:
                # [S, R] the ratio is exactly 1; whole rows: a sequence's correction weight reads them all
                old = response_rows(batch, keep_policy_terms(batch, out.logp.detach(), out.entropy.detach()))
            else:
                old = sample_rows(batch, "old_logprobs", here)  # [S, R]
            if correction.mode == "behaviour":  # the ratio against the policy that sampled (algo/correction.py)
                old = behaviour_rows(batch.samples, old)
            adv = sample_rows(batch, "advantages", here)  # [S, R]
            pg, clip_hit = policy_loss(settings.policy_loss, logp, old, adv, mask, settings.loss)
            if correction.mode not in ("none", "behaviour"):  # engine-mismatch weights (algo/correction.py)
                if old_from_update:
                    weights = correction_weights(
                        old, engine_logprob_rows(batch.samples, device=here), loss_mask(batch, here), correction.mode,
                        correction.cap, correction.low, correction.high,
                    )
                else:
                    weights = sample_rows(batch, "correction", here)
                pg = pg * weights
            if settings.high_entropy_token_ratio > 0:
                # Threshold over this micro-batch's valid tokens on every rank; only the
                # policy-gradient term is masked, the denominator stays the full token count.
                valid = all_gather_1d(entropy.detach()[mask.bool()])
                pg = pg * high_entropy_mask(entropy, entropy_threshold(valid, settings.high_entropy_token_ratio))
            token_loss = pg - settings.entropy_coef * entropy
            if settings.kl_cov_ratio > 0:  # KL-Cov entropy control (algo/cov_control.py)
                token_loss = token_loss + kl_cov_terms(logp, old, adv, mask, settings.kl_cov_ratio, settings.kl_cov_coef,
                                                       all_gather_1d)
            kl = torch.zeros_like(pg)
            if kl_in_loss:
                if full:
                    with torch.no_grad():
                        ref_logits = policy_forward(reference, batch, temperature, keep_logits=True).logits
                    kl = response_rows(batch, torch.nn.functional.pad(full_kl(out.logits, ref_logits), (1, 0)))
                else:
                    kl = KL_ESTIMATORS.get(settings.kl_estimator)(logp, sample_rows(batch, "ref_logprobs", here))  # [S, R]
                token_loss = token_loss + kl_coef * kl
            if settings.distill_loss_coef > 0:  # on-policy distillation as a loss term (algo/distill.py)
                teacher = sample_rows(batch, "teacher_logprobs", here)  # [S, R]
                token_loss = token_loss + distill_loss_terms(logp, teacher, settings.distill_loss_coef)
            if jsd:  # over the teacher's top-k tokens at each position (algo/distill.py)
                divergence = top_k_jsd(response_rows(batch, out.top_logp), pad_rows(teacher_top, logp.shape[1], here),
                                       settings.distill_jsd_beta)  # [S, R]
                token_loss = token_loss + settings.distill_jsd_coef * divergence
                sums["distill_jsd"] += (divergence.detach() * mask).sum()
            loss = aggregate(token_loss, mask, settings.loss_agg_mode, total_tokens, total_seqs, settings.max_response_tokens,
                             counted=loss_mask(batch, here))
            if out.aux_loss is not None:
                # The router loss is per forward: weight it by this micro-batch's token share.
                share = mask.sum() / max(total_tokens, 1.0)
                loss = loss + settings.moe_aux_coef * out.aux_loss * share
                sums["moe_aux_loss"] += out.aux_loss.detach() * share
            with torch.no_grad():
                ratio = torch.exp((logp - old).clamp(-20, 20))
                for name, per_token in (("pg_loss", pg), ("kl", kl), ("clip_frac", clip_hit), ("ratio_mean", ratio), ("entropy", entropy)):
                    sums[name] += (per_token * mask).sum()
        # DeepSpeed averages gradients over ranks; the loss is already globally normalised.
        nonfinite += not backward_guarded(backend, loss, out.logp, world_size(), boundary=i == len(work) - 1)
        step_loss += loss.detach()
    grad_norm = step_or_skip(backend, nonfinite, "policy")
    if grad_norm is None:
        return {}
    totals = all_reduce_named(sums | {"loss": step_loss})
    tokens = max(total_tokens, 1.0)
    metrics = {
        "train/loss": totals["loss"],
        "train/pg_loss": totals["pg_loss"] / tokens,
        "train/clip_frac": totals["clip_frac"] / tokens,
        "train/ratio_mean": totals["ratio_mean"] / tokens,
        "train/grad_norm": grad_norm,
        "model_flops": totals["model_flops"],  # summed over the steps by policy_update
        "tokens": totals["tokens"],
    }
    if kl_in_loss:
        metrics["train/kl"] = totals["kl"] / tokens
    if settings.needs_entropy:
        metrics["train/entropy"] = totals["entropy"] / tokens
    if ptx:
        metrics["train/ptx_nll"] = totals["ptx_nll"]
    if settings.moe_aux_coef > 0:
        metrics["train/moe_aux_loss"] = totals["moe_aux_loss"]
    if settings.distill_jsd_coef > 0:
        metrics["train/distill_jsd"] = totals["distill_jsd"] / tokens
    return metrics
