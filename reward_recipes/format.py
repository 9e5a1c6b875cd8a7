"""Format recipes: does the response follow the requested answer format?"""

from __future__ import annotations

import re

from reward_recipes.tags import tagged_spans

# Linear in the text: both are anchored at its start, _STRICT's parts cannot trade characters,
# and _THINK_ANSWER runs only on a text holding each tag once, so each `.*` has one place to
# end. Tags anywhere in a text are found with str.find (reward_recipes/tags.py).
_STRICT = re.compile(r"^\s*<answer>[^<>]+</answer>\s*$", re.DOTALL)
_THINK_ANSWER = re.compile(r"^\s*<think>.*</think>\s*<answer>(.*)</answer>\s*$", re.DOTALL)
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
    think = next(tagged_spans(text, "<think>", "</think>"), None)
    if think is None:
        return False
    after = think[1] + len("</think>")
    return any(text[begin:end].strip() for begin, end in tagged_spans(text, "<answer>", "</answer>", after))


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
