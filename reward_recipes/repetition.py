"""Repetition penalty: minus the fraction of a response's word n-grams that repeat an earlier one."""

from __future__ import annotations


def repeated_ngram_fraction(text: str, n: int) -> float:
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return (len(grams) - len(set(grams))) / len(grams)


def repetition_penalty(completions: list[str], samples: list[dict], n: int = 3) -> list[float]:
    """-(repeated n-grams / n-grams) per response: 0 for no repetition, near -1 for a loop."""
    if n < 1:
        raise ValueError(f"repetition_penalty needs n >= 1, got {n}")
    return [-repeated_ngram_fraction(c, n) for c in completions]
