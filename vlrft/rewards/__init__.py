"""Reward recipes: loading by name, isolated calls, and the per-data-source weighted mix."""

from vlrft.rewards.loading import BUILTIN_RECIPES, ENTRY_POINT_GROUP, available_recipes, resolve_recipe
from vlrft.rewards.mix import RewardError, RewardMix

__all__ = ["BUILTIN_RECIPES", "ENTRY_POINT_GROUP", "RewardError", "RewardMix", "available_recipes", "resolve_recipe"]
