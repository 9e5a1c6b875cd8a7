"""Exact / normalised answer match."""

from __future__ import annotations

from reward_recipes.tags import last_answer


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced, so \\frac{1}{2} survives), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None  # unbalanced: no answer


def extract_answer(text: str) -> str:
    """The last <answer>...</answer> tag's content (else the whole text), then, if that holds a
    \\boxed{...}, the last box's content."""
    tagged = last_answer(text)
    answer = tagged if tagged is not None else text
    boxed = last_boxed(answer)
    return boxed if boxed is not None else answer


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
