"""Prompt data sets: JSONL, parquet or a saved HF data set, read into the canonical row schema.

A row is {"id", "messages", "answer", "data_source", "meta"}; message content is a string or
a list of parts {"type": "text", "text"} / {"type": "image", "image": path or bytes} /
{"type": "video", "video": file path or list of frames (paths or bytes), "fps": optional}. Rows in
a data set's own columns are mapped first (data/columns.py). Image paths are relative to the
data set's file (or directory) and are resolved (and checked to exist) at load time, so a
missing file fails before training starts, naming the row and the path. A path that leaves the
data set's directory and `data.media_roots` is bad input too (data/media.py), as is a field of
another type than the schema's (data/row_fields.py); keys the schema does not name are dropped.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from vlrft.data import row_fields
from vlrft.data.columns import ColumnError, Columns, mapped_row
from vlrft.data.media import MediaFile, MediaPaths, shown
from vlrft.data.row_fields import FieldError
from vlrft.errors import VlrftError
from vlrft.json_shape import exceeds


class DataError(VlrftError, ValueError):
    """A user-caused data problem; the message is one line naming the file, row and field."""


REQUIRED_FIELDS = ("messages", "answer")


def load_rows(path: str | Path, columns: Columns = Columns(), media: MediaPaths = MediaPaths()) -> list[dict]:
    """Read and validate a data set (`read_rows`). The first bad row raises its DataError."""
    return read_rows(path, skip_bad=False, columns=columns, media=media)[0]


def read_rows(
    path: str | Path, skip_bad: bool, columns: Columns = Columns(), media: MediaPaths = MediaPaths()
) -> tuple[list[dict], list[str]]:
    """(valid rows, one-line problems of the rows left out) of a JSONL file, a parquet file or
    a directory an HF `datasets` data set was saved to (`save_to_disk`). Rows without
    "messages" go through the column mapping (data/columns.py); image paths become absolute
    and must stay where `media` allows.
    With `skip_bad` a bad row (invalid JSON, not an object, a missing field, a field of another
    type, a missing image) is left out and its problem returned; otherwise it raises. A data
    set with no valid row raises either way."""
    path = Path(path)
    if path.is_dir():
        raw_rows = enumerate(hf_dataset_rows(path))
    elif path.suffix == ".parquet" and path.is_file():
        raw_rows = enumerate(parquet_rows(path))
    elif path.is_file():
        raw_rows = jsonl_rows(path)
    else:
        raise DataError(f"dataset file not found: {path}")
    base = path if path.is_dir() else path.parent
    media = media.within(path.parent)  # a saved HF data set names files beside its folder too
    rows, problems = [], []
    for number, raw in raw_rows:
        try:
            if isinstance(raw, DataError):
                raise raw
            rows.append(_validate_row(raw, path, number, columns, base, media))
        except DataError as err:
            if not skip_bad:
                raise
            problems.append(str(err))
    what = "dataset" if path.is_dir() else "dataset file"
    if not rows and problems:
        raise DataError(f"{what} {path} has no valid rows ({len(problems)} bad, first: {problems[0]})")
    if not rows:
        raise DataError(f"{what} {path} has no rows")
    return rows, problems


def canonical_row(raw, number: int, columns: Columns = Columns(), media: MediaPaths = MediaPaths()) -> dict:
    """One row given in Python (the trainer's `step` API) read as a data file's row would be;
    its image paths are relative to the working directory, which stands for the data set's
    directory. Errors name it "prompt:<number>"."""
    return _validate_row(raw, Path("prompt"), number, columns, Path.cwd(), media.within(Path.cwd()))


def jsonl_rows(path: Path):
    """(line number, row or the DataError of an unreadable line) of a JSONL file."""
    with path.open("rb") as f:  # decoded line by line: one non-UTF-8 line is one bad line
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                row = DataError(f"{path}:{line_no}: invalid JSON (not UTF-8 text)")
            except json.JSONDecodeError as err:
                row = DataError(f"{path}:{line_no}: invalid JSON ({err.msg})")
            except RecursionError:  # arrays or objects nested thousands deep
                row = DataError(f"{path}:{line_no}: invalid JSON (nested too deep to read)")
            except ValueError as err:  # a number over Python's digit limit (sys.get_int_max_str_digits)
                row = DataError(f"{path}:{line_no}: invalid JSON ({str(err).split(';')[0]})")
            yield line_no, row


def parquet_rows(path: Path) -> list[dict]:
    """A parquet file's rows as stored (an HF Image column stays {"bytes", "path"})."""
    import pyarrow.parquet  # noqa: PLC0415 - only parquet data sets need it

    try:
        return pyarrow.parquet.read_table(path).to_pylist()
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"{path}: cannot read parquet ({err})") from None


def hf_dataset_rows(path: Path) -> list[dict]:
    """The rows of a data set saved with `Dataset.save_to_disk`, as stored (images undecoded)."""
    try:
        import datasets  # noqa: PLC0415 - only HF data sets need it
    except ImportError:
        raise DataError(f"{path} is a directory: reading an HF data set needs `pip install datasets`") from None
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001 - not a saved data set, or a damaged one
        raise DataError(f"{path}: not a data set saved with save_to_disk ({err})") from None
    if isinstance(data, datasets.DatasetDict):
        raise DataError(f"{path} holds the splits {sorted(data)}: point the path at one of them ({path}/<split>)")
    try:
        return data.with_format("arrow")[:].to_pylist()
    except Exception as err:  # noqa: BLE001 - arrow raises several types for data it cannot convert
        raise DataError(f"{path}: cannot read its rows ({err})") from None


