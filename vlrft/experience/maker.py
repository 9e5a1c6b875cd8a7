"""FastExperienceMaker: prompts -> rollouts -> rewards, old/ref logprobs, advantages, in one pass."""

from __future__ import annotations

from typing import Callable

import torch

from vlrft.engines.base import RolloutEngine, SamplingParams
from vlrft.experience.collate import collate, gather_responses
from vlrft.experience.replay_buffer import pad_micro_batch_count, split_by_tokens
from vlrft.models.forward import token_logprobs
from vlrft.rewards.mix import RewardMix
from vlrft.trainer.distributed import all_reduce_max_int
from vlrft.types import Experience, Prompt, Rollout


def sample_fields(prompt: Prompt) -> dict:
    """What a reward recipe sees of a completion's row."""
    return {"id": prompt.id, "answer": prompt.answer, "data_source": prompt.data_source, "meta": prompt.meta}


class FastExperienceMaker:
    def __init__(
        self,
        engine: RolloutEngine,
        policy: Callable[[], torch.nn.Module],
        reference: torch.nn.Module | None,
        rewards: RewardMix,
        advantage_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        shape_rewards: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        sampling: SamplingParams,
        micro_batch_tokens: int,
        pad_id: int,
    ):
        self.engine = engine
        self.policy = policy  # returns the trainer's current module (same forward as training)
        self.reference = reference
        self.rewards = rewards
        self.advantage_fn = advantage_fn
        self.shape_rewards = shape_rewards  # (rewards [N], truncated [N]) -> shaped rewards [N]
        self.sampling = sampling
        self.micro_batch_tokens = micro_batch_tokens
        self.pad_id = pad_id

    def make(self, prompts: list[Prompt]) -> list[Experience]:
        rollouts = self.engine.generate(prompts, self.sampling)
        completions = [r.response_text for r in rollouts]
        totals, components = self.rewards.score(completions, [sample_fields(r.prompt) for r in rollouts])
        old = self.logprobs(self.policy(), rollouts)
        ref = self.logprobs(self.reference, rollouts) if self.reference is not None else [None] * len(rollouts)
        rewards = torch.tensor(totals, dtype=torch.float32)  # [N] as the recipes scored them
        truncated = torch.tensor([r.truncated for r in rollouts])  # [N]
        group_ids = torch.tensor([r.group_id for r in rollouts])  # [N]
        advantages = self.advantage_fn(self.shape_rewards(rewards, truncated), group_ids)  # [N]
        return [
            Experience(
                rollout=r,
                reward=totals[i],
                reward_components=components[i],
                old_logprobs=old[i],
                ref_logprobs=ref[i],
                advantages=advantages[i].expand(len(r.response_ids)).clone(),  # [R] broadcast to tokens
            )
            for i, r in enumerate(rollouts)
        ]

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Response-token logprobs ([R_i] per rollout) with the trainer's own forward."""
        groups = split_by_tokens(rollouts, self.micro_batch_tokens)
        batches = [collate(g, self.pad_id) for g in groups]
        # Same number of forwards on every rank: sharded models gather inside forward.
        batches = pad_micro_batch_count(batches, all_reduce_max_int(len(batches)), self.pad_id)
        out: list[torch.Tensor] = []
        for batch in batches:
            logp = token_logprobs(model, batch, self.sampling.temperature)  # [B, L]
            if not batch.dummy:
                out += gather_responses(batch, logp)
        return out
