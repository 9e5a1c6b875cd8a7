"""The clients of vlrft's servers (the `remote` reward recipe, the remote teacher): one request
at a time with a timeout, jittered retries of what may pass (connection errors, timeouts,
429/502/503/504) within one deadline for the whole call, and any other answer (a 4xx refusal,
a 500) a failure at once, quoting the server's one-line JSON error. An answer is read in chunks,
at most a size limit and within the call's deadline, and no redirect is followed (a redirect
would carry the bearer token to whatever host it names)."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.error
import urllib.request
from typing import Callable

from vlrft.rewards.server_checks import loggable

ERROR_BODY_BYTES = 64 * 1024  # the most read of a refusal's JSON error (and of a /health answer)
CHUNK_BYTES = 64 * 1024
RETRY_STATUSES = frozenset({429, 502, 503, 504})


def is_retryable(err: BaseException) -> bool:
    """Whether another attempt may succeed: the server was unreachable, slow or overloaded."""
    if isinstance(err, urllib.error.HTTPError):
        return err.code in RETRY_STATUSES
    return isinstance(err, (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException))


def backoff_delay(backoff_s: float, attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry `attempt` (1, 2, ...): exponential, ×2 each time, jittered
    to between half and all of it so that clients refused together do not return together."""
    return backoff_s * 2 ** (attempt - 1) * (rng or random).uniform(0.5, 1.0)


def bearer_headers(token: str | None) -> dict[str, str]:
    """A JSON request's headers, with `Authorization: Bearer` when there is a token."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


class RedirectRefused(urllib.error.HTTPError):
    """A 3xx answer: never followed (urllib would re-send the Authorization header to its host)."""


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise RedirectRefused(req.full_url, code, f"redirect to {loggable(newurl, 300)!r} refused", headers, None)


_OPENER = urllib.request.build_opener(_RefuseRedirects)


class _TooLarge(Exception):
    pass


def read_capped(response, limit: int, deadline: float) -> bytes:
    """At most `limit` bytes of `response` (_TooLarge past it), read a chunk at a time and each
    read's socket timeout narrowed to the time left before `deadline` (TimeoutError past it):
    a server trickling bytes cannot hold the caller past its deadline."""
    sock = getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)
    chunks, size = [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out reading the answer")
        if sock is not None:
            sock.settimeout(min(left, sock.gettimeout() or left))
        chunk = response.read1(CHUNK_BYTES) if hasattr(response, "read1") else response.read(CHUNK_BYTES)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise _TooLarge()
        chunks.append(chunk)


class RetryingCall:
    """One call's requests to a server (each its own retries, all within `deadline`, a
    time.monotonic() value); the first that fails stops the others' retries. A failure raises
    `error` with one line: "{what} {url}: {reason} (after N attempts)". `parse(url, raw)` turns
    an answer's bytes into the result (raising `error` for a malformed one)."""

    def __init__(self, headers: dict, timeout_s: float, retries: int, backoff_s: float, deadline: float,
                 what: str, error: type[Exception], parse: Callable[[str, bytes], object]):
        self.headers, self.timeout_s = headers, timeout_s
        self.retries, self.backoff_s, self.deadline = retries, backoff_s, deadline
        self.what, self.error, self.parse = what, error, parse
        self.failed = threading.Event()

    def request(self, url: str, body: bytes | None = None, max_bytes: int = ERROR_BODY_BYTES):
        """The parsed answer to a POST of `body` to `url` (a GET without a body), one of at most
        `max_bytes` bytes."""
        try:
            return self._request(url, body, max_bytes)
        except self.error:
            self.failed.set()
            raise

    def _request(self, url: str, body: bytes | None, max_bytes: int):
        reason, attempts, stop = "", 0, ""
        for attempt in range(self.retries + 1):
            left = self.deadline - time.monotonic()
            delay = backoff_delay(self.backoff_s, attempt) if attempt else 0.0
            if delay >= left:  # no time to wait and try again
                stop = "; deadline_s reached"
                break
            time.sleep(delay)
            if self.failed.is_set():
                stop = "; stopped: another batch of this call failed"
                break
            attempts += 1
            request = urllib.request.Request(url, data=body, headers=self.headers)
            try:
                with _OPENER.open(request, timeout=min(self.timeout_s, left - delay)) as response:
                    raw = read_capped(response, max_bytes, self.deadline)
            except _TooLarge:
                raise self.error(f"{self.what} {url}: the answer is over the limit of {max_bytes} bytes") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as err:
                reason = _reason(err, self.deadline)
                if not is_retryable(err):
                    break
            else:
                return self.parse(url, raw)
        plural = "" if attempts == 1 else "s"
        raise self.error(f"{self.what} {url}: {reason or 'not tried'}{stop} (after {attempts} attempt{plural})")


def _reason(err: BaseException, deadline: float) -> str:
    if isinstance(err, RedirectRefused):
        return f"HTTP {err.code}: {err.reason}"
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP {err.code}: {_error_text(err, deadline)}"
    return str(getattr(err, "reason", err)) or type(err).__name__


def _error_text(err: urllib.error.HTTPError, deadline: float) -> str:
    """The refusal's JSON `error` (its first 300 characters, unprintable ones escaped)."""
    try:
        text = json.loads(read_capped(err.fp, ERROR_BODY_BYTES, deadline)).get("error", err.reason)
    except (ValueError, AttributeError, OSError, RecursionError, _TooLarge):
        text = err.reason
    return loggable(str(text), 300)
