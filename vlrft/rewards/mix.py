"""Per-data-source weighted mix of reward recipes, every call isolated (docs/reward_recipes.md).

A recipe is a plain function over a batch:

    recipe(completions: list[str], samples: list[dict], **kwargs) -> list[Score]

with one Score per completion: a number; None ("not applicable": contributes 0, and the
component is absent for that completion); a list of numbers, one per response token (a dense
reward; token-level estimators add it to the per-token rewards, sequence-level ones its sum);
or a dict of named numbers (sub-components, logged as `<recipe>.<key>`; the score is their sum).
A call that raises, returns something malformed or exceeds its `timeout_s` scores every
completion of that call with the recipe's `fallback` and counts one failure. Each recipe runs in
a worker process of its own, found there by its config name (rewards/guard.py); one marked
`runs_in_trainer` runs in a trainer thread.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from typing import Callable

from vlrft.config import RecipeSpec, RewardConfig, component_name
from vlrft.errors import VlrftError
from vlrft.rewards.guard import RecipeFailure, call_recipe, call_recipe_in_worker, recipe_worker, runs_in_trainer
from vlrft.rewards.loading import resolve_recipe
from vlrft.workers import Worker


class RewardError(VlrftError, RuntimeError):
    """A reward problem that stops training; the message is one line naming the recipes."""


class RewardMix:
    def __init__(self, cfg: RewardConfig):
        self.default = [(spec, resolve_recipe(spec.recipe)) for spec in cfg.default]
        self.by_source = {
            source: [(spec, resolve_recipe(spec.recipe)) for spec in mix] for source, mix in cfg.by_data_source.items()
        }
        # Accuracy reuses the mix's score when the accuracy recipe is in it (a model-based
        # recipe is not run twice); otherwise it runs with the default guard settings.
        self.accuracy_spec = RecipeSpec(recipe=cfg.accuracy_recipe)
        self.accuracy_fn = resolve_recipe(cfg.accuracy_recipe)
        self.failures: Counter = Counter()  # component name -> failed calls since the last take
        self.workers: dict[str, Worker] = {}  # recipe name -> its worker process (started at its first call)

    def component_names(self) -> list[str]:
        """Every top-level component any source can produce, sorted (same on every rank)."""
        specs = [spec for spec, _ in self.default] + [s for mix in self.by_source.values() for s, _ in mix]
        return sorted({component_name(spec) for spec in specs})

    def take_failures(self) -> Counter:
        """Failed calls per component since the last take (then reset)."""
        failures, self.failures = self.failures, Counter()
        return failures

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
                name = component_name(spec)
                scores = self._guarded(fn, spec, [completions[i] for i in idx], [samples[i] for i in idx])
                for i, score in zip(idx, scores):
                    if score is None:
                        continue
                    if isinstance(score, (list, tuple)):
                        dense[i] = _add_dense(dense[i], score, spec, samples[i])
                        components[i][name] = float(sum(score))
                        continue
                    if isinstance(score, dict):
                        components[i] |= {f"{name}.{key}": float(v) for key, v in score.items()}
                        score = sum(score.values())
                    totals[i] += spec.weight * float(score)
                    components[i][name] = float(score)
        return totals, components, dense

    def accuracy(self, completions: list[str], samples: list[dict], components: list[dict] | None = None) -> list[float]:
        """1/0 correctness per completion by `accuracy_recipe` (a failed call counts as wrong)."""
        name = component_name(self.accuracy_spec)
        if components is not None and all(name in c for c in components):
            return [float(c[name]) for c in components]
        return [_as_number(s) for s in self._guarded(self.accuracy_fn, self.accuracy_spec, completions, samples)]

    def _guarded(self, fn: Callable, spec: RecipeSpec, completions: list[str], samples: list[dict]) -> list:
        """The recipe's checked scores, or its fallback. `fn` (the resolved recipe) is called
        here only when it runs in the trainer; otherwise its worker finds it by name."""
        if not completions:
            return []
        try:
            what = f"reward recipe '{spec.recipe}' on {sample_ids(samples)}"
            if runs_in_trainer(fn):
                return call_recipe(fn, completions, samples, spec.kwargs, spec.timeout_s, what)
            if spec.recipe not in self.workers:
                self.workers[spec.recipe] = recipe_worker(spec.recipe)
            worker = self.workers[spec.recipe]
            return call_recipe_in_worker(worker, spec.recipe, completions, samples, spec.kwargs, spec.timeout_s, what)
        except RecipeFailure as failure:
            name = component_name(spec)
            self.failures[name] += 1
            print(
                f"vlrft: reward recipe '{spec.recipe}' failed ({failure}); "
                f"{len(completions)} completions scored {spec.fallback} (fallback)",
                file=sys.stderr,
                flush=True,
            )
            return [spec.fallback] * len(completions)


def sample_ids(samples: list[dict], shown: int = 3) -> str:
    """The samples of a call, for messages: "sample 'a'", "samples 'a', 'b' and 3 more"."""
    ids = [repr(str(s.get("id", "?"))) for s in samples]
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return f"sample{'s' if len(ids) > 1 else ''} {', '.join(ids[:shown])}{more}"


def _as_number(score) -> float:
    """One number for a score: a dense list or a dict by its sum, None as 0."""
    if isinstance(score, dict):
        return float(sum(score.values()))
    if isinstance(score, (list, tuple)):
        return float(sum(score))
    return float(score or 0.0)


def _add_dense(current: list | None, score: list, spec: RecipeSpec, sample: dict) -> list[float]:
    length = sample.get("response_length", len(score))
    if len(score) != length:
        raise RewardError(
            f"reward recipe '{spec.recipe}' returned a dense reward of {len(score)} values for a "
            f"response of {length} tokens"
        )
    weighted = [spec.weight * float(v) for v in score]
    return weighted if current is None else [a + b for a, b in zip(current, weighted)]