def _validate_row(row, path: Path, number: int, columns: Columns, base: Path, media: MediaPaths) -> dict:
    """The canonical row of a raw one, or a DataError naming it: its fields checked
    (data/row_fields.py) and rebuilt from what the schema allows (other keys of the row, its
    messages and their parts are dropped)."""
    where = row_location(row, path, number)
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object")
    try:
        if exceeds(row, row_fields.MAX_NESTING):
            raise FieldError(f"nested more than {row_fields.MAX_NESTING} deep")
        if "messages" not in row:
            try:
                row = mapped_row(row, columns, base)
            except ColumnError as err:
                raise FieldError(str(err)) from None
        for name in REQUIRED_FIELDS:
            if row.get(name) is None:
                raise FieldError(f"missing required field '{name}'")
        if not isinstance(row["messages"], list) or not row["messages"]:
            raise FieldError("'messages' must be a non-empty list of chat messages")
        return {
            "id": row_fields.row_id(row.get("id"), f"{path.stem}-{number}"),
            "messages": [_resolve_message(m, base, where, media) for m in row["messages"]],
            "answer": row_fields.answer_text(row["answer"]),
            "data_source": row_fields.data_source(row.get("data_source")),
            "meta": row_fields.meta(row.get("meta")),
        }
    except FieldError as err:
        raise DataError(f"{where}: {err}") from None


def row_location(row, path: Path, number: int) -> str:
    """`FILE:LINE (row id 'q1')` for messages; the id only when it is one (a string or an
    integer, cut when long): a row's id is data too."""
    where = f"{path}:{number}"
    if not isinstance(row, dict):
        return where
    row_id = row.get("id")
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        return f"{where} (row id '?')"
    return f"{where} (row id {row_fields.quoted(row_id)})"


def _resolve_message(message, base: Path, where: str, media: MediaPaths) -> dict:
    """A message with only its role and content; its parts checked, media paths resolved."""
    role = row_fields.role(message)
    content = message["content"]
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise FieldError("message 'content' must be a string or a list of parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append(row_fields.text_part(part))
        elif kind == "image":
            image = part.get("image")
            if isinstance(image, bytes) and image:  # encoded image bytes (parquet, HF data sets): decoded at encoding
                parts.append({"type": "image", "image": image})
                continue
            if not isinstance(image, str) or not image:
                raise FieldError("an image part needs an 'image' path or bytes")
            parts.append({"type": "image", "image": existing_file(image, base, where, "image", media)})
        elif kind == "video":
            parts.append(_resolve_video(part, base, where, media))
        else:
            raise FieldError(f"content part type must be 'text', 'image' or 'video', got {row_fields.kind(kind)}")
    return {"role": role, "content": parts}


def existing_file(path: str, base: Path, where: str, what: str, media: MediaPaths) -> MediaFile:
    """`path` (relative to `base`) resolved, with the root it lies in (data/media.py), or a
    one-line error when it leaves the directories `media` allows (checked first: a refused
    path's existence is not disclosed), no such file exists, or the system cannot take the
    path at all (a NUL byte, a name too long: any OSError or ValueError)."""
    full = Path(path) if Path(path).is_absolute() else base / path
    try:
        resolved = media.resolve(full)
        found = resolved is not None and _is_file(resolved)
    except (OSError, ValueError) as err:
        raise DataError(f"{where}: unusable {what} path {shown(full)} ({getattr(err, 'strerror', None) or err})") from None
    if resolved is None:
        raise DataError(f"{where}: {what} path outside the data set's directory and data.media_roots: {shown(full)} "
                        "(data.allow_external_media: true allows it)")
    if not found:
        raise DataError(f"{where}: {what} file not found: {shown(full)}")
    return resolved


def _is_file(path: str) -> bool:
    """Whether `path` is a regular file; a name the system refuses (too long) raises OSError."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _resolve_video(part: dict, base: Path, where: str, media: MediaPaths) -> dict:
    """A video part with its file, or each of its frame files, made absolute and checked;
    frames given as bytes stay bytes. `fps`, when given, is a positive number."""
    video = part.get("video")
    checked = {"type": "video"}
    if "fps" in part:
        checked["fps"] = row_fields.frame_rate(part["fps"])
    if isinstance(video, str) and video:
        return {**checked, "video": existing_file(video, base, where, "video", media)}
    if isinstance(video, list) and video and all(isinstance(f, (str, bytes)) and f for f in video):
        return {**checked, "video": [f if isinstance(f, bytes) else existing_file(f, base, where, "video", media)
                                     for f in video]}
    raise FieldError("a video part needs 'video': a file path or a non-empty list of frame images")


def message_text(content) -> str:
    """A message's text: its text parts joined by newlines (image parts dropped)."""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content if part.get("type") == "text")


def user_text(messages: list[dict]) -> str:
    """The text of the user's messages, joined by newlines: the question a verifier or judge reads."""
    return "\n".join(message_text(m["content"]) for m in messages if m.get("role") == "user")


def parts_of(row: dict, kind: str) -> list[dict]:
    """A row's content parts of one type ("image", "video"), in the order they appear in its messages."""
    return [
        part
        for message in row["messages"]
        if not isinstance(message["content"], str)
        for part in message["content"]
        if part["type"] == kind
    ]


def modalities_of(rows: list[dict]) -> set[str]:
    """The vision modalities ("image", "video") any of `rows` holds."""
    return {kind for kind in ("image", "video") if any(parts_of(row, kind) for row in rows)}


def image_sources(row: dict) -> list[str | bytes]:
    """A row's images (absolute paths or encoded bytes) in the order they appear in its messages."""
    return [part["image"] for part in parts_of(row, "image")]
