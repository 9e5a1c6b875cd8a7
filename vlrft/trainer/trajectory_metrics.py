"""`traj/` statistics of each step's experiences over all ranks (analysis.summarise), for the
metric sinks: the same numbers the report shows, as curves.

Each rank reduces its experiences to numbers where their text is (one row of floats per
response, every finite token entropy in one tensor) and the ranks exchange those tensors, not
pickled records with texts and per-token lists.
"""

from __future__ import annotations

import math

import torch

from vlrft.distributed import all_gather_1d
from vlrft.trainer.rollout_metrics import union_over_ranks
from vlrft.trajectory.analysis import reflection_counts, repetition_score, summarise
from vlrft.trajectory.saver import component_value, rounded
from vlrft.types import Experience

# Columns of a response's row, then one per reward component (NaN: not applicable).
COLUMNS = ("reward", "correct", "response_length", "truncated", "repetition", "reflection_words", "group_id", "source")


def response_rows(experiences: list[Experience], sources: list[str], components: list[str]) -> torch.Tensor:
    """[N, len(COLUMNS) + len(components)] float64: each response's numbers, rounded as the
    saved trajectories round them (reward NaN when not finite; "source" is the index in
    `sources`)."""
    rows = torch.full((len(experiences), len(COLUMNS) + len(components)), math.nan, dtype=torch.float64)
    for i, e in enumerate(experiences):
        r, text = e.rollout, e.rollout.response_text
        reward = rounded(e.reward)
        rows[i, : len(COLUMNS)] = torch.tensor([
            math.nan if reward is None else reward, rounded(e.correct), len(r.response_ids), r.truncated,
            repetition_score(text), sum(reflection_counts(text).values()), r.group_id, sources.index(r.prompt.data_source),
        ], dtype=torch.float64)
        for j, name in enumerate(components):
            value = component_value(e.reward_components.get(name))
            if value is not None:
                rows[i, len(COLUMNS) + j] = value
    return rows


def records_of_rows(rows: torch.Tensor, sources: list[str], components: list[str]) -> list[dict]:
    """The rows back as records `summarise` reads (responses with a finite reward only)."""
    records = []
    for row in rows.tolist():
        named = dict(zip(COLUMNS, row))
        if math.isnan(named["reward"]):
            continue
        extra = row[len(COLUMNS):]
        records.append({
            **named,
            "group_id": int(named["group_id"]),
            "data_source": sources[int(named["source"])],
            "truncated": bool(named["truncated"]),
            "components": {name: value for name, value in zip(components, extra) if not math.isnan(value)},
        })
    return records


def trajectory_metrics(experiences: list[Experience]) -> dict[str, float]:
    """A collective (every rank calls it); every rank gets the statistics (rank 0 logs them)."""
    sources = union_over_ranks({e.rollout.prompt.data_source for e in experiences})
    components = union_over_ranks({name for e in experiences for name in e.reward_components})
    rows = response_rows(experiences, sources, components)
    width = rows.shape[1]
    rows = all_gather_1d(rows.flatten()).view(-1, width)
    entropies = [torch.as_tensor(e.entropy, dtype=torch.float32).flatten()[e.rollout.trained_mask().bool()]  # generated tokens
                 for e in experiences if e.entropy is not None and math.isfinite(e.reward)]  # as records_of_rows keeps
    entropy = torch.cat(entropies) if entropies else torch.zeros(0)
    entropy = all_gather_1d(entropy[torch.isfinite(entropy)])
    summary = summarise(records_of_rows(rows, sources, components), token_entropies=entropy)
    return {f"traj/{key}": value for key, value in summary.items()}
