"""The guards of vlrft's servers (the reward server, the teacher server) as pure functions: who
may start one, who may call it, and how big a request may be. vlrft.rewards.server_common (and
server_http, for the checks made on the headers before any of the body is read) turns a
`Rejected` into a JSON 4xx answer.

Status codes: 400 not UTF-8 JSON, 401 no or wrong token, 403 sent by a web page (an Origin, or
without a token a Host that is not this machine), 413 over a limit (the message names the flag),
415 a POST that is not `application/json`, 422 valid JSON that is not a valid request (the
message names the item; a number out of range).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from vlrft.errors import ConfigError
from vlrft.isolation.sandbox import check_can_run_code, runs_code
from vlrft.json_shape import exceeds

TOKEN_ENV = "VLRFT_REWARD_TOKEN"


class Rejected(Exception):
    """A request the server refuses: `status` (4xx) and a one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """Per-request limits; each default is a flag's default (`vlrft reward-server`, `vlrft teacher-server`)."""

    max_body_bytes: int = 16 * 2**20  # --max-body-mb 16
    max_items: int = 256  # --max-items
    max_image_pixels: int = 4096 * 4096  # --max-image-pixels
    max_request_pixels: int = 2 * 4096 * 4096  # --max-request-pixels
    max_json_depth: int = 32  # --max-json-depth
    max_json_values: int = 1_000_000  # --max-json-values

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"server: {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ListenOptions:
    """How a vlrft server (`vlrft reward-server`, `vlrft teacher-server`) listens and whom it
    answers; the defaults are their flags' defaults."""

    host: str = "127.0.0.1"
    port: int = 8000
    threads: int = 4
    token: str | None = None
    max_connections: int = 128  # open connections; at the cap the oldest not let in is closed (server_http.py)
    backlog: int = 1024  # the kernel's accept queue (capped by net.core.somaxconn): server_http.py
    read_timeout_s: float = 30.0  # a request's headers and body, from its first byte
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self):
        for name in ("threads", "max_connections", "backlog"):
            if getattr(self, name) < 1:
                raise ConfigError(f"server: {name} must be at least 1, got {getattr(self, name)}")
        if not self.read_timeout_s > 0:
            raise ConfigError(f"server: read_timeout_s must be positive, got {self.read_timeout_s}")


@dataclass(frozen=True)
class ServerOptions(ListenOptions):
    """`vlrft reward-server`'s options: how it listens, and how it runs its recipe."""

    timeout_s: float = 60.0
    allow_code_recipe: bool = False
    unsafe_no_isolation: bool = False  # run a code recipe where bubblewrap is missing
    max_code_seconds: float = 60.0  # a code recipe's call: all of a request's programs and tests

    def __post_init__(self):
        super().__post_init__()
        for name in ("timeout_s", "max_code_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"reward server: {name} must be positive, got {getattr(self, name)}")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and the name localhost; any other name may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(token_file: str | None, env: str = TOKEN_ENV, what: str = "reward server") -> str | None:
    """A server's (or client's) bearer token: the file's first line, else $`env`, else None. A
    file (not a flag) keeps the secret out of `ps` output."""
    if token_file:
        path = Path(token_file).expanduser()
        try:
            token = path.read_text().strip()
        except OSError as err:
            raise ConfigError(f"{what} token file {path}: {err.strerror or err}") from None
        if not token or "\n" in token:
            raise ConfigError(f"{what} token file {path}: must hold one non-empty line")
        return token
    return os.environ.get(env, "").strip() or None


def check_bind(host: str, token: str | None, what: str = "reward server", env: str = TOKEN_ENV) -> None:
    """Refuse to listen beyond this machine without a token."""
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"{what}: --host {host} is not a loopback address, so a token is required: "
            f"give --token-file PATH or set {env} (clients send 'Authorization: Bearer TOKEN')"
        )


def check_start(host: str, token: str | None, recipe: str, fn: Callable, allow_code: bool,
                unsafe_no_isolation: bool = False) -> None:
    """Refuse to serve a code recipe where it cannot be isolated (unless opted in), or beyond
    this machine without a token, or a code recipe beyond it without opt-in."""
    if runs_code(fn):
        check_can_run_code(f"reward server recipe '{recipe}'", unsafe_no_isolation, "give --unsafe-no-isolation")
    check_bind(host, token)
    if not is_loopback(host) and runs_code(fn) and not allow_code:
        raise ConfigError(
            f"reward server: recipe '{recipe}' executes the completions it is sent; serving it on "
            f"--host {host} needs --allow-code-recipe"
        )


def log(name: str, line: str) -> None:
    """One line of a server's log on its stderr ("vlrft reward server: ...")."""
    print(f"vlrft {name}: {line}", file=sys.stderr, flush=True)


def loggable(text: str, limit: int = 120) -> str:
    """What a client sent, for the server's one-line log: its first `limit` characters with
    every unprintable one escaped as repr escapes it (a newline cannot start a forged log line,
    an escape sequence cannot drive the operator's terminal), "..." when cut."""
    return repr(text[:limit])[1:-1] + ("..." if len(text) > limit else "")


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


