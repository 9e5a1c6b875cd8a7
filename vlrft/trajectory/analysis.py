"""Statistics practitioners read rollouts for, as pure functions over trajectory records.

A record is one scored response (one JSONL line of a saved step): at least "data_source",
"group_id", "reward", "components" (name -> score), "correct" (0/1 by the accuracy recipe),
"response_text", "response_length", "truncated", and optionally "entropy" (per token).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict

from reward_recipes.repetition import repeated_ngram_fraction

# Words and phrases that mark self-reflection in reasoning traces (counted case-insensitively,
# as whole words).
REFLECTION_WORDS = ("wait", "hmm", "however", "alternatively", "let me check", "double-check", "verify",
                    "re-examine", "mistake", "actually")


def repetition_score(text: str, n: int = 3) -> float:
    """Fraction of the response's word n-grams that repeat an earlier one (0 = none, ~1 = a loop)."""
    return repeated_ngram_fraction(text, n)


def reflection_counts(text: str, words: tuple[str, ...] = REFLECTION_WORDS) -> dict[str, int]:
    """Occurrences of each reflection word or phrase in `text` (whole words, any case)."""
    lowered = text.lower()
    return {w: len(re.findall(rf"(?<![\w-]){re.escape(w)}(?![\w-])", lowered)) for w in words}


def zero_variance_group_fraction(rewards: list[float], group_ids: list[int]) -> float:
    """Fraction of groups whose rewards are all equal (they carry no group-relative signal; a
    group of one response counts as all-equal). 0.0 for no groups."""
    groups: dict[int, set] = defaultdict(set)
    for reward, group in zip(rewards, group_ids):
        groups[group].add(reward)
    return sum(len(values) == 1 for values in groups.values()) / len(groups) if groups else 0.0


def per_source_accuracy(records: list[dict]) -> dict[str, float]:
    """Mean of "correct" per data source."""
    by_source: dict[str, list[float]] = defaultdict(list)
    for record in records:
        by_source[record["data_source"]].append(float(record["correct"]))
    return {source: sum(v) / len(v) for source, v in sorted(by_source.items())}


def distribution(values: list[float]) -> dict[str, float]:
    """mean / std (population) / min / p50 / p90 / max; empty input gives {}. Plain float
    arithmetic (math.fsum): a run's token entropies can number in the millions."""
    if not values:
        return {}
    ordered = sorted(values)
    mean = math.fsum(ordered) / len(ordered)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in ordered) / len(ordered))

    def quantile(q: float) -> float:  # nearest rank: the ceil(q * n)-th smallest
        return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])

    return {"mean": mean, "std": std, "min": float(ordered[0]),
            "p50": quantile(0.5), "p90": quantile(0.9), "max": float(ordered[-1])}


def summarise(records: list[dict]) -> dict[str, float]:
    """Flat statistics of a set of records (one step, or a whole run), keyed for metric sinks."""
    if not records:
        return {}
    out = {f"reward/{k}": v for k, v in distribution([r["reward"] for r in records]).items() if k in ("mean", "std")}
    components: dict[str, list[float]] = defaultdict(list)
    for r in records:
        for name, value in r["components"].items():
            if value is not None:  # None: the recipe does not apply to this sample
                components[name].append(value)
    for name, values in sorted(components.items()):
        stats = distribution(values)
        out |= {f"component/{name}/mean": stats["mean"], f"component/{name}/std": stats["std"]}
    by_source: dict[str, list[float]] = defaultdict(list)
    for r in records:
        by_source[r["data_source"]].append(r["reward"])
    for source, values in sorted(by_source.items()):
        stats = distribution(values)
        out |= {f"source/{source}/reward_mean": stats["mean"], f"source/{source}/reward_std": stats["std"]}
    out |= {f"source/{s}/accuracy": a for s, a in per_source_accuracy(records).items()}
    out["accuracy"] = statistics.fmean(float(r["correct"]) for r in records)
    out |= {f"length/{k}": v for k, v in distribution([r["response_length"] for r in records]).items()}
    out["truncated_frac"] = statistics.fmean(float(r["truncated"]) for r in records)
    out["repetition_mean"] = statistics.fmean(repetition_score(r["response_text"]) for r in records)
    out["reflection_words_per_response"] = statistics.fmean(
        sum(reflection_counts(r["response_text"]).values()) for r in records
    )
    out["zero_variance_group_frac"] = zero_variance_group_fraction(
        [r["reward"] for r in records], [r["group_id"] for r in records]
    )
    entropies = [h for r in records for h in (r.get("entropy") or []) if h is not None]  # None: non-finite
    out |= {f"entropy/{k}": v for k, v in distribution(entropies).items() if k in ("mean", "p90", "max")}
    return out
