"""Per-data-source weighted mix of reward recipes.

A recipe is a plain function over a batch:

    recipe(completions: list[str], samples: list[dict], **kwargs) -> list[float | list[float] | None]

`samples[i]` holds the row fields of completion i ("id", "answer", "data_source", "meta") and,
during training, its response ("response_ids", "response_length", "truncated").
None means "not applicable" and contributes 0 to the weighted sum. A list of floats, one per
response token, is a dense reward: token-level estimators (reinforce_pp, gae) add it to the
per-token rewards, sequence-level ones add its sum to the score.
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
    "soft_overlong_penalty": "reward_recipes.overlong:soft_overlong_penalty",
    "multiple_choice": "reward_recipes.choice:multiple_choice",
    "counting": "reward_recipes.choice:counting",
    "grounding_iou": "reward_recipes.grounding:grounding_iou",
    "repetition_penalty": "reward_recipes.repetition:repetition_penalty",
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

    def score(self, completions: list[str], samples: list[dict]) -> tuple[list[float], list[dict[str, float]], list]:
        """Per completion: the weighted scalar total, the named components (unweighted; a dense
        component by its sum) and the weighted dense reward (list per token, or None)."""
        totals = [0.0] * len(completions)
        components: list[dict[str, float]] = [{} for _ in completions]
        dense: list = [None] * len(completions)
        by_source = defaultdict(list)
        for i, sample in enumerate(samples):
            by_source[sample["data_source"]].append(i)
        for source, idx in by_source.items():
            for spec, fn in self.by_source.get(source, self.default):
                scores = _call(fn, spec, [completions[i] for i in idx], [samples[i] for i in idx])
                for i, score in zip(idx, scores):
                    if score is None:
                        continue
                    if isinstance(score, (list, tuple)):
                        dense[i] = _add_dense(dense[i], score, spec, samples[i])
                        components[i][component_name(spec)] = float(sum(score))
                    else:
                        totals[i] += spec.weight * float(score)
                        components[i][component_name(spec)] = float(score)
        return totals, components, dense

    def accuracy(self, completions: list[str], samples: list[dict]) -> list[float]:
        scores = self.accuracy_fn(completions, samples)
        return [float(s or 0.0) for s in scores]


def _add_dense(current: list | None, score: list, spec: RecipeSpec, sample: dict) -> list[float]:
    length = sample.get("response_length", len(score))
    if len(score) != length:
        raise RewardError(
            f"reward recipe '{spec.recipe}' returned a dense reward of {len(score)} values for a "
            f"response of {length} tokens"
        )
    weighted = [spec.weight * float(v) for v in score]
    return weighted if current is None else [a + b for a, b in zip(current, weighted)]


def _call(fn: Callable, spec: RecipeSpec, completions: list[str], samples: list[dict]) -> list:
    scores = fn(completions, samples, **spec.kwargs)
    if len(scores) != len(completions):
        raise RuntimeError(
            f"reward recipe '{spec.recipe}' returned {len(scores)} scores for {len(completions)} completions"
        )
    return list(scores)
