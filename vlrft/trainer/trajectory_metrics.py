"""`traj/` statistics of each step's experiences over all ranks (analysis.summarise), for the
metric sinks: the same numbers the report shows, as curves."""

from __future__ import annotations

import torch.distributed as dist

from vlrft.trajectory.analysis import summarise
from vlrft.trajectory.saver import stats_record
from vlrft.types import Experience


def trajectory_metrics(experiences: list[Experience]) -> dict[str, float]:
    """A collective (every rank calls it); the statistics come back on rank 0 only, the rank
    that writes metrics."""
    records = [stats_record(e, e.correct) for e in experiences]
    gathered: list = [None] * dist.get_world_size()
    dist.gather_object(records, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return {}
    summary = summarise([r for part in gathered for r in part if r["reward"] is not None])
    return {f"traj/{key}": value for key, value in summary.items()}
