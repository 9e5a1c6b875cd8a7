"""The reward server's guards as pure functions: who may start it, who may call it, and how
big a request may be. vlrft.rewards.server turns a `Rejected` into a JSON 4xx answer.

Status codes: 400 not UTF-8 JSON, 401 no or wrong token, 413 over a limit (the message names
the flag), 422 valid JSON that is not a valid request (the message names the item).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from vlrft.errors import ConfigError
from vlrft.isolation.sandbox import check_can_run_code, runs_code

TOKEN_ENV = "VLRFT_REWARD_TOKEN"

# A JSON string, escapes included (the unrolled form keeps the regex engine in C loops).
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(128) if chr(b) not in "[]{}") + bytes(range(128, 256))
_CURLY_TO_SQUARE = bytes.maketrans(b"{}", b"[]")


class Rejected(Exception):
    """A request the server refuses: `status` (4xx) and a one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """Per-request limits; each default is a `vlrft reward-server` flag's default."""

    max_body_bytes: int = 16 * 2**20  # --max-body-mb 16
    max_items: int = 256  # --max-items
    max_image_pixels: int = 4096 * 4096  # --max-image-pixels
    max_request_pixels: int = 2 * 4096 * 4096  # --max-request-pixels
    max_json_depth: int = 32  # --max-json-depth
    max_json_values: int = 1_000_000  # --max-json-values

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"reward server: {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ServerOptions:
    """How `vlrft reward-server` listens; the defaults are its flags' defaults."""

    host: str = "127.0.0.1"
    port: int = 8000
    threads: int = 4
    timeout_s: float = 60.0
    token: str | None = None
    allow_code_recipe: bool = False
    unsafe_no_isolation: bool = False  # run a code recipe where bubblewrap is missing
    max_connections: int = 32  # open connections (waitress); more wait in the listen backlog
    backlog: int = 64
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self):
        for name in ("threads", "max_connections", "backlog"):
            if getattr(self, name) < 1:
                raise ConfigError(f"reward server: {name} must be at least 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ConfigError(f"reward server: timeout_s must be positive, got {self.timeout_s}")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and the name localhost; any other name may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(token_file: str | None) -> str | None:
    """The server's (or client's) bearer token: the file's first line, else $VLRFT_REWARD_TOKEN,
    else None. A file (not a flag) keeps the secret out of `ps` output."""
    if token_file:
        path = Path(token_file).expanduser()
        try:
            token = path.read_text().strip()
        except OSError as err:
            raise ConfigError(f"reward server token file {path}: {err.strerror or err}") from None
        if not token or "\n" in token:
            raise ConfigError(f"reward server token file {path}: must hold one non-empty line")
        return token
    return os.environ.get(TOKEN_ENV, "").strip() or None


def check_start(host: str, token: str | None, recipe: str, fn: Callable, allow_code: bool,
                unsafe_no_isolation: bool = False) -> None:
    """Refuse to serve a code recipe where it cannot be isolated (unless opted in), or beyond
    this machine without a token, or a code recipe beyond it without opt-in."""
    if runs_code(fn):
        check_can_run_code(f"reward server recipe '{recipe}'", unsafe_no_isolation, "give --unsafe-no-isolation")
    if is_loopback(host):
        return
    if token is None:
        raise ConfigError(
            f"reward server: --host {host} is not a loopback address, so a token is required: "
            f"give --token-file PATH or set {TOKEN_ENV} (clients send 'Authorization: Bearer TOKEN')"
        )
    if runs_code(fn) and not allow_code:
        raise ConfigError(
            f"reward server: recipe '{recipe}' executes the completions it is sent; serving it on "
            f"--host {host} needs --allow-code-recipe"
        )


def check_token(header: str | None, token: str | None) -> None:
    """401 unless the Authorization header is `Bearer <token>` (constant-time compare)."""
    if token is None:
        return
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Rejected(401, "missing or wrong token: send 'Authorization: Bearer TOKEN'")


def check_body_length(length: int | None, limits: Limits) -> None:
    if length is not None and length > limits.max_body_bytes:
        raise Rejected(413, f"request body of {length} bytes is over the limit of "
                            f"{limits.max_body_bytes} (--max-body-mb)")


def json_structure(text: str) -> bytes:
    """The JSON text with every string cut out: what is left is brackets, commas, colons,
    numbers and literals. (UTF-8 multi-byte sequences hold no ASCII bytes: nothing is invented.)"""
    return _JSON_STRING.sub("", text).encode("utf-8", "surrogatepass")


def nesting_exceeds(structure: bytes, max_depth: int) -> bool:
    """True when arrays/objects nest deeper than `max_depth`, found without recursion, so
    `json.loads` never recurses deep: the running depth is a cumulative sum over the brackets,
    one kind (a mismatched closer is a syntax error json stops at). Unbalanced brackets are
    left to json.loads to report: it stops at the first extra closer, and never goes deeper
    than the running depth before it."""
    import numpy as np

    brackets = structure.translate(_CURLY_TO_SQUARE, _NOT_BRACKETS)
    depth = 0
    for start in range(0, len(brackets), 1 << 20):  # 1 MiB at a time: bounded scratch memory
        chunk = np.frombuffer(brackets, np.uint8, min(1 << 20, len(brackets) - start), start)
        running = np.cumsum(1 - 2 * (chunk == ord("]")), dtype=np.int64) + depth  # [chunk] depth after each
        if running.max() > max_depth:
            return True
        if running.min() < 0:  # an extra closer: json.loads stops there
            return False
        depth = int(running[-1])
    return False


def json_values(structure: bytes) -> int:
    """About how many values the JSON holds (one more than its commas, plus its containers):
    each becomes a Python object of 30-60 bytes, so this bounds memory better than bytes do."""
    return structure.count(b",") + structure.count(b"[") + structure.count(b"{") + 1


def check_json_text(raw: bytes, limits: Limits) -> str:
    """The body as text, if it is UTF-8, nests no deeper and holds no more values than the limits."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise Rejected(400, f"request body is not UTF-8 ({err.reason} at byte {err.start})") from None
    structure = json_structure(text)
    if nesting_exceeds(structure, limits.max_json_depth):
        raise Rejected(413, f"request JSON nests deeper than {limits.max_json_depth} levels (--max-json-depth)")
    values = json_values(structure)
    if values > limits.max_json_values:
        raise Rejected(413, f"request JSON holds about {values} values, over the limit of "
                            f"{limits.max_json_values} (--max-json-values)")
    return text


def check_request(body, limits: Limits) -> tuple[list[str], list[dict]]:
    """(completions, samples) of a parsed /score body, or Rejected naming what is wrong."""
    if not isinstance(body, dict) or not isinstance(body.get("completions"), list) \
            or not isinstance(body.get("samples"), list):
        raise Rejected(422, "body must be JSON {'completions': [...], 'samples': [...]}")
    completions, samples = body["completions"], body["samples"]
    if len(completions) > limits.max_items:
        raise Rejected(413, f"{len(completions)} completions are over the limit of {limits.max_items} (--max-items)")
    if len(completions) != len(samples):
        raise Rejected(422, f"{len(completions)} completions but {len(samples)} samples")
    for i, (completion, sample) in enumerate(zip(completions, samples)):
        if not isinstance(completion, str):
            raise Rejected(422, f"completion {i} is a {type(completion).__name__}, not a string")
        if not isinstance(sample, dict):
            raise Rejected(422, f"sample {i} is a {type(sample).__name__}, not an object")
    return completions, samples
