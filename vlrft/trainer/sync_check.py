"""Weight-sync verification: after every sync, the engine and the trainer score the same probe
response, and a gap between them stops the run.

A sync that silently does not take effect (weights sent under names the engine ignores, an
engine that keeps a processed copy, a LoRA merge that never reaches it) leaves the engine
sampling an older policy while training goes on, and nothing fails. Comparing logprobs of one
response is cheap (one short forward on each side) and catches it at the step it happens:

    gap   = mean over the probe's generated tokens of |engine logprob - trainer logprob|,
            after the sync (the larger over ranks)
    shift = the same between the trainer's logprobs before and after this step's update

A gap near `shift` means the engine still serves the weights from before the update. The probe
is this rank's first experience of the step; an engine that cannot score image prompts (vLLM)
scores it with the prompt's images left out, which checks the language model's weights.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vlrft.distributed import all_gather_1d
from vlrft.errors import VlrftError
from vlrft.models.collate import gather_responses
from vlrft.models.forward import policy_forward
from vlrft.models.packing import micro_batches
from vlrft.models.sequence_parallel import combine
from vlrft.types import Experience, Rollout

# Logprobs are compared at temperature 1: the check is about weights, not sampling settings.
PROBE_TEMPERATURE = 1.0

# The limit of `sync/logprob_gap` per engine and precision (`model.compute_dtype`) where
# guards.sync_max_logprob_gap is not set: ten times the largest gap of healthy runs, rounded up,
# and at least 1e-3 (fp32 on a GPU changes kernels, not precision); the measurements are in
# docs/guards.md. Rounding never trips it; a stale layer of an fp32 engine (0.02) does. The
# digest check (engines/weight_digest.py) is the exact one; this probe is for what a digest
# cannot see (processor, attention implementation, dtype of the computation).
GAP_LIMITS = {
    ("hf", "float32"): 1e-3,  # largest healthy gap 2.9e-7
    ("hf", "bfloat16"): 0.2,  # 0.0157
    ("vllm", "float32"): 1e-3,  # 1.8e-6
    ("vllm", "bfloat16"): 0.2,  # 0.0175
}
DEFAULT_GAP_LIMIT = 0.2  # an engine or precision not measured (a plugin engine)


def gap_limit(configured: float | None, engine_name: str, dtype: str) -> float:
    """guards.sync_max_logprob_gap if set, else the measured limit of the engine and precision."""
    return configured if configured is not None else GAP_LIMITS.get((engine_name, dtype), DEFAULT_GAP_LIMIT)


class SyncError(VlrftError, RuntimeError):
    """The engine does not serve the trained policy after a sync; one-line message."""


def text_only(rollout: Rollout) -> Rollout:
    """The rollout with its prompt's image and video tokens (and their pixels) left out."""
    prompt = rollout.prompt
    if not prompt.mm_token_types:
        return rollout
    ids = [t for t, kind in zip(prompt.prompt_ids, prompt.mm_token_types) if kind == 0]
    text_prompt = replace(prompt, prompt_ids=ids, images=[], mm_inputs={}, mm_token_types=[])
    return replace(rollout, prompt=text_prompt, observation_images=[], observation_mm_inputs={}, response_mm_token_types=[])


def probe_rollout(experiences: list[Experience], scores_images: bool) -> Rollout:
    """This rank's probe: its first experience (the bad-input placeholder on a rank without any),
    less its last token, so that scoring it never needs more context than generating it did (an
    engine scores a sequence by running it as a prompt and generating one token past it)."""
    rollout = experiences[0].rollout
    if len(rollout.response_ids) > 1:
        keep = len(rollout.response_ids) - 1
        trained = None if rollout.trained is None else rollout.trained[:keep]
        rollout = replace(rollout, response_ids=rollout.response_ids[:keep], trained=trained,
                          response_mm_token_types=rollout.response_mm_token_types[:keep])
    return rollout if scores_images else text_only(rollout)


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, probe: Rollout) -> torch.Tensor:
    """[R] the trainer's logprobs of the probe's response tokens (every rank calls it: ZeRO-3
    gathers parameters inside the forward)."""
    # (Sequence parallelism: the group's probes, one micro-batch each, run by all of its ranks.)
    mine = None
    for batch in micro_batches([probe], len(probe.prompt.prompt_ids) + len(probe.response_ids)):
        logp = combine(policy_forward(model, batch, PROBE_TEMPERATURE).logp)
        mine = gather_responses(batch, logp, "cpu")[0] if batch.owned else mine
    return mine


def mean_gap(a: torch.Tensor, b: torch.Tensor, trained: torch.Tensor) -> float:
    """Mean |a - b| over the generated tokens (`trained` 1), 0 when there are none."""
    count = float(trained.sum())
    return float(((a.float() - b.float()).abs() * trained).sum()) / count if count else 0.0


def sync_gap(engine_logp: torch.Tensor, after: torch.Tensor, before: torch.Tensor, trained: torch.Tensor) -> tuple[float, float]:
    """(gap, shift) over all ranks: the largest of each (a collective)."""
    local = torch.tensor([mean_gap(engine_logp, after, trained), mean_gap(after, before, trained)])
    per_rank = all_gather_1d(local).view(-1, 2)  # [ranks, 2]
    gap, shift = per_rank.max(dim=0).values.tolist()
    return gap, shift


def sync_problem(engine_name: str, step: int, gap: float, shift: float, limit: float) -> str:
    """The one-line stop message, or "" when the gap is within `limit` (0 = never)."""
    if limit <= 0 or gap <= limit:
        return ""
    why = ("the gap matches the update's own change: the new weights did not reach the engine"
           if shift > 0 and abs(gap - shift) <= 0.25 * shift
           else "check that the engine and the trainer use the same weights, dtype and processor")
    return (f"weight sync check after step {step}: the '{engine_name}' engine's logprobs of a probe response differ "
            f"from the trainer's by {gap:.4g} per token (guards.sync_max_logprob_gap {limit:g}); this step's update "
            f"moved the trainer's by {shift:.4g}: {why}")


class SyncCheck:
    """Used by the trainer around each update: `before_update`, then after the sync `after_sync`."""

    def __init__(self, engine, engine_name: str, limit: float):
        self.engine, self.engine_name, self.limit = engine, engine_name, limit
        self.probe: Rollout | None = None
        self.before: torch.Tensor | None = None

    def before_update(self, model: torch.nn.Module, experiences: list[Experience]) -> None:
        if self.limit <= 0 or self.engine is None:  # None: no engine beside the policy (async roles)
            return
        self.probe = probe_rollout(experiences, getattr(self.engine, "scores_images", True))
        self.before = trainer_logprobs(model, self.probe)

    def after_sync(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        """Metrics `sync/logprob_gap` and `sync/update_shift`; raises SyncError past the limit."""
        if self.limit <= 0 or self.probe is None:
            return {}
        after = trainer_logprobs(model, self.probe)
        (engine_logp,) = self.engine.score([self.probe], PROBE_TEMPERATURE)
        gap, shift = sync_gap(engine_logp, after, self.before, self.probe.trained_mask())
        self.probe = self.before = None
        problem = sync_problem(self.engine_name, step, gap, shift, self.limit)
        if problem:
            raise SyncError(problem)
        return {"sync/logprob_gap": gap, "sync/update_shift": shift}
