"""Format recipes: does the response follow the requested answer format?"""

from __future__ import annotations

import re

_STRICT = re.compile(r"^\s*<answer>[^<>]+</answer>\s*$", re.DOTALL)
_THINK_ANSWER = re.compile(r"^\s*<think>.*</think>\s*<answer>(.*)</answer>\s*$", re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def answer_tag_format(completions: list[str], samples: list[dict]) -> list[float]:
    """1.0 when the whole response is one non-empty <answer>...</answer>, else 0.0."""
    return [1.0 if _STRICT.match(c) else 0.0 for c in completions]


def _strict_think_answer(text: str) -> bool:
    if any(text.count(tag) != 1 for tag in _TAGS):
        return False
    match = _THINK_ANSWER.match(text)
    return bool(match and match.group(1).strip())


def _lenient_think_answer(text: str) -> bool:
    think = _THINK.search(text)
    return bool(think and any(m.group(1).strip() for m in _ANSWER.finditer(text, think.end())))


def think_answer_format(completions: list[str], samples: list[dict], strict: bool = True) -> list[float]:
    """1.0 when the response has the think-then-answer format, else 0.0.

    strict=True: the whole response is `<think>...</think>` then `<answer>...</answer>`, with only
    white space before, between and after; each of the four tags occurs exactly once and the
    answer holds something other than white space (the think block may be empty).
    strict=False: somewhere in the response a `<think>...</think>` block is followed (anywhere
    later) by an `<answer>...</answer>` block with non-blank content; other text, and further
    tags, are allowed around them.
    """
    check = _strict_think_answer if strict else _lenient_think_answer
    return [1.0 if check(c or "") else 0.0 for c in completions]
