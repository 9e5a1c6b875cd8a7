"""`traj/` statistics of each step's experiences over all ranks (analysis.summarise), for the
metric sinks: the same numbers the report shows, as curves."""

from __future__ import annotations

from vlrft.distributed import gather_objects_to_rank0
from vlrft.trajectory.analysis import summarise
from vlrft.trajectory.saver import stats_record
from vlrft.types import Experience


def trajectory_metrics(experiences: list[Experience]) -> dict[str, float]:
    """A collective (every rank calls it); the statistics come back on rank 0 only, the rank
    that writes metrics."""
    records = [stats_record(e, e.correct) for e in experiences]
    gathered = gather_objects_to_rank0(records)
    if gathered is None:  # not rank 0
        return {}
    summary = summarise([r for part in gathered for r in part if r["reward"] is not None])
    return {f"traj/{key}": value for key, value in summary.items()}
