"""Per-data-source weighted mix of reward recipes.

A recipe is a plain function over a batch:

    recipe(completions: list[str], samples: list[dict], **kwargs) -> list[float | None]

`samples[i]` holds the row fields of completion i: "id", "answer", "data_source", "meta".
None means "not applicable" and contributes 0 to the weighted sum.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from vlrft.config import ConfigError, RecipeSpec, RewardConfig
from vlrft.registry import load_callable

class RewardError(RuntimeError):
    """A reward problem that stops training; the message is one line naming the recipes."""


# Short names of the built-in recipes in reward_recipes/.
BUILTIN_RECIPES = {
    "exact_match": "reward_recipes.answer_match:exact_match",
    "answer_format": "reward_recipes.format:answer_tag_format",
}


def resolve_recipe(name: str) -> Callable:
    """A built-in short name, "package.module:function" or "path/to/file.py:function"."""
    if name in BUILTIN_RECIPES:
        return load_callable(BUILTIN_RECIPES[name])
    if ":" not in name:
        raise ConfigError(
            f"unknown reward recipe '{name}'; built-ins: {', '.join(sorted(BUILTIN_RECIPES))}, "
            "or give 'package.module:function' / 'path/to/file.py:function'"
        )
    try:
        return load_callable(name)
    except ValueError as err:
        raise ConfigError(f"reward recipe {err}") from None


def component_name(spec: RecipeSpec) -> str:
    return spec.recipe.rpartition(":")[2] if ":" in spec.recipe else spec.recipe


class RewardMix:
    def __init__(self, cfg: RewardConfig):
        self.default = [(spec, resolve_recipe(spec.recipe)) for spec in cfg.default]
        self.by_source = {
            source: [(spec, resolve_recipe(spec.recipe)) for spec in mix] for source, mix in cfg.by_data_source.items()
        }
        self.accuracy_fn = resolve_recipe(cfg.accuracy_recipe)

    def score(self, completions: list[str], samples: list[dict]) -> tuple[list[float], list[dict[str, float]]]:
        """Weighted total per completion and its named components (unweighted scores)."""
        totals = [0.0] * len(completions)
        components: list[dict[str, float]] = [{} for _ in completions]
        by_source = defaultdict(list)
        for i, sample in enumerate(samples):
            by_source[sample["data_source"]].append(i)
        for source, idx in by_source.items():
            for spec, fn in self.by_source.get(source, self.default):
                scores = _call(fn, spec, [completions[i] for i in idx], [samples[i] for i in idx])
                for i, score in zip(idx, scores):
                    if score is not None:
                        totals[i] += spec.weight * float(score)
                        components[i][component_name(spec)] = float(score)
        return totals, components

    def accuracy(self, completions: list[str], samples: list[dict]) -> list[float]:
        scores = self.accuracy_fn(completions, samples)
        return [float(s or 0.0) for s in scores]


def _call(fn: Callable, spec: RecipeSpec, completions: list[str], samples: list[dict]) -> list:
    scores = fn(completions, samples, **spec.kwargs)
    if len(scores) != len(completions):
        raise RuntimeError(
            f"reward recipe '{spec.recipe}' returned {len(scores)} scores for {len(completions)} completions"
        )
    return list(scores)
