"""Multiple choice and counting: answers read from the extracted answer text."""

from __future__ import annotations

import re

from reward_recipes.answer_match import extract_answer

# "(B)", "B.", "B)", "B:" or a lone "B", as a word of its own.
_CHOICE = re.compile(r"(?<![A-Za-z])\(?([A-Z])\)?(?:[.):]|(?![A-Za-z]))")
_NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve".split())}
_TOKEN = re.compile(r"(-?\d+)|([a-z]+)")
_MAX_DIGITS = 4000  # under Python's default limit for int(text), 4300


def chosen_letter(text: str) -> str | None:
    """The option letter a response picked: the last standalone capital letter of its answer."""
    found = _CHOICE.findall(extract_answer(text))
    return found[-1] if found else None


def multiple_choice(completions: list[str], samples: list[dict]) -> list[float]:
    """1.0 when the picked letter equals the sample's answer letter (e.g. "B"), else 0.0."""
    return [1.0 if chosen_letter(c) == str(s["answer"]).strip().strip("()").upper() else 0.0
            for c, s in zip(completions, samples)]


def read_count(text: str) -> int | None:
    """The last integer (digits or an English number word up to twelve) in the answer, or None."""
    last = None  # kept as it goes: a list of every word of a long answer would take ~60 bytes a word
    for match in _TOKEN.finditer(extract_answer(text).lower()):
        digits, word = match.groups()
        if digits is not None or word in _NUMBER_WORDS:
            last = match.group()
    if last in _NUMBER_WORDS:
        return _NUMBER_WORDS[last]
    # int() refuses more digits than Python's limit (a ValueError would fail the whole call);
    # no count is that long, so such an answer is unreadable.
    return int(last) if last is not None and len(last) <= _MAX_DIGITS else None


def counting(completions: list[str], samples: list[dict]) -> list[float]:
    """1.0 when the counted number equals the sample's integer answer, else 0.0 (unreadable: 0)."""
    return [1.0 if read_count(c) == int(s["answer"]) else 0.0 for c, s in zip(completions, samples)]
