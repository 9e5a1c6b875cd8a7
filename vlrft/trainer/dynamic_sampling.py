"""A step's prompts, generated and scored, with DAPO's dynamic sampling (rollout.dynamic_sampling)."""

from __future__ import annotations

import torch

from vlrft.algo.shaping import groups_with_spread
from vlrft.distributed import all_reduce_max_int, all_reduce_sum
from vlrft.engines.base import derived_seed
from vlrft.types import Experience


def sample_groups(trainer) -> tuple[list[Experience], list[Experience], dict[str, float]]:
    """(kept, all generated, metrics) of this rank's share of the step. With dynamic sampling,
    groups whose rewards all equal are dropped and more prompts sampled until every rank has its
    share of groups or `max_sampling_rounds` rounds ran; the decision is all-reduced so ranks
    stay in step."""
    rollout = trainer.cfg.rollout
    target = rollout.rollout_prompts // trainer.world_size  # groups per rank
    kept: list[Experience] = []
    generated: list[Experience] = []
    rounds = skipped = 0
    while True:
        if trainer.started_ahead and rounds == 0:  # an asynchronous rollout rank started this step's batch already
            ahead = trainer.started_ahead.pop(0)
            assert ahead.step == trainer.global_step, (ahead.step, trainer.global_step)
            prompts, bad, started = ahead.prompts, ahead.skipped, ahead.rollouts
        else:
            (prompts, bad), started = draw_prompts(trainer), None
        skipped += bad
        scored = trainer.maker.generate_and_score(prompts, round_seed(trainer, trainer.global_step, rounds), started)
        generated += scored
        rounds += 1
        if not rollout.dynamic_sampling:
            return scored, generated, {"data/skipped_prompts": float(skipped)}
        rewards = torch.tensor([e.total_reward for e in scored])
        spread = groups_with_spread(rewards, torch.tensor([e.rollout.group_id for e in scored]))
        kept += [e for e, keep in zip(scored, spread.tolist()) if keep]
        deficit = max(target - len({e.rollout.group_id for e in kept}), 0)
        if all_reduce_max_int(deficit) == 0 or rounds >= rollout.max_sampling_rounds:
            break
    n_generated = len({e.rollout.group_id for e in generated})
    n_kept = len({e.rollout.group_id for e in kept})
    first_groups = sorted({e.rollout.group_id for e in kept})[:target]
    kept = [e for e in kept if e.rollout.group_id in first_groups]
    if not kept and generated:
        # Nothing left to learn from on this rank: one dropped group keeps the rank in
        # step with the others (same collectives) and contributes nothing to the loss.
        last = generated[-1].rollout.group_id
        kept = [e for e in generated if e.rollout.group_id == last]
        for e in kept:
            e.in_loss = False
    totals = all_reduce_sum(torch.tensor([float(n_generated), float(n_kept)])).tolist()
    return kept, generated, {
        "rollout/dropped_group_frac": 1.0 - totals[1] / max(totals[0], 1.0),
        "rollout/sampling_rounds": float(rounds),
        "data/skipped_prompts": float(skipped),
    }


def draw_prompts(trainer) -> tuple[list, int]:
    """The sampler's next prompts for this rank, encoded: (prompts, prompts skipped on all ranks;
    a collective). A row that failed to encode once is not drawn again (trainer/bad_input.py)."""
    return trainer.bad_input.draw(trainer.encoder, trainer.sampler, trainer.train_rows)


def round_seed(trainer, step: int, round_: int) -> int:
    """The generate seed of sampling round `round_` of step `step`."""
    return derived_seed(trainer.cfg.train.seed, step, round_)
