"""A data set's own columns -> the canonical row schema, so public data sets train as they are.

A row that has "messages" is canonical already. Any other row is mapped by `Columns`:
- the prompt (`prompt_key`) is a string (the user's question, through `prompt_template`) or a
  list of chat messages (verl's "prompt" column);
- `<image>` markers in the text place the images (`image_key`) in order (Geo3K, EasyR1); a
  text without markers gets its images before the text;
- an image is a path (relative to the data set's file or directory), PNG/JPEG bytes, or an HF
  `Image` feature's stored form `{"bytes": ..., "path": ...}`;
- the answer (`answer_key`) may name a nested field with dots (verl's
  `reward_model.ground_truth`); "id", "data_source" and "meta" columns are used when present.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

IMAGE_MARKER = "<image>"


@dataclass(frozen=True)
class Columns:
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    image_key: str = "images"
    system_prompt: str = ""  # a system message for rows whose prompt has none
    prompt_template: str = "{prompt}"  # a string prompt in context; other braces stay as they are


def columns_from(data_config) -> Columns:
    """The mapping the config's `data.*_key`, `system_prompt` and `prompt_template` name."""
    return Columns(**{f.name: getattr(data_config, f.name) for f in fields(Columns)})


class ColumnError(ValueError):
    """A row the mapping cannot read; the message says which column and why (no location)."""


def nested(row: dict, key: str):
    """`row[a][b]` for key "a.b"; KeyError when a part is missing or null (a parquet file's
    rows all have every column, null where a row has no value)."""
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            raise KeyError(key)
        value = value[part]
    return value


def image_source(item, base: Path):
    """A path (str, resolved against `base`) or bytes for one image cell."""
    if isinstance(item, dict):  # the HF Image feature's storage: bytes win, else its path
        item = item.get("bytes") or item.get("path")
    if isinstance(item, (bytes, bytearray)) and item:
        return bytes(item)
    if isinstance(item, str) and item:
        path = Path(item)
        return str(path if path.is_absolute() else base / path)
    raise ColumnError(f"an image must be a path, bytes or {{'bytes', 'path'}}, got {type(item).__name__}")


def split_at_markers(text: str, images: list) -> list[dict]:
    """The text's parts with the next images in place of its `<image>` markers."""
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) - 1 > len(images):
        raise ColumnError(f"more {IMAGE_MARKER} markers than images ({len(images)})")
    parts = []
    for k, piece in enumerate(pieces):
        if k > 0:
            parts.append({"type": "image", "image": images[k - 1]})
        if piece.strip():
            parts.append({"type": "text", "text": piece})
    return parts


def mapped_row(raw: dict, columns: Columns, base: Path) -> dict:
    """A canonical row (without id defaults; `dataset` validates it) from a data set's row."""
    try:
        prompt = nested(raw, columns.prompt_key)
    except KeyError:
        raise ColumnError(f"no prompt in column '{columns.prompt_key}' (data.prompt_key) and no 'messages'") from None
    try:
        answer = nested(raw, columns.answer_key)
    except KeyError:
        raise ColumnError(f"no answer in column '{columns.answer_key}' (data.answer_key)") from None
    cell = raw.get(columns.image_key)
    cells = [] if cell is None else cell if isinstance(cell, list) else [cell]
    images = [image_source(item, base) for item in cells]
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": columns.prompt_template.replace("{prompt}", prompt)}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ColumnError(f"prompt column '{columns.prompt_key}' must be a string or a list of chat messages")
    used = 0  # images placed so far
    for message in messages:
        content = message["content"]
        if message["role"] == "user" and isinstance(content, str) and IMAGE_MARKER in content:
            message["content"] = split_at_markers(content, images[used:])
            used += content.count(IMAGE_MARKER)
    if used < len(images):  # no markers: the images go before the first user message's text
        first = next((m for m in messages if m["role"] == "user"), None)
        if first is None:
            raise ColumnError("the row has images but no user message")
        text = first["content"]
        if not isinstance(text, (str, list)):
            raise ColumnError("a message's content must be a string or a list of parts")
        rest = [{"type": "text", "text": text}] if isinstance(text, str) else text
        first["content"] = [{"type": "image", "image": image} for image in images[used:]] + rest
    if columns.system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": columns.system_prompt})
    row = {"messages": messages, "answer": answer}
    for key in ("id", "data_source", "meta"):
        if raw.get(key) is not None:
            row[key] = raw[key]
    return row
