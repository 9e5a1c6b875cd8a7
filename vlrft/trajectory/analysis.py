"""Statistics practitioners read rollouts for, as pure functions over trajectory records.

A record is one scored response (one JSONL line of a saved step): at least "data_source",
"group_id", "reward", "components" (name -> score), "correct" (0/1 by the accuracy recipe),
"response_text" (or the "repetition" and "reflection_words" it gives), "response_length",
"truncated", and optionally "entropy" (per token).
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


def distribution(values) -> dict[str, float]:
    """mean / std (population) / min / p50 / p90 / max of a list or tensor; empty input gives
    {}. Sorted and summed in float64: a run's token entropies can number in the millions."""
    import torch  # here, not at the top: `vlrft reward-server` imports this module (through the CLI) and never needs torch

    ordered = torch.as_tensor(values, dtype=torch.float64).flatten().sort().values
    if ordered.numel() == 0:
        return {}
    mean = ordered.mean()
    std = ((ordered - mean) ** 2).mean().sqrt()

    def quantile(q: float) -> float:  # nearest rank: the ceil(q * n)-th smallest
        return float(ordered[max(0, math.ceil(q * ordered.numel()) - 1)])

    return {"mean": float(mean), "std": float(std), "min": float(ordered[0]),
            "p50": quantile(0.5), "p90": quantile(0.9), "max": float(ordered[-1])}


def text_numbers(record: dict) -> tuple[float, int]:
    """(repetition score, reflection words) of a record's response: its "repetition" and
    "reflection_words" where it carries them (the trainer computes them where the text is),
    else from its "response_text"."""
    if "repetition" in record:
        return record["repetition"], record["reflection_words"]
    text = record["response_text"]
    return repetition_score(text), sum(reflection_counts(text).values())


def generated_entropies(record: dict) -> list:
    """The record's per-token entropies of the tokens the policy generated (a multi-turn
    record's `trained` marks them; its observation tokens are left out)."""
    entropy, trained = record.get("entropy") or [], record.get("trained")
    return entropy if trained is None else [h for h, k in zip(entropy, trained) if k]


def summarise(records: list[dict], token_entropies=None) -> dict[str, float]:
    """Flat statistics of a set of records (one step, or a whole run), keyed for metric sinks.
    `token_entropies` (a tensor of every token's finite entropy) stands in for the records'
    "entropy" lists when they carry none."""
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
    texts = [text_numbers(r) for r in records]
    out["repetition_mean"] = statistics.fmean(repetition for repetition, _ in texts)
    out["reflection_words_per_response"] = statistics.fmean(words for _, words in texts)
    out["zero_variance_group_frac"] = zero_variance_group_fraction(
        [r["reward"] for r in records], [r["group_id"] for r in records]
    )
    if token_entropies is None:
        token_entropies = [h for r in records for h in generated_entropies(r) if h is not None]  # None: non-finite
    out |= {f"entropy/{k}": v for k, v in distribution(token_entropies).items() if k in ("mean", "p90", "max")}
    return out
