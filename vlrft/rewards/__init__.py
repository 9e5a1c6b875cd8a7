"""Reward recipes: loading by name, and the per-data-source weighted mix."""

from vlrft.rewards.mix import RewardMix, resolve_recipe

__all__ = ["RewardMix", "resolve_recipe"]
