"""Client recipe for a `vlrft reward-server`: batches, a per-request timeout, one deadline for
the whole call, jittered retries of what may pass (connection errors, timeouts, 429/502/503/504)
and a limit on concurrent requests. Any other answer (a 4xx refusal, a 500 from a failing
recipe) fails the call at once, quoting the server's one-line JSON error.

Set the recipe's own `timeout_s` (the guard around the whole call) a little above `deadline_s`.
It runs in a trainer thread (`runs_in_trainer`, rewards/guard.py), not a worker process: it only
waits on the network, and `deadline_s` already ends it.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from vlrft.rewards.server_checks import read_token
from vlrft.rewards.wire import encode_samples

RETRY_STATUSES = frozenset({429, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """The server could not score a batch; the message is one line naming the URL."""


def remote_reward(
    completions: list[str],
    samples: list[dict],
    url: str,
    batch_size: int = 32,
    timeout_s: float = 10.0,
    retries: int = 2,
    backoff_s: float = 0.5,
    max_concurrency: int = 4,
    deadline_s: float = 120.0,
    token_file: str | None = None,
) -> list:
    """Scores from the server at `url` (e.g. http://127.0.0.1:8000), `batch_size` completions
    per request, at most `max_concurrency` requests in flight, all done within `deadline_s`.
    The bearer token comes from `token_file`, else $VLRFT_REWARD_TOKEN (none: no header)."""
    if batch_size < 1 or max_concurrency < 1 or retries < 0 or timeout_s <= 0 or deadline_s <= 0:
        raise ValueError("remote_reward needs batch_size >= 1, max_concurrency >= 1, retries >= 0, "
                         "timeout_s > 0, deadline_s > 0")
    endpoint = url.rstrip("/") + "/score"
    headers = {"Content-Type": "application/json"}
    token = read_token(token_file)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    bodies = [
        json.dumps({"completions": completions[i : i + batch_size],
                    "samples": encode_samples(samples[i : i + batch_size])}).encode()
        for i in range(0, len(completions), batch_size)
    ]
    call = _Call(endpoint, headers, timeout_s, retries, backoff_s, time.monotonic() + deadline_s)
    with ThreadPoolExecutor(max_workers=max_concurrency) as pool:
        parts = list(pool.map(call.post, bodies))
    return [score for part in parts for score in part]


remote_reward.runs_in_trainer = True  # bounded by deadline_s (module docstring)


def is_retryable(err: BaseException) -> bool:
    """Whether another attempt may succeed: the server was unreachable, slow or overloaded."""
    if isinstance(err, urllib.error.HTTPError):
        return err.code in RETRY_STATUSES
    return isinstance(err, (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException))


def backoff_delay(backoff_s: float, attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry `attempt` (1, 2, ...): exponential, ×2 each time, jittered
    to between half and all of it so that clients refused together do not return together."""
    return backoff_s * 2 ** (attempt - 1) * (rng or random).uniform(0.5, 1.0)


class _Call:
    """One remote_reward call's batches; the first that fails stops the others' retries."""

    def __init__(self, endpoint, headers, timeout_s, retries, backoff_s, deadline):
        self.endpoint, self.headers, self.timeout_s = endpoint, headers, timeout_s
        self.retries, self.backoff_s, self.deadline = retries, backoff_s, deadline
        self.failed = threading.Event()

    def post(self, body: bytes) -> list:
        try:
            return self._post(body)
        except RemoteRewardError:
            self.failed.set()
            raise

    def _post(self, body: bytes) -> list:
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
            request = urllib.request.Request(self.endpoint, data=body, headers=self.headers)
            try:
                with urllib.request.urlopen(request, timeout=min(self.timeout_s, left - delay)) as response:
                    return _scores(self.endpoint, response.read())
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as err:
                reason = _reason(err)
                if not is_retryable(err):
                    break
        plural = "" if attempts == 1 else "s"
        raise RemoteRewardError(f"reward server {self.endpoint}: {reason or 'not tried'}{stop} "
                                f"(after {attempts} attempt{plural})")


def _scores(endpoint: str, raw: bytes) -> list:
    try:
        scores = json.loads(raw)["scores"]
    except (ValueError, KeyError, TypeError):
        raise RemoteRewardError(f"reward server {endpoint}: answer is not JSON {{'scores': [...]}}") from None
    if not isinstance(scores, list):
        raise RemoteRewardError(f"reward server {endpoint}: 'scores' is not a list")
    return scores


def _reason(err: BaseException) -> str:
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP {err.code}: {_error_text(err)}"
    return str(getattr(err, "reason", err)) or type(err).__name__


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(err.read()).get("error", err.reason))
    except (ValueError, AttributeError, OSError):
        return str(err.reason)
