"""How deep and how big a parsed JSON value is, measured without recursion.

JSON from strangers (a reward-server request, a tool call, a data row) is parsed by Python's
json, in C and in one pass; what a parse alone does not bound, this measures afterwards: how
deep lists and objects nest (JSON's writer, pickle and deepcopy recurse once per level, far
from the parser) and how many values there are (each a Python object of tens of bytes). One
iterator per open level, nothing per value, and the walk stops at the first value past a limit.
"""

from __future__ import annotations

CONTAINERS = (list, tuple, dict)


def exceeds(value, max_depth: int, max_values: int | None = None) -> str | None:
    """"depth" when lists, tuples or dicts nest more than `max_depth` levels (the outermost is
    level 1), "values" when `value` holds more than `max_values` values (containers, strings,
    numbers and literals, the outermost included; object keys aside), else None."""
    if not isinstance(value, CONTAINERS):
        return None
    count, open_levels = 1, [_children(value)]  # a child's level is len(open_levels) + 1
    while open_levels:
        for child in open_levels[-1]:
            count += 1
            if max_values is not None and count > max_values:
                return "values"
            if isinstance(child, CONTAINERS):
                if len(open_levels) + 1 > max_depth:
                    return "depth"
                open_levels.append(_children(child))
                break  # on into the child; this level's iterator goes on where it stopped
        else:
            open_levels.pop()
    return None


def _children(container):
    return iter(container.values() if isinstance(container, dict) else container)
