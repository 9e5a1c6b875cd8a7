"""Finding a reward recipe by name: built-ins, installed plugins, modules and user files.

A name resolves, in order, to
  1. a built-in short name (BUILTIN_RECIPES),
  2. an entry point of an installed package in the group `vlrft.reward_recipes`,
  3. "package.module:function" or "path/to/file.py:function".
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import Callable

from vlrft.errors import ConfigError
from vlrft.registry import load_callable

ENTRY_POINT_GROUP = "vlrft.reward_recipes"

BUILTIN_RECIPES = {
    "exact_match": "reward_recipes.answer_match:exact_match",
    "answer_format": "reward_recipes.format:answer_tag_format",
    "think_answer_format": "reward_recipes.format:think_answer_format",
    "math_accuracy": "reward_recipes.math:math_accuracy",
    "multiple_choice": "reward_recipes.choice:multiple_choice",
    "counting": "reward_recipes.choice:counting",
    "grounding_iou": "reward_recipes.grounding:grounding_iou",
    "soft_overlong_penalty": "reward_recipes.overlong:soft_overlong_penalty",
    "repetition_penalty": "reward_recipes.repetition:repetition_penalty",
    "code_unit_tests": "reward_recipes.code:unit_tests",
    "environment_reward": "reward_recipes.environment:environment_reward",
    "reward_model": "vlrft.rewards.reward_models:scalar_reward_model",
    "generative_judge": "vlrft.rewards.reward_models:generative_judge",
    "remote": "vlrft.rewards.remote:remote_reward",
}


def plugin_recipes() -> dict:
    """Installed plugins: entry-point name -> EntryPoint (loaded only when used)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_recipes() -> list[str]:
    return sorted(set(BUILTIN_RECIPES) | set(plugin_recipes()))


@functools.lru_cache(maxsize=None)
def resolve_recipe(name: str) -> Callable:
    """The recipe function a config names; an unknown name fails listing the available ones.
    Cached: config validation and the mix resolve the same names, and a user file must not be
    executed twice (it may load a model at import)."""
    if name in BUILTIN_RECIPES:
        return load_callable(BUILTIN_RECIPES[name])
    plugins = plugin_recipes()
    if name in plugins:
        try:
            fn = plugins[name].load()
        except Exception as err:  # noqa: BLE001 - a broken plugin is named, whatever it raised
            raise ConfigError(f"reward recipe plugin '{name}' ({plugins[name].value}) failed to load: {err}") from None
        if not callable(fn):
            raise ConfigError(f"reward recipe plugin '{name}' ({plugins[name].value}) is not a callable")
        return fn
    if ":" not in name:
        raise ConfigError(
            f"unknown reward recipe '{name}'; available: {', '.join(available_recipes())}; "
            "or give 'package.module:function' / 'path/to/file.py:function'"
        )
    try:
        return load_callable(name)
    except ValueError as err:
        raise ConfigError(f"reward recipe {err}") from None
