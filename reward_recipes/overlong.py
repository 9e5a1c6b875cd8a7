"""DAPO's soft overlong penalty (arXiv 2503.14476), a length-only reward recipe.

Add it beside an accuracy recipe: it is 0 for responses that leave `cache_tokens` of room
below `max_tokens`, falls linearly to -1 across that last stretch, and is -1 beyond.
"""

from __future__ import annotations


def overlong_penalty(length: int, max_tokens: int, cache_tokens: int) -> float:
    """0 if L <= Lmax - Lcache; ((Lmax - Lcache) - L) / Lcache if L <= Lmax; else -1."""
    soft_start = max_tokens - cache_tokens
    if length <= soft_start:
        return 0.0
    if length <= max_tokens:
        return (soft_start - length) / cache_tokens
    return -1.0


def soft_overlong_penalty(completions, samples, max_tokens: int, cache_tokens: int):
    """Recipe: the penalty of each completion's response length in tokens."""
    if not 0 < cache_tokens <= max_tokens:
        raise ValueError(f"soft_overlong_penalty needs 0 < cache_tokens <= max_tokens, got {cache_tokens}, {max_tokens}")
    return [overlong_penalty(s["response_length"], max_tokens, cache_tokens) for s in samples]
