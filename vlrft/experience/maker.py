"""FastExperienceMaker: prompts -> rollouts -> rewards, then old/ref logprobs, values and
advantages in one pass over micro-batches."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from vlrft.algo.correction import correction_weights, mismatch_sums
from vlrft.algo.estimate import AdvantageOptions, estimate_advantages
from vlrft.algo.kl import FULL_KL, KL_ESTIMATORS, full_kl
from vlrft.algo.shaping import best_of_n
from vlrft.algo.value import ReturnStats
from vlrft.data.dataset import user_text
from vlrft.engines.base import RolloutEngine, SamplingParams
from vlrft.experience.checks import ImageTokenCheck
from vlrft.experience.distillation import DistillSettings, distill_experiences
from vlrft.models.collate import engine_logprob_rows, gather_responses, pad_rows
from vlrft.models.packing import micro_batches
from vlrft.models.remote_teacher import RemoteTeacher
from vlrft.models.forward import policy_forward, teacher_scores
from vlrft.models.value_model import token_values
from vlrft.models.sequence_parallel import combine
from vlrft.multiturn.in_flight import InFlight
from vlrft.multiturn.rollout import MultiTurn, multi_turn_steps
from vlrft.rewards.mix import RewardMix
from vlrft.distributed import all_gather_1d, all_reduce_max_int, all_reduce_sum
from vlrft.types import Experience, Prompt, Rollout


def sample_fields(prompt: Prompt) -> dict:
    """What a reward recipe sees of a completion's row (docs/reward_recipes.md lists the keys)."""
    return {
        "id": prompt.id,
        "answer": prompt.answer,
        "data_source": prompt.data_source,
        "meta": prompt.meta,
        "messages": prompt.messages,
        "prompt": user_text(prompt.messages),
        "images": prompt.images,
    }


def completion_fields(rollout: Rollout) -> dict:
    """The row's fields plus the response itself (for length- and token-aware recipes)."""
    return sample_fields(rollout.prompt) | {
        "response_ids": rollout.response_ids,
        "response_length": len(rollout.response_ids),
        "truncated": rollout.truncated,
        "turns": rollout.turns,  # multi-turn: [{"action", "observation", "reward"(, "error")}]
        "environment_reward": sum(turn["reward"] for turn in rollout.turns),
    }


@dataclass
class KLSettings:
    estimator: str = "k3"  # a KL_ESTIMATORS name or "full"
    placement: str = "loss"  # reward: beta * kl_t is subtracted from the token rewards here
    coef: Callable[[], float] = lambda: 0.0  # the controller's current beta


@dataclass
class CorrectionSettings:
    mode: str = "none"  # none | tis | mis | icepop (algo/correction.py)
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0


@dataclass
class MakerSettings:
    sampling: SamplingParams  # n = responses generated per prompt
    keep_per_prompt: int  # best-of-n keeps this many per prompt (== sampling.n: keep all)
    micro_batch_tokens: int
    share_prompts: bool = False  # each prompt once per micro-batch (models/packing.pack)
    advantages: AdvantageOptions = field(default_factory=AdvantageOptions)
    kl: KLSettings = field(default_factory=KLSettings)
    mask_truncated: bool = False
    image_check: ImageTokenCheck | None = None  # drops samples whose image tokens mismatch their pixels
    correction: CorrectionSettings = field(default_factory=CorrectionSettings)
    # False when the batch feeds exactly one optimizer step (trainer/build.py): the old policy
    # is then the one being updated, so the update's own forward supplies the old logprobs and
    # entropy (ratio exactly 1) and `policy_metrics` runs after it; this pass skips the policy.
    policy_pass: bool = True
    multi_turn: MultiTurn | None = None  # an environment answers each turn (None: one turn)
    distill: DistillSettings | None = None  # on-policy distillation (with a teacher)


def engine_reports_logprobs(rollouts: list[Rollout]) -> bool:
    """Whether the engine returned its own logprobs. One engine kind per run, but a rank may
    have no rollouts (all its prompts skipped): every rank asks, so all agree (collective)."""
    return bool(all_reduce_max_int(int(bool(rollouts) and rollouts[0].logprobs is not None)))


def token_metrics(rollouts: list[Rollout], entropy: list[torch.Tensor]) -> dict[str, float]:
    """Global mean entropy of the rollout policy over the tokens it generated."""
    masks = [r.trained_mask() for r in rollouts]
    tokens = float(sum(m.sum() for m in masks))
    sums = all_reduce_sum(torch.tensor([float(sum((h * m).sum() for h, m in zip(entropy, masks))), tokens]))
    return {"rollout/entropy": float(sums[0] / sums[1].clamp(min=1.0))}


