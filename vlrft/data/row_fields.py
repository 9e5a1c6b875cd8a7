"""What a canonical row's fields may hold (docs/datasets.md, "Row fields").

A row is data, possibly from a stranger, and its fields travel far: `data_source` is sorted with
the others and becomes a metric name, `id` names the row in every message, `meta` and `answer`
reach reward recipes and the reward server as JSON, the messages reach the chat template. So
each field's type and shape is checked when the row is loaded; a field of the wrong type is a
bad row then, not a TypeError in the trainer later. Values nest at most MAX_NESTING deep:
JSON's writer, pickle (rows cross ranks) and deepcopy recurse, and a row nested thousands deep
would stop them far from the loader.
"""

from __future__ import annotations

import math

MAX_NESTING = 32  # lists and objects within each other; real rows nest a handful deep
ROLES = ("system", "user", "assistant", "tool")
SHOWN_CHARS = 80  # of a value quoted in a message
JSON_LEAVES = (str, int, float, bool, type(None))


class FieldError(ValueError):
    """A row field the checks refuse; the message names the field (no location)."""


def kind(value) -> str:
    """A value's type for a message: `int 7`, `list`, `str 'abc'` (cut)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and len(str(value)) <= SHOWN_CHARS:
        return f"{type(value).__name__} {value}"
    if isinstance(value, str):
        return f"str {value[:SHOWN_CHARS]!r}" + ("..." if len(value) > SHOWN_CHARS else "")
    return type(value).__name__


def quoted(value: str | int) -> str:
    """A row's id as messages show it: its repr, cut after SHOWN_CHARS characters."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}..."


def json_problem(value) -> str | None:
    """Why `value` is not plain JSON data (objects with string keys, arrays, strings, numbers,
    true/false/null), or None when it is. Nesting is checked first (vlrft.json_shape)."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            key = next((k for k in item if not isinstance(k, str)), None)
            if key is not None:
                return f"an object key must be a string, got {kind(key)}"
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif not isinstance(item, JSON_LEAVES):
            return f"holds a {type(item).__name__}, not JSON data"
    return None


def row_id(value, default: str) -> str | int:
    """The row's id: a non-empty string or an integer; `default` when absent (None)."""
    if value is None:
        return default
    if (isinstance(value, str) and value) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise FieldError(f"'id' must be a non-empty string or an integer, got {kind(value)}")


def data_source(value) -> str:
    """The row's data source: a non-empty printable string (a metric name); "default" when absent."""
    if value is None:
        return "default"
    if isinstance(value, str) and value and value.isprintable():
        return value
    raise FieldError(f"'data_source' must be a non-empty string without control characters, got {kind(value)}")


def answer_text(value) -> str:
    """The row's answer as the text recipes compare with: a string as it is; a number, or JSON
    data (a box's coordinates), in its text form."""
    if isinstance(value, float) and not math.isfinite(value):
        raise FieldError(f"'answer' must be a string, a finite number or JSON data, got {kind(value)}")
    problem = json_problem(value)
    if problem is not None:
        raise FieldError(f"'answer' {problem}")
    return value if isinstance(value, str) else str(value)


def meta(value) -> dict:
    """The row's meta: a JSON object (it is sent to the reward server as JSON); {} when absent."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FieldError(f"'meta' must be a JSON object, got {kind(value)}")
    problem = json_problem(value)
    if problem is not None:
        raise FieldError(f"'meta' {problem}")
    return value


def role(message) -> str:
    """A message's role, one of ROLES; the message must be an object with 'role' and 'content'."""
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise FieldError("each message needs 'role' and 'content'")
    if message["role"] not in ROLES:
        raise FieldError(f"a message's 'role' must be one of {', '.join(ROLES)}, got {kind(message['role'])}")
    return message["role"]


def text_part(part: dict) -> dict:
    """A text part, with its text a string."""
    if not isinstance(part.get("text"), str):
        raise FieldError(f"a text part needs 'text', a string, got {kind(part.get('text'))}")
    return {"type": "text", "text": part["text"]}


def frame_rate(value) -> float | int:
    """A video part's 'fps': a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise FieldError(f"a video part's 'fps' must be a positive number, got {value!r}"[:200])
    return value
