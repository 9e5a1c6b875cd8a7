"""Tagged spans of a completion (`<answer>...</answer>`), found with str.find: linear in the
text, whatever it holds. The regex `<answer>(.*?)</answer>` is quadratic on a text of many
opening tags and no closing one (each opening scans on to the end: 160 KB took 13 s), and re
holds the GIL while it runs, stopping every other thread of the process."""

from __future__ import annotations

from collections.abc import Iterator


def tagged_spans(text: str, opening: str, closing: str, start: int = 0) -> Iterator[tuple[int, int]]:
    """(begin, end) of the content of each `opening ... closing` span from `start` on, left to
    right and not overlapping: the groups of re.finditer(opening + "(.*?)" + closing, text,
    re.DOTALL) from `start`. An opening with no closing after it ends the scan: no later
    opening has one either."""
    while True:
        found = text.find(opening, start)
        if found < 0:
            return
        begin = found + len(opening)
        end = text.find(closing, begin)
        if end < 0:
            return
        yield begin, end
        start = end + len(closing)


def last_tagged(text: str, opening: str, closing: str) -> str | None:
    """The content of the last `opening ... closing` span (as tagged_spans finds them), or None."""
    last = None
    for last in tagged_spans(text, opening, closing):
        pass
    return None if last is None else text[last[0]:last[1]]


def last_answer(text: str) -> str | None:
    """The content of the last <answer>...</answer> tag, or None."""
    return last_tagged(text, "<answer>", "</answer>")
