"""Held-out evaluation: greedy decoding, accuracy overall and per data source (all ranks)."""

from __future__ import annotations

from collections import defaultdict

import torch

from vlrft.engines.base import RolloutEngine, SamplingParams
from vlrft.experience.maker import MakerSettings, completion_fields, sample_fields
from vlrft.multiturn.rollout import generate_rollouts
from vlrft.rewards.mix import RewardMix
from vlrft.distributed import all_reduce_sum
from vlrft.types import Prompt


def evaluate(
    engine: RolloutEngine, prompts: list[Prompt], rewards: RewardMix, settings: MakerSettings, sources: list[str]
) -> dict[str, float]:
    """`prompts` is this rank's shard; `sources` is the global, sorted list of data sources.
    Greedy, with the run's response length; multi-turn runs with their environment."""
    params = SamplingParams(n=1, max_new_tokens=settings.sampling.max_new_tokens, temperature=1.0, greedy=True)
    # Called on every rank: a TP engine generates as a group.
    rollouts = generate_rollouts(engine, prompts, params, settings.multi_turn, sample_fields)
    scores = rewards.accuracy([r.response_text for r in rollouts], [completion_fields(r) for r in rollouts])
    per_source = defaultdict(lambda: [0.0, 0.0])
    for rollout, score in zip(rollouts, scores):
        per_source[rollout.prompt.data_source][0] += score
        per_source[rollout.prompt.data_source][1] += 1
    local = torch.tensor([per_source[s] for s in sources], dtype=torch.float32).reshape(-1, 2)  # [S, 2]
    total = all_reduce_sum(local)
    metrics = {f"eval/{s}/accuracy": float(c / max(n, 1.0)) for s, (c, n) in zip(sources, total.tolist())}
    metrics["eval/accuracy"] = float(total[:, 0].sum() / total[:, 1].sum().clamp(min=1.0))
    return metrics