class FastExperienceMaker:
    def __init__(
        self,
        engine: RolloutEngine,
        policy: Callable[[], torch.nn.Module],
        reference: torch.nn.Module | None,
        rewards: RewardMix,
        shape_rewards: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        settings: MakerSettings,
        critic: Callable[[], torch.nn.Module] | None = None,
        return_stats: ReturnStats | None = None,
        teacher: torch.nn.Module | RemoteTeacher | None = None,
    ):
        self.engine = engine
        self.policy = policy  # returns the trainer's current module (same forward as training)
        self.reference = reference
        self.teacher = teacher  # on-policy distillation: scores every sampled token (settings.distill)
        self.local_teacher = isinstance(teacher, torch.nn.Module)  # else remote: one call per step for all rollouts
        self.critic = critic  # returns the critic's current module, or None without a critic
        self.rewards = rewards
        self.shape_rewards = shape_rewards  # (rewards [N], truncated [N]) -> shaped rewards [N]
        self.settings = settings
        self.return_stats = return_stats  # value normalisation (None = off)
        # Work for the rank while a multi-turn batch waits on its environments; it says whether
        # it did any (an asynchronous rollout rank starts its next batch there: async_roles.py).
        self.between_turns: Callable[[], bool] | None = None

    def make(self, prompts: list[Prompt]) -> tuple[list[Experience], dict[str, float]]:
        return self.finish(self.generate_and_score(prompts))

    def start_rollouts(self, prompts: list[Prompt], seed: int | None, step_budget: bool = True) -> InFlight:
        """Multi-turn rollouts of `prompts`, started (their environments' constructions sent)
        to be finished by `generate_and_score`; `step_budget`: as MultiTurn's."""
        s = self.settings
        mt = replace(s.multi_turn, step_budget=step_budget)
        steps = multi_turn_steps(self.engine, prompts, replace(s.sampling, seed=seed), mt, sample_fields)
        return InFlight(steps, mt.environments)

    def generate_and_score(self, prompts: list[Prompt], seed: int | None = None, started: InFlight | None = None) -> list[Experience]:
        """Rollouts with their rewards (best-of-n applied); the rest is filled by `finish`.
        `seed` is the generate call's base seed (SamplingParams.seed); `started`: the prompts'
        rollouts, already started by `start_rollouts` with that seed. While multi-turn rollouts
        wait on their environments, `between_turns` (when set) does other work."""
        s = self.settings
        if s.multi_turn is None:
            rollouts = self.engine.generate(prompts, replace(s.sampling, seed=seed))
        else:
            rollouts = (started or self.start_rollouts(prompts, seed)).finish(self.between_turns)
        totals, components, dense = self.rewards.score(
            [r.response_text for r in rollouts], [completion_fields(r) for r in rollouts]
        )
        experiences = [Experience(r, totals[i], components[i], dense[i]) for i, r in enumerate(rollouts)]
        if s.keep_per_prompt < s.sampling.n:
            scores = torch.tensor([e.total_reward for e in experiences])
            group_ids = torch.tensor([r.group_id for r in rollouts])
            experiences = [experiences[i] for i in best_of_n(scores, group_ids, s.keep_per_prompt).tolist()]
        return experiences

    def finish(
        self, experiences: list[Experience], placeholder: Experience | None = None
    ) -> tuple[list[Experience], dict[str, float]]:
        """Old/ref logprobs, values and advantages for scored experiences (a collective: every
        rank calls it once per step). Returns the experiences and rollout KL metrics. A rank
        left with no experience runs `placeholder` (trainer/bad_input.py) through the forwards."""
        s = self.settings
        experiences, skipped = self._drop_bad_samples(experiences)
        rollouts = [e.rollout for e in experiences]
        per_token = self.forward_pass(rollouts, placeholder.rollout if placeholder is not None else None)
        width = max((len(r.response_ids) for r in rollouts), default=0)
        mask = pad_rows([r.trained_mask() for r in rollouts], width)  # [N, R] generated (not observation) tokens
        scores = self.shape_rewards(
            torch.tensor([e.reward for e in experiences], dtype=torch.float32),
            torch.tensor([r.truncated for r in rollouts], dtype=torch.bool),
        )  # [N]
        token_terms = pad_rows([torch.tensor(e.dense_reward or []) for e in experiences], width)  # [N, R]
        metrics = {}
        for i, e in enumerate(experiences):
            e.ref_logprobs = per_token["ref"][i] if self.reference is not None else None
            if s.policy_pass:
                e.old_logprobs, e.entropy = per_token["old"][i], per_token["entropy"][i]
        if s.policy_pass:
            metrics, corrections = self.policy_metrics(experiences, per_token["kl"] or None)
            if corrections is not None and s.correction.mode != "none":
                for i, e in enumerate(experiences):
                    e.correction = corrections[i, : len(e.rollout.response_ids)].clone()
        if s.image_check is not None:
            metrics["rollout/skipped_samples"] = float(all_reduce_sum(torch.tensor([float(skipped)])))
        if self.reference is not None and s.kl.placement == "reward":
            token_terms = token_terms - s.kl.coef() * pad_rows(per_token["kl"], width)  # rollout policy vs reference
        # Responses out of the loss (mask_truncated) are out of the advantage statistics too
        # (batch whitening, GAE): they get zero advantages and never shift anyone else's.
        in_loss = torch.tensor([not (s.mask_truncated and r.truncated) for r in rollouts], dtype=torch.float32)  # [N]
        estimated = mask * in_loss[:, None]  # [N, R]
        values = None
        if self.critic is not None:
            values = pad_rows(per_token["values"], width)  # [N, R] critic outputs
            if self.return_stats is not None:
                values = self.return_stats.denormalize(values) * mask
        advantages, returns = estimate_advantages(
            s.advantages,
            scores,
            torch.tensor([r.group_id for r in rollouts]),
            estimated,
            token_terms,
            values,
            all_reduce_sum,
        )
        if returns is not None and self.return_stats is not None:
            self.return_stats.update(returns, estimated, all_reduce_sum)
            returns = self.return_stats.normalize(returns) * estimated  # the critic's target space
        if self.teacher is not None:
            advantages, distilled = distill_experiences(s.distill, experiences, per_token, advantages, estimated,
                                                        self.teacher_seconds)
            metrics |= distilled
        for i, e in enumerate(experiences):
            n = len(e.rollout.response_ids)
            e.advantages = advantages[i, :n].clone()
            if self.critic is not None:
                e.values = per_token["values"][i]
                e.returns = returns[i, :n].clone()
            e.in_loss = e.in_loss and bool(in_loss[i])
        return experiences, metrics

    def policy_metrics(
        self, experiences: list[Experience], kl: list[torch.Tensor] | None = None
    ) -> tuple[dict[str, float], torch.Tensor | None]:
        """Metrics of the rollout policy over all ranks (a collective), from the experiences'
        old logprobs and entropy: its token entropy, its gap to the engine, and its KL to the
        reference (`kl`, per token, when the forward computed it; else the estimator on the
        stored logprobs). Also the correction weights, [N, R], or None when the engine reports
        no logprobs. Called by `finish`, or by the trainer after an update that filled them."""
        s = self.settings
        rollouts = [e.rollout for e in experiences]
        width = max((len(r.response_ids) for r in rollouts), default=0)
        mask = pad_rows([r.trained_mask() for r in rollouts], width)  # [N, R] generated (not observation) tokens
        old = pad_rows([e.old_logprobs for e in experiences], width)  # [N, R]
        metrics = token_metrics(rollouts, [e.entropy for e in experiences])
        corrections = None
        if engine_reports_logprobs(rollouts):
            corrections, mismatch = self._rollout_correction(rollouts, old, mask)
            metrics |= mismatch
        elif s.correction.mode != "none":
            raise ValueError(f"algo.rollout_correction {s.correction.mode} needs an engine that reports its logprobs")
        if self.reference is not None:
            if kl is None:
                kl = [KL_ESTIMATORS.get(s.kl.estimator)(e.old_logprobs, e.ref_logprobs) for e in experiences]
            kl_sum = float(sum((t * r.trained_mask()).sum() for t, r in zip(kl, rollouts)))
            seq_kl, count = all_reduce_sum(torch.tensor([kl_sum, float(len(rollouts))])).tolist()
            metrics |= {"rollout/kl": seq_kl / max(count, 1.0), "rollout/sequences": count}
        return metrics, corrections

    def _rollout_correction(self, rollouts: list[Rollout], old: torch.Tensor, mask: torch.Tensor):
        """(per-token weights [N, R], metrics over all ranks) from the engine's own logprobs: how
        far they are from the trainer's (a stale or broken weight sync, or a numerics gap, shows
        here first), the mismatch KL, and the correction's weights."""
        c = self.settings.correction
        engine = engine_logprob_rows(rollouts, mask.shape[1])  # [N, R]
        gaps = all_gather_1d((engine - old).abs()[mask.bool()])  # [tokens of all ranks]; a rank may have none
        weights = correction_weights(old, engine, mask, c.mode, c.cap, c.low, c.high)
        tokens, kl, total, squares, masked = all_reduce_sum(mismatch_sums(old, engine, weights, mask)).tolist()
        metrics = {
            "rollout/engine_logprob_diff_mean": float(gaps.mean()) if gaps.numel() else 0.0,
            "rollout/engine_logprob_diff_max": float(gaps.max()) if gaps.numel() else 0.0,
            "rollout/mismatch_kl": kl / max(tokens, 1.0),
        }
        if c.mode != "none":
            mean = total / max(tokens, 1.0)
            metrics |= {
                "rollout/correction_weight_mean": mean,
                "rollout/correction_weight_std": max(squares / max(tokens, 1.0) - mean * mean, 0.0) ** 0.5,
                "rollout/correction_masked_frac": masked / max(tokens, 1.0),
            }
        return weights, metrics

    def _drop_bad_samples(self, experiences: list[Experience]) -> tuple[list[Experience], int]:
        """Samples whose forward would fail (image tokens vs pixel patches) are named and dropped."""
        check = self.settings.image_check
        if check is None:
            return experiences, 0
        kept = []
        for e in experiences:
            problem = check.problem(e)
            if problem is None:
                kept.append(e)
            else:
                print(f"vlrft: dropping a rollout: {problem}", flush=True)
        return kept, len(experiences) - len(kept)

    @torch.no_grad()
    def forward_pass(self, rollouts: list[Rollout], placeholder: Rollout | None = None) -> dict[str, list[torch.Tensor]]:
        """Per rollout, response-token tensors ([R_i]): old, entropy, ref, kl (policy vs reference),
        values and the teacher's teacher/teacher_top (and [R_i, k] teacher_topk_ids/logprobs), with the trainer's own forward, one
        micro-batch at a time (a remote teacher: one call for all of this rank's rollouts). With
        no rollouts, `placeholder` is run as a dummy micro-batch so this rank still joins its
        peers' forwards."""
        s = self.settings
        batches = micro_batches(rollouts, s.micro_batch_tokens, placeholder, share=s.share_prompts)
        temperature = s.sampling.temperature
        found_for: dict[int, dict[str, torch.Tensor]] = {}  # id(rollout) -> its tensors (packing reorders)
        full = self.reference is not None and s.kl.estimator == FULL_KL  # needs both models' logits
        self.teacher_seconds = 0.0
        for batch in batches:
            found = {}
            if s.policy_pass:
                policy = policy_forward(self.policy(), batch, temperature, keep_logits=full)
                found |= {"old": policy.logp, "entropy": policy.entropy}
            if self.reference is not None:
                ref = policy_forward(self.reference, batch, temperature, keep_logits=full)
                found["ref"] = ref.logp
                if s.kl.estimator == FULL_KL:
                    found["kl"] = torch.nn.functional.pad(full_kl(policy.logits, ref.logits), (1, 0))
                elif s.policy_pass:
                    found["kl"] = KL_ESTIMATORS.get(s.kl.estimator)(policy.logp, ref.logp)
            if self.local_teacher:
                started = time.perf_counter()
                student = self.policy()  # (its LM head's rows: its config's vocab_size)
                student_vocab = getattr(student, "module", student).config.get_text_config().vocab_size
                scores = teacher_scores(self.teacher, batch, temperature, s.distill.top_k, student_vocab)
                found["teacher"], found["teacher_top"] = scores.logp, scores.argmax
                if scores.top_ids is not None:  # algo.distill.mode jsd
                    found["teacher_topk_ids"], found["teacher_topk_logprobs"] = scores.top_ids, scores.top_logp
                self.teacher_seconds += time.perf_counter() - started
            if self.critic is not None:
                found["values"] = token_values(self.critic(), batch)
            if not batch.dummy:
                # Sequence parallelism: each rank of the group scored its shard (a collective:
                # all of them, for every micro-batch); the owner keeps the rows.
                found = {key: combine(value) for key, value in found.items()}
            if not batch.dummy and batch.owned:
                for key, value in found.items():
                    # Experiences wait for the update on the CPU: accelerator memory is the
                    # update's, and each micro-batch moves its own rows back (update.py).
                    for rollout, row in zip(batch.samples, gather_responses(batch, value, "cpu")):
                        found_for.setdefault(id(rollout), {})[key] = row
        computed = {key for found in found_for.values() for key in found}
        rows = {key: [found_for[id(r)][key] for r in rollouts] if key in computed else []
                for key in ("old", "entropy", "ref", "kl", "values", "teacher", "teacher_top", "teacher_topk_ids",
                            "teacher_topk_logprobs")}
        if self.teacher is not None and not self.local_teacher:
            started = time.perf_counter()
            rows["teacher"], rows["teacher_top"] = self.teacher.score(rollouts, temperature)
            self.teacher_seconds = time.perf_counter() - started
        return rows
