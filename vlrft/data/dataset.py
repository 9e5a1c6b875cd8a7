"""Prompt datasets in the canonical row schema (DESIGN.md, "Conventions").

A row is {"id", "messages", "answer", "data_source", "meta"}; message content is a string or
a list of parts {"type": "text", "text"} / {"type": "image", "image": path}. Image paths are
relative to the dataset file and are resolved (and checked to exist) at load time, so a
missing file fails before training starts, naming the row and the path.
"""

from __future__ import annotations

import json
from pathlib import Path

from vlrft.errors import VlrftError


class DataError(VlrftError, ValueError):
    """A user-caused data problem; the message is one line naming the file, row and field."""


REQUIRED_FIELDS = ("messages", "answer")


def load_rows(path: str | Path) -> list[dict]:
    """Read and validate a JSONL prompt file; image paths become absolute. The first bad line
    raises its DataError."""
    return read_rows(path, skip_bad=False)[0]


def read_rows(path: str | Path, skip_bad: bool) -> tuple[list[dict], list[str]]:
    """(valid rows, one-line problems of the lines left out). With `skip_bad` a bad line
    (invalid JSON, not an object, a missing field, a missing image) is left out and its
    problem returned; otherwise it raises. A file with no valid row raises either way."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    rows, problems = [], []
    with path.open("rb") as f:  # decoded line by line: one non-UTF-8 line is one bad line
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(_parse_row(line, path, line_no))
            except DataError as err:
                if not skip_bad:
                    raise
                problems.append(str(err))
    if not rows and problems:
        raise DataError(f"dataset file {path} has no valid rows ({len(problems)} bad, first: {problems[0]})")
    if not rows:
        raise DataError(f"dataset file {path} has no rows")
    return rows, problems


def _parse_row(line: bytes, path: Path, line_no: int) -> dict:
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{path}:{line_no}: invalid JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{line_no}: invalid JSON ({err.msg})") from None
    return _validate_row(row, path, line_no)


def _validate_row(row: dict, path: Path, line_no: int) -> dict:
    where = f"{path}:{line_no} (row id {row.get('id', '?')!r})" if isinstance(row, dict) else f"{path}:{line_no}"
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object")
    for name in REQUIRED_FIELDS:
        if name not in row:
            raise DataError(f"{where}: missing required field '{name}'")
    if not isinstance(row["messages"], list) or not row["messages"]:
        raise DataError(f"{where}: 'messages' must be a non-empty list of chat messages")
    row = dict(row)
    row.setdefault("id", f"{path.stem}-{line_no}")
    row.setdefault("data_source", "default")
    row.setdefault("meta", {})
    row["answer"] = str(row["answer"])
    row["messages"] = [_resolve_message(m, path.parent, where) for m in row["messages"]]
    return row


def _resolve_message(message: dict, base: Path, where: str) -> dict:
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise DataError(f"{where}: each message needs 'role' and 'content'")
    content = message["content"]
    if isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise DataError(f"{where}: message 'content' must be a string or a list of parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            if not isinstance(part.get("image"), str) or not part["image"]:
                raise DataError(f"{where}: an image part needs an 'image' path")
            image = Path(part["image"])
            image = image if image.is_absolute() else base / image
            if not image.is_file():
                raise DataError(f"{where}: image file not found: {image}")
            part = {**part, "image": str(image)}
        elif kind != "text":
            raise DataError(f"{where}: content part type must be 'text' or 'image', got {kind!r}")
        parts.append(part)
    return {**message, "content": parts}


def message_text(content) -> str:
    """A message's text: its text parts joined by newlines (image parts dropped)."""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content if part.get("type") == "text")


def user_text(messages: list[dict]) -> str:
    """The text of the user's messages, joined by newlines: the question a verifier or judge reads."""
    return "\n".join(message_text(m["content"]) for m in messages if m.get("role") == "user")


def image_paths(row: dict) -> list[str]:
    """Image paths of a row in the order they appear in its messages."""
    return [
        part["image"]
        for message in row["messages"]
        if not isinstance(message["content"], str)
        for part in message["content"]
        if part["type"] == "image"
    ]
