"""Step metrics of the scored rollouts, reduced over all ranks: rewards per component and per
data source, training accuracy, lengths, truncation, recipe failures, timed-out calls."""

from __future__ import annotations

import torch

from vlrft.experience.maker import completion_fields
from vlrft.isolation.calls import abandoned_calls
from vlrft.rewards.mix import RewardMix
from vlrft.distributed import all_gather_objects, all_reduce_sum
from vlrft.types import Experience
from vlrft.workers import killed_calls


def union_over_ranks(names: set[str]) -> list[str]:
    """The sorted union of every rank's names: a layout all ranks agree on for a reduction."""
    return sorted(set().union(*map(set, all_gather_objects(sorted(names)))))


def mark_correct(experiences: list[Experience], rewards: RewardMix) -> None:
    """Set each experience's `correct` with the accuracy recipe (reusing its mix score)."""
    texts = [e.rollout.response_text for e in experiences]
    correct = rewards.accuracy(
        texts, [completion_fields(e.rollout) for e in experiences], [e.reward_components for e in experiences]
    )
    for e, ok in zip(experiences, correct):
        e.correct = ok


def rollout_metrics(experiences: list[Experience], rewards: RewardMix, sources: list[str]) -> dict[str, float]:
    """`sources` is the run's sorted list of training data sources (the same on every rank);
    the experiences went through `mark_correct`."""
    correct = [e.correct for e in experiences]
    names = union_over_ranks({name for e in experiences for name in e.reward_components})
    failure_names = rewards.component_names()
    failures = rewards.take_failures()
    # Layout: [count, reward, length, truncated, correct] | per name [sum, count] | per source
    # [count, reward, correct] | per recipe [failures] | [killed calls, abandoned calls] |
    # multi-turn [turns, environment failures]
    local = torch.zeros(5 + 2 * len(names) + 3 * len(sources) + len(failure_names) + 4, dtype=torch.float64)
    col = {name: 5 + 2 * j for j, name in enumerate(names)}
    src = {source: 5 + 2 * len(names) + 3 * j for j, source in enumerate(sources)}
    for e, ok in zip(experiences, correct):
        local[:5] += torch.tensor([1.0, e.reward, len(e.rollout.response_ids), float(e.rollout.truncated), ok])
        local[-2] += len(e.rollout.turns)
        local[-1] += sum("error" in turn for turn in e.rollout.turns)
        for name, value in e.reward_components.items():
            local[col[name]] += value
            local[col[name] + 1] += 1.0
        if e.rollout.prompt.data_source in src:
            j = src[e.rollout.prompt.data_source]
            local[j : j + 3] += torch.tensor([1.0, e.reward, ok])
    fail_start = 5 + 2 * len(names) + 3 * len(sources)
    for j, name in enumerate(failure_names):
        local[fail_start + j] = failures[name]
    local[-4] = killed_calls()  # cumulative per rank: timed-out calls ended with their worker process
    local[-3] = abandoned_calls()  # cumulative per rank: timed-out calls still running in a trainer thread
    total = all_reduce_sum(local).tolist()
    n = max(total[0], 1.0)
    metrics = {
        "rollout/reward_mean": total[1] / n,
        "rollout/response_length": total[2] / n,
        "rollout/truncated_frac": total[3] / n,
        "rollout/accuracy": total[4] / n,
        "reward/killed_calls": total[-4],
        "reward/abandoned_calls": total[-3],
    }
    if total[-2] > 0:  # multi-turn rollouts
        metrics |= {"rollout/turns": total[-2] / n, "rollout/environment_failures": total[-1]}
    for name in names:
        value, count = total[col[name]], total[col[name] + 1]
        if count > 0:
            metrics[f"reward/{name}/mean"] = value / count
    for source in sources:
        count, reward, ok = total[src[source] : src[source] + 3]
        if count > 0:
            metrics[f"rollout/{source}/reward_mean"] = reward / count
            metrics[f"rollout/{source}/accuracy"] = ok / count
    for j, name in enumerate(failure_names):
        metrics[f"reward/{name}/failures"] = total[fail_start + j]
    return metrics
