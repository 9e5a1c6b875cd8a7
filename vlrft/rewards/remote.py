"""Client recipe for a `vlrft reward-server`: batches, a per-request timeout, one deadline for
the whole call, jittered retries of what may pass (connection errors, timeouts, 429/502/503/504)
and a limit on concurrent requests (vlrft.rewards.retrying_call). Any other answer (a 4xx
refusal, a 500 from a failing recipe) fails the call at once, quoting the server's one-line
JSON error.

Set the recipe's own `timeout_s` (the guard around the whole call) a little above `deadline_s`.
It runs in a trainer thread (`runs_in_trainer`, rewards/guard.py), not a worker process: it only
waits on the network, and `deadline_s` already ends it.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from vlrft.rewards.retrying_call import RetryingCall, bearer_headers
from vlrft.rewards.server_checks import read_token
from vlrft.rewards.wire import encode_samples


ANSWER_BYTES_PER_COMPLETION = 64  # an answer's bound: this per completion sent, plus ANSWER_SLACK_BYTES
ANSWER_SLACK_BYTES = 1 << 20


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
    bodies = [
        (json.dumps({"completions": completions[i : i + batch_size],
                     "samples": encode_samples(samples[i : i + batch_size])}).encode(),
         ANSWER_BYTES_PER_COMPLETION * len(completions[i : i + batch_size]) + ANSWER_SLACK_BYTES)
        for i in range(0, len(completions), batch_size)
    ]
    call = RetryingCall(bearer_headers(read_token(token_file)), timeout_s, retries, backoff_s,
                        time.monotonic() + deadline_s, "reward server", RemoteRewardError, _scores)
    with ThreadPoolExecutor(max_workers=max_concurrency) as pool:
        parts = list(pool.map(lambda sized: call.request(endpoint, *sized), bodies))
    return [score for part in parts for score in part]


remote_reward.runs_in_trainer = True  # bounded by deadline_s (module docstring)


def _scores(endpoint: str, raw: bytes) -> list:
    try:
        scores = json.loads(raw)["scores"]
    except (ValueError, KeyError, TypeError):
        raise RemoteRewardError(f"reward server {endpoint}: answer is not JSON {{'scores': [...]}}") from None
    if not isinstance(scores, list):
        raise RemoteRewardError(f"reward server {endpoint}: 'scores' is not a list")
    return scores
