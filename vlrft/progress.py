"""Where this rank's main thread is: the phase of the loop it last entered, and since when.

The loop names each phase as it enters it (`enter`), and long phases say when they move forward
(`advance`). The rank watch (vlrft/rank_watch.py) publishes each change for the other ranks and
counts them job-wide; when no rank has changed or advanced its phase for guards.stall_timeout_s,
the job is hung, and it stops every rank, saying where each was. Without it a hang (a collective
a peer never joins, a native call that never returns, a weight delivery that never comes) holds
every rank until the 60-minute collective timeout, or forever in a wait on the job's store, and
nothing says which rank or which phase."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from time import monotonic, time


@dataclass(frozen=True)
class Phase:
    name: str
    since: float  # monotonic() when it was entered: ages are taken on this rank's clock only
    wall: float  # time() at the same moment, only to print
    # False while the trainer is built: a model download or a late peer may take long there
    guarded: bool = True


_current = Phase("starting", monotonic(), time(), guarded=False)


def enter(name: str, guarded: bool = True) -> None:
    """The main thread starts `name` now (one assignment: the watch thread reads it unlocked)."""
    global _current
    _current = Phase(name, monotonic(), time(), guarded)


def advance() -> None:
    """The phase goes on and has moved forward (a long phase's loop calls it per round: the HF
    engine per decoding batch). Only the main thread's loop counts: a reward model's engine
    generating in a worker thread says nothing of it."""
    if threading.current_thread() is threading.main_thread():
        enter(_current.name, _current.guarded)


def current() -> Phase:
    return _current


@contextmanager
def during(name: str):
    """`name` for the block, then the phase before it again, as entered anew."""
    before = _current
    enter(name, before.guarded)
    try:
        yield
    finally:
        enter(before.name, before.guarded)
