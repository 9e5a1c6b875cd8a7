"""The values the test harness and a program exchange: plain data only, as JSON.

A program is hostile, so nothing it sends may run code in the harness: no pickle, no objects
of its own classes. What crosses is built only from exact types (None, bool, int, float,
complex, str, bytes, list, tuple, set, frozenset, dict); anything else stays on its side and
crosses as a numbered handle (`{"handle": n}`), which the harness can call or index but never
compare: a program's object with an `__eq__` that always says yes is compared by identity, so
it equals nothing. A list subclass is not a list here for the same reason.
Messages are framed as a 4-byte length and that many bytes of JSON.
"""

import base64
import json
import math
import os
import struct

MAX_DEPTH = 64  # nesting of containers
MAX_MESSAGE = 16 * 1024 * 1024  # bytes of one message
_CONTAINERS = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_BUILDERS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


class NotPlain(ValueError):
    """A message that is not a plain value (malformed, too deep, too large)."""


def encode(value, other, depth: int = 0):
    """`value` as JSON-ready data; `other(obj)` encodes what is not plain (a handle, or it raises)."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested more than {MAX_DEPTH} deep")
    kind = type(value)
    if value is None or kind in (bool, str):
        return value
    if kind is int:
        return value if abs(value) < 2**53 else {"int": hex(value)}  # hex: no digit-count limit
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is complex:
        return {"complex": [encode(value.real, other, depth + 1), encode(value.imag, other, depth + 1)]}
    if kind is bytes:
        return {"bytes": base64.b64encode(value).decode()}
    if kind in _CONTAINERS:
        return {_CONTAINERS[kind]: [encode(v, other, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, other, depth + 1), encode(v, other, depth + 1)] for k, v in value.items()]}
    return other(value)


def decode(data, handle, depth: int = 0):
    """The value `data` (from `encode`) stands for; `handle(n)` makes the stand-in of handle n."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested more than {MAX_DEPTH} deep")
    if data is None or type(data) in (bool, str, int, float):
        return data
    if type(data) is not dict or len(data) != 1:
        raise NotPlain(f"not a plain value: {type(data).__name__}")
    (tag, body), = data.items()
    try:
        if tag == "int" and type(body) is str:
            return int(body, 16)
        if tag == "float" and body in ("inf", "-inf", "nan"):
            return float(body)
        if tag == "complex" and type(body) is list and len(body) == 2:
            real, imag = (decode(v, handle, depth + 1) for v in body)
            return complex(real, imag)
        if tag == "bytes" and type(body) is str:
            return base64.b64decode(body, validate=True)
        if tag in _BUILDERS and type(body) is list:
            return _BUILDERS[tag](decode(v, handle, depth + 1) for v in body)
        if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            return {decode(k, handle, depth + 1): decode(v, handle, depth + 1) for k, v in body}
        if tag == "handle" and type(body) is int:
            return handle(body)
    except (TypeError, ValueError) as err:  # unhashable set member, bad base64, non-numbers
        raise NotPlain(f"bad {tag}: {err}") from None
    raise NotPlain(f"not a plain value: tag {tag!r}")


def send(fd: int, message) -> None:
    data = json.dumps(message, allow_nan=False, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise NotPlain(f"message of {len(data)} bytes is over {MAX_MESSAGE}")
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def receive(fd: int):
    """The next message, or None at the end of the stream."""
    head = _read(fd, 4)
    if head is None:
        return None
    size, = struct.unpack(">I", head)
    if size > MAX_MESSAGE:
        raise NotPlain(f"message of {size} bytes is over {MAX_MESSAGE}")
    body = _read(fd, size)
    if body is None:
        raise NotPlain("the stream ended inside a message")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as err:
        raise NotPlain(f"not JSON: {err}"[:200]) from None


def _read(fd: int, size: int):
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
