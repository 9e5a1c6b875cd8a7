"""Held-out evaluation: greedy decoding, accuracy overall and per data source (all ranks)."""

from __future__ import annotations

from collections import defaultdict

import torch

from vlrft.engines.base import RolloutEngine, SamplingParams
from vlrft.experience.maker import sample_fields
from vlrft.rewards.mix import RewardMix
from vlrft.distributed import all_reduce_sum
from vlrft.types import Prompt


def evaluate(
    engine: RolloutEngine, prompts: list[Prompt], rewards: RewardMix, max_new_tokens: int, sources: list[str]
) -> dict[str, float]:
    """`prompts` is this rank's shard; `sources` is the global, sorted list of data sources."""
    params = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=1.0, greedy=True)
    rollouts = engine.generate(prompts, params)  # called on every rank: a TP engine generates as a group
    scores = rewards.accuracy([r.response_text for r in rollouts], [sample_fields(r.prompt) for r in rollouts])
    per_source = defaultdict(lambda: [0.0, 0.0])
    for rollout, score in zip(rollouts, scores):
        per_source[rollout.prompt.data_source][0] += score
        per_source[rollout.prompt.data_source][1] += 1
    local = torch.tensor([per_source[s] for s in sources], dtype=torch.float32).reshape(-1, 2)  # [S, 2]
    total = all_reduce_sum(local)
    metrics = {f"eval/{s}/accuracy": float(c / max(n, 1.0)) for s, (c, n) in zip(sources, total.tolist())}
    metrics["eval/accuracy"] = float(total[:, 0].sum() / total[:, 1].sum().clamp(min=1.0))
    return metrics
