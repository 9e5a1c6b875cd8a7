"""Exact / normalised answer match."""

from __future__ import annotations

import re

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str:
    """The content of the last <answer>...</answer> tag, or the whole text when there is none."""
    found = _ANSWER_TAG.findall(text)
    return found[-1] if found else text


def normalise(text: str) -> str:
    """Lower-case, collapse white space, drop surrounding punctuation and quotes."""
    text = " ".join(text.lower().split())
    return text.strip(" .,;:!?\"'`")


def exact_match(completions: list[str], samples: list[dict], normalised: bool = True) -> list[float]:
    """1.0 when the extracted answer equals the sample's answer (normalised by default), else 0.0."""
    scores = []
    for completion, sample in zip(completions, samples):
        got, want = extract_answer(completion), str(sample["answer"])
        if normalised:
            got, want = normalise(got), normalise(want)
        scores.append(1.0 if got == want else 0.0)
    return scores
