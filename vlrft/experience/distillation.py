"""The experience pass's share of on-policy distillation (algo/distill.py): after the teacher
scored every micro-batch, each experience keeps the teacher's logprobs, the advantage gets the
teacher's per-token term (`algo.distill.mode: advantage`), and the step logs how far the student
is from its teacher."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrft.algo.distill import distill_advantages, reverse_kl_tokens
from vlrft.distributed import all_gather_1d, all_reduce_sum
from vlrft.models.collate import pad_rows
from vlrft.types import Experience


@dataclass(frozen=True)
class DistillSettings:
    mode: str  # algo.distill.mode: advantage | loss | jsd
    coef: float  # algo.distill.coef
    top_k: int = 0  # algo.distill.top_k in jsd mode: the teacher's most likely tokens kept per position; else 0


def distill_experiences(
    settings: DistillSettings, experiences: list[Experience], per_token: dict[str, list[torch.Tensor]],
    advantages: torch.Tensor, estimated: torch.Tensor, teacher_seconds: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sets each experience's `teacher_logprobs`; returns the advantages ([N, R]) with the
    teacher's term in advantage mode (unchanged in loss mode) and the distillation metrics over
    all ranks (a collective). `per_token` holds the pass's "old" (the student's) and "teacher" /
    "teacher_top" rows (and in jsd mode "teacher_topk_ids" / "teacher_topk_logprobs", kept on
    the experiences for the update); `estimated` [N, R] marks the tokens advantages are estimated on."""
    width = advantages.shape[1]
    for i, (e, teacher) in enumerate(zip(experiences, per_token["teacher"])):
        e.teacher_logprobs = teacher
        if per_token.get("teacher_topk_ids"):  # jsd: [R, k] each
            # Copies, not views of the micro-batch's rows: an experience sent to another rank
            # (rank balance, sequence parallelism) pickles the whole storage of a view. Ids as
            # int32: 8 bytes a top-k entry with its logprob, kept until the update.
            e.teacher_topk_ids = per_token["teacher_topk_ids"][i].to(torch.int32)
            e.teacher_topk_logprobs = per_token["teacher_topk_logprobs"][i].clone()
    student, teacher = pad_rows(per_token["old"], width), pad_rows(per_token["teacher"], width)  # [N, R]
    if settings.mode == "advantage":
        advantages = advantages + distill_advantages(student, teacher, estimated, settings.coef)
    trained = pad_rows([e.rollout.trained_mask() for e in experiences], width)  # the student's own tokens
    top = pad_rows(per_token["teacher_top"], width)
    sums = torch.tensor([float((reverse_kl_tokens(student, teacher) * trained).sum()), float((top * trained).sum()),
                         float(trained.sum())])
    kl, hits, tokens = all_reduce_sum(sums).tolist()
    slowest = float(all_gather_1d(torch.tensor([teacher_seconds])).max())  # the rank the step waited for
    return advantages, {
        "distill/reverse_kl": kl / max(tokens, 1.0),
        "distill/teacher_argmax_match": hits / max(tokens, 1.0),
        "distill/teacher_seconds": slowest,
    }