def check_headers(method: str, headers: Mapping[str, str], token: str | None, port: int) -> None:
    """Refusals decided from the request line and headers alone, before any of the body is read.
    `headers` are named as waitress names them (HOST, ORIGIN, AUTHORIZATION, CONTENT_TYPE).

    - Any `Origin` is refused (403): this server serves no pages, so an Origin means a browser is
      sending the request for some web page; our clients send none.
    - Without a token, the `Host` must be this machine's loopback with the server's port (403):
      a web page whose DNS name was pointed at 127.0.0.1 (DNS rebinding) sends its own name.
      With a token the token is the authentication, and any name may reach the server.
    - The token (401), then `Content-Type: application/json` on a POST (415): a browser cannot
      send that type across sites without a preflight, which this server never grants."""
    origin = headers.get("ORIGIN")
    if origin is not None:
        raise Rejected(403, f"requests sent by web pages are refused (Origin: {origin!r:.80})")
    if token is None and not is_loopback_host(headers.get("HOST"), port):
        raise Rejected(403, f"Host {headers.get('HOST')!r:.80} is not this machine: without a token only "
                            f"127.0.0.1:{port}, localhost:{port} or [::1]:{port} are answered")
    check_token(headers.get("AUTHORIZATION"), token)
    if method == "POST" and not is_json_type(headers.get("CONTENT_TYPE")):
        raise Rejected(415, f"a POST needs 'Content-Type: application/json', got {headers.get('CONTENT_TYPE')!r:.80}")


def is_loopback_host(value: str | None, port: int) -> bool:
    """True for a Host header naming a loopback address (localhost or an IP literal) with
    `port`; the port may be left out only where it is 80, HTTP's default."""
    if not value:
        return False
    if value.endswith("]") or ":" not in value:
        host, given = value, None
    else:
        host, _, given = value.rpartition(":")
    if (given is None and port != 80) or (given is not None and given != str(port)):
        return False
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host.lower() == "localhost" or _is_loopback_ip(host)


def _is_loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_json_type(value: str | None) -> bool:
    """`application/json`, with parameters or not (a charset, if given, must be UTF-8)."""
    kind, _, params = (value or "").partition(";")
    if kind.strip().lower() != "application/json":
        return False
    for param in params.split(";"):
        name, _, given = param.partition("=")
        if name.strip().lower() == "charset" and given.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return False
    return True


# A body is parsed by the standard library's json: a maintained parser, in C, one pass, linear
# in the body (a pattern search for strings, retried from each quote, was quadratic on escaped
# quotes). Numbers go through hooks that refuse what cannot be represented; nesting deeper than
# the interpreter's recursion limit stops json itself (RecursionError), and an iterative walk
# of the result checks --max-json-depth and --max-json-values. Not a streaming parser (none in
# the standard library; ijson would be a dependency and a Python loop per value): the parse
# builds its objects before the walk counts them (the walk itself holds one iterator per level),
# so vlrft.rewards.server parses one body at a time, and only a request whose headers passed
# the checks is parsed at all. Measured on the server, 16 MiB bodies: `[{},{},...]` +419 MB
# (about 25 bytes per body byte), arrays nested one in another (`[[[...]]]`) +803 MB (about 50,
# the most we found: a list object per 2 bytes).
MAX_INT_DIGITS = 4300  # Python's own limit for int(text) (sys.int_info.default_max_str_digits)


def parse_json(raw: bytes, limits: Limits):
    """The body parsed, if it is UTF-8 JSON within the depth and value limits, its numbers in range."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise Rejected(400, f"request body is not UTF-8 ({err.reason} at byte {err.start})") from None
    try:
        body = json.loads(text, parse_int=_integer, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise _too_deep(limits) from None
    except json.JSONDecodeError as err:
        raise Rejected(400, f"request body is not JSON ({err})") from None
    check_json_shape(body, limits)
    return body


def check_json_shape(body, limits: Limits) -> None:
    """413 when arrays/objects nest deeper than --max-json-depth (the outermost is level 1) or
    the body holds more than --max-json-values values (vlrft.json_shape: a walk that holds
    nothing per value, so it adds next to nothing to the memory the parse took)."""
    exceeded = exceeds(body, limits.max_json_depth, limits.max_json_values)
    if exceeded == "values":
        raise Rejected(413, f"request JSON holds more than {limits.max_json_values} values (--max-json-values)")
    if exceeded == "depth":
        raise _too_deep(limits)


def _too_deep(limits: Limits) -> Rejected:
    return Rejected(413, f"request JSON nests deeper than {limits.max_json_depth} levels (--max-json-depth)")


def _integer(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise Rejected(422, f"request JSON holds an integer of {digits} digits, over the limit of {MAX_INT_DIGITS}")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Rejected(422, f"request JSON holds a number out of range: {text:.40}")
    return value


def _constant(name: str):
    raise Rejected(422, f"request JSON holds {name}, which is not a JSON number")


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
