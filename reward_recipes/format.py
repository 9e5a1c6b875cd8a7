"""Format recipes: does the response follow the requested answer format?"""

from __future__ import annotations

import re

_STRICT = re.compile(r"^\s*<answer>[^<>]+</answer>\s*$", re.DOTALL)


def answer_tag_format(completions: list[str], samples: list[dict]) -> list[float]:
    """1.0 when the whole response is one non-empty <answer>...</answer>, else 0.0."""
    return [1.0 if _STRICT.match(c) else 0.0 for c in completions]
