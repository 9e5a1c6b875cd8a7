"""Where this rank's main thread is: the phase of the loop it last entered, and since when.

The loop names each phase as it enters it (`enter`). The rank watch (vlrft/rank_watch.py)
publishes the name for the other ranks, stops the run when one phase has lasted longer than
guards.stall_timeout_s, and, when it stops a run, says where every rank was. Without it a rank
that hangs (a collective a peer never joins, a native call that never returns, a weight delivery
that never comes) holds every rank until the 60-minute collective timeout, or forever in a wait
on the job's store, and nothing says which rank or which phase."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from time import monotonic, time


@dataclass(frozen=True)
class Phase:
    name: str
    since: float  # monotonic() when it was entered: ages are taken on this rank's clock only
    wall: float  # time() at the same moment, only to print


_current = Phase("starting", monotonic(), time())


def enter(name: str) -> None:
    """The main thread starts `name` now (one assignment: the watch thread reads it unlocked)."""
    global _current
    _current = Phase(name, monotonic(), time())


def advance() -> None:
    """The phase goes on and has moved forward (a long phase's loop calls it per round: the HF
    engine per decoding batch), so its age counts from now."""
    enter(_current.name)


def current() -> Phase:
    return _current


@contextmanager
def during(name: str):
    """`name` for the block, then the phase before it again, as entered anew: a wait inside a
    phase (weights taken mid-batch) is progress."""
    before = _current.name
    enter(name)
    try:
        yield
    finally:
        enter(before)
