"""Grounding: IoU between a predicted box and the sample's box."""

from __future__ import annotations

import json
import re

from reward_recipes.answer_match import extract_answer

_NUMBER = r"-?\d+(?:\.\d+)?"
_BOX = re.compile(rf"\[\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\]")


def parse_box(value) -> tuple[float, float, float, float] | None:
    """A box [x1, y1, x2, y2] from a list, a JSON string or text containing "[x1, y1, x2, y2]"
    (the last one). None when malformed or degenerate (x2 <= x1 or y2 <= y1)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # not JSON, or nested past the interpreter's limit
            found = _BOX.findall(value)
            value = [float(v) for v in found[-1]] if found else None
    if not isinstance(value, (list, tuple)) or len(value) != 4:
        return None
    try:
        x1, y1, x2, y2 = (float(v) for v in value)
    except (TypeError, ValueError):
        return None
    return (x1, y1, x2, y2) if x2 > x1 and y2 > y1 else None


def box_iou(a: tuple, b: tuple) -> float:
    inter_w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    inter_h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = inter_w * inter_h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union


def grounding_iou(completions: list[str], samples: list[dict]) -> list[float]:
    """IoU of the response's box with the sample's `answer` box; 0.0 when either is malformed."""
    scores = []
    for completion, sample in zip(completions, samples):
        predicted, target = parse_box(extract_answer(completion)), parse_box(sample["answer"])
        scores.append(box_iou(predicted, target) if predicted and target else 0.0)
    return scores
