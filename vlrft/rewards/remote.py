"""Client recipe for a `vlrft reward-server`: batches, a timeout, retries with backoff, and a
limit on concurrent requests.

Set the recipe's own `timeout_s` (the guard around the whole call) above the worst case of
its requests: about (retries + 1) * timeout_s + backoff, per sequential wave of batches.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from vlrft.rewards.wire import encode_samples


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
) -> list:
    """Scores from the server at `url` (e.g. http://127.0.0.1:8000), `batch_size` completions
    per request, at most `max_concurrency` requests in flight."""
    if batch_size < 1 or max_concurrency < 1 or retries < 0 or timeout_s <= 0:
        raise ValueError("remote_reward needs batch_size >= 1, max_concurrency >= 1, retries >= 0, timeout_s > 0")
    endpoint = url.rstrip("/") + "/score"
    starts = range(0, len(completions), batch_size)
    bodies = [
        json.dumps({"completions": completions[i : i + batch_size],
                    "samples": encode_samples(samples[i : i + batch_size])}).encode()
        for i in starts
    ]
    with ThreadPoolExecutor(max_workers=max_concurrency) as pool:
        parts = list(pool.map(lambda body: _post(endpoint, body, timeout_s, retries, backoff_s), bodies))
    return [score for part in parts for score in part]


def _post(endpoint: str, body: bytes, timeout_s: float, retries: int, backoff_s: float) -> list:
    reason = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        req = urllib.request.Request(endpoint, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as response:
                return json.loads(response.read())["scores"]
        except urllib.error.HTTPError as err:
            reason = f"HTTP {err.code}: {_error_text(err)}"
            if err.code < 500 and err.code != 429:  # the request itself is wrong: retrying won't help
                break
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            reason = str(getattr(err, "reason", err)) or type(err).__name__
    raise RemoteRewardError(f"reward server {endpoint}: {reason} (after {attempt + 1} attempts)")


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        return json.loads(err.read()).get("error", "")
    except ValueError:
        return err.reason
