"""Multi-turn runs: the environment's own rewards, as a recipe (docs/environments.md)."""

from __future__ import annotations


def environment_reward(completions, samples):
    """Recipe: the sum of the environment's per-turn rewards over the trajectory (0 for a
    single-turn sample, which has no turns)."""
    return [float(s.get("environment_reward", 0.0)) for s in samples]
