"""The reward server's worker processes: where it runs its recipe, unless the recipe is marked
`runs_in_trainer` (vlrft.rewards.guard: the model-based built-ins and `remote`, which stay in
the server's threads, as in the trainer).

A recipe run in a server thread cannot be stopped: a call past its timeout would be abandoned,
still running, and while it ran every further call failed ("not run"); a call computing in C
(a regex, a big power in sympy) holds the GIL, so the whole server, its event loop included,
stood still until it ended. In a worker process (vlrft.workers) a call past its limit is
killed with everything it started, whatever it was doing, and costs no other request anything;
the next request on that worker starts a fresh one.
"""

from __future__ import annotations

import queue

from vlrft.rewards.guard import RecipeFailure, check_scores, load_recipe, run_recipe
from vlrft.rewards.server_checks import Rejected
from vlrft.rewards.wire import WireError, decode_checked
from vlrft.workers import START_TIMEOUT_S, CallFailed, CallTimedOut, Worker


class RecipePool:
    """One worker process per server thread, so a request never waits for a worker (only, when
    every thread is busy, for a thread). A call's limit is `seconds`: --max-code-seconds for a
    recipe that runs code (all of a request's programs and tests; past it the request is
    answered 413: send fewer per request), else --timeout-s (past it, 500 as any failure)."""

    def __init__(self, recipe: str, size: int, seconds: float, runs_code: bool):
        self.recipe, self.seconds, self.runs_code = recipe, seconds, runs_code
        self._free: queue.LifoQueue = queue.LifoQueue()  # the worker used last: it is warm
        for _ in range(size):
            self._free.put(Worker())

    def score(self, completions: list[str], samples: list[dict], kwargs: dict) -> list:
        worker = self._free.get()  # never waits: one worker per server thread
        try:
            self._start(worker)
            kind, value = worker.call(decode_and_run, (self.recipe, completions, samples, kwargs), self.seconds)
        except CallTimedOut:
            if self.runs_code:
                raise Rejected(413, f"the request's programs and tests ran past {self.seconds:g}s "
                                    "(--max-code-seconds) and were stopped: send fewer per request") from None
            raise RecipeFailure(f"timed out after {self.seconds:g}s (--timeout-s) and was stopped") from None
        except CallFailed as failure:
            raise RecipeFailure(str(failure)) from None
        finally:
            self._free.put(worker)
        if kind == "wire":
            raise Rejected(422, value)
        return check_scores(value, len(completions))

    def _start(self, worker: Worker) -> None:
        """A stopped worker started, its recipe imported: not counted in the request's time."""
        if not worker.running:
            try:
                worker.call(load_recipe, (self.recipe,), START_TIMEOUT_S)
            except CallFailed as failure:
                raise RecipeFailure(f"its worker process did not start ({failure})") from None


# In the worker: images arrive as their checked bytes (vlrft.rewards.wire.check_samples) and are
# decoded here, under the call's limit: a decode that takes too long (a progressive JPEG's
# scans), like a recipe that does, is killed with the worker, and the server holds only the
# compressed bytes, not every request's pixels twice.
def decode_and_run(name: str, completions: list[str], samples: list[dict], kwargs: dict) -> tuple[str, object]:
    """("scores", the recipe's scores), or ("wire", why an image's pixel data did not decode)."""
    try:
        decoded = decode_checked(samples)
    except WireError as err:
        return "wire", str(err)
    return "scores", run_recipe(name, completions, decoded, kwargs)
