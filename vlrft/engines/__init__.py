"""Rollout engines behind one protocol; `ENGINES` maps config names to factories."""

from vlrft.engines.base import ENGINES, RolloutEngine, SamplingParams

__all__ = ["ENGINES", "RolloutEngine", "SamplingParams"]
