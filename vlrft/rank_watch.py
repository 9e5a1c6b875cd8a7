"""One rank fails, every rank stops, fast (guards.peer_timeout_s).

Without this, a rank that raises (a full disk while saving, a bad batch, a dead reward server)
or is killed leaves its peers waiting in their next collective until the process group's
60-minute timeout: NCCL never notices a dead peer, and gloo only inside a collective.

Each rank of a world > 1 runs a daemon thread that, every TICK_S, bumps its heartbeat counter in
the process group's key-value store, reads the failure count (a rank that raises records one
line there: `RankWatch.fail`) and reads the heartbeat of the next rank in ring order that has not
finished cleanly. Any set of dead ranks short of all has a live rank just before one of them, so
the ring finds every death with O(1) store calls per rank and tick (all-to-all would put O(world²)
on the one store). A peer is dead when its counter has not moved for `timeout_s` by this rank's
own monotonic clock (nodes' clocks are never compared); the store is dead when it has not
answered for as long. The rank that finds a death records it, so every rank stops with one line.

A rank can also hang alive: its heartbeat goes on while its main thread waits in a collective a
peer never joins, or on the store for weights that never come. Each rank publishes the phase its
loop is in (vlrft/progress.py) whenever it changes or advances, and adds one to a job-wide
count. A rank in a guarded phase that has seen the count stand still for `stall_timeout_s` finds
the job hung. Waits are not stalls on their own: a rank may wait a long time on another that is
working (the trainers on a rollout rank's evaluation), and the working one moves the count. The
rank that finds a death or a stall prints where every rank was, one line per phase, and each
rank that stops names the line its main thread is at.

A peer's death can also show first on this rank: gloo raises at once in a collective with a
killed peer, and under torchrun every rank gets SIGTERM when one dies. Neither says which peer,
so the rank then doubts its peers (`doubt_peers`): a peer whose heartbeat has stood still for
GONE_AFTER_S, instead of the timeout, is dead, and the rank stops with one line naming it and
its role (an asynchronous run's trainer or rollout rank), not with gloo's traceback.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
import traceback

from vlrft import progress
from vlrft.console import say
from vlrft.lost_connection import lost_connection

TICK_S = 1.0
# How long a failing rank waits for its peers to read its record before it exits: when it hosts
# the store (rank 0 outside torchrun), the store goes with it.
ACK_WAIT_S = 5.0
# How long a rank that read a failure record stays after telling the failing rank so: the failing
# rank then exits first, and torchrun names the first rank to exit as the root cause.
LINGER_S = 2.0
STOPPED_EXIT_CODE = 1
# After a stop on a signal, how long a rank waits for its peers to end their own stop before
# it exits anyway (a rollout rank finishes the batch in flight first), and how long a peer's
# silent heartbeat means it is gone instead.
LINGER_LIMIT_S = 600.0
GONE_AFTER_S = 5.0

# Each rank's role where the ranks have roles (an asynchronous run's trainers and rollout
# ranks: trainer/weights_delivery.py), for the lines that name a rank.
ROLES: dict[int, str] = {}
# Set once this rank has seen a sign that a peer may be dead (a lost connection; a stop signal
# while it waits for a peer): from then on a peer, or the store, silent for GONE_AFTER_S is gone.
_DOUBT = threading.Event()


def name_roles(roles: dict[int, str]) -> None:
    ROLES.clear()
    ROLES.update(roles)


def rank_name(rank: int) -> str:
    """"rank 3 (rollout)" where the ranks have roles, else "rank 3"."""
    return f"rank {rank} ({ROLES[rank]})" if rank in ROLES else f"rank {rank}"


def doubt_peers() -> None:
    """A sign that a peer may be dead: the watch now takes a peer silent for GONE_AFTER_S as dead."""
    _DOUBT.set()


def next_watched(rank: int, world: int, finished: set[int]) -> int | None:
    """The first rank after `rank` in ring order that has not finished cleanly (None: all have)."""
    for offset in range(1, world):
        peer = (rank + offset) % world
        if peer not in finished:
            return peer
    return None


class Silence:
    """Seconds since a counter last moved, by this rank's clock."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, float]] = {}

    def heard(self, who: int, count: int, now: float) -> float:
        last = self._seen.get(who)
        if last is None or last[0] != count:
            self._seen[who] = (count, now)
            return 0.0
        return now - last[1]


class RankWatch:
    """This rank's watch over its peers. `store` None: off (a world of one, or timeout 0); `fail`
    then only prints."""

    def __init__(self, store, rank: int, world: int, timeout_s: float, prefix: str = "vlrft/rank_watch/",
                 stall_timeout_s: float = 0.0):
        self.store, self.rank, self.world, self.timeout_s, self.prefix = store, rank, world, timeout_s, prefix
        self.stall_timeout_s = stall_timeout_s  # 0: off
        self.published: progress.Phase | None = None  # the phase the store holds for this rank
        self.job_quiet = Silence()  # the job-wide count of phase changes, by this rank's clock
        self.stalled = False  # the count stood still for stall_timeout_s
        self.silence = Silence()
        self.finished: set[int] = set()  # ranks that stopped their watch cleanly
        self.last_answer: float | None = None  # when the store last answered
        self.store_lost = False
        self.connection_lost = False  # the main thread's own call lost its connection to a peer
        self._stop = threading.Event()
        self._lock = threading.Lock()  # held by whichever of `_end` and `fail`/`stop` comes first
        self._thread = threading.Thread(target=self._run, name="vlrft-rank-watch", daemon=True)

    @property
    def active(self) -> bool:
        return self.store is not None

    def _key(self, name: str) -> str:
        return self.prefix + name

    def start(self) -> RankWatch:
        if self.active:
            self._thread.start()
        return self

    def tick(self, now: float) -> tuple[str | None, bool]:
        """One round: heartbeat and reads. Returns (why this rank must stop, or None; whether this
        rank found it, so must record it for the others)."""
        if self.last_answer is None:
            self.last_answer = now
        if not self.store_lost:
            try:
                return self._read(now)
            except Exception:  # noqa: BLE001 - any store error
                # Closed or frozen: later calls would fail the same way (each printing a C++
                # trace), so stop calling and give the store the same time a silent peer gets.
                self.store_lost = True
        silent = now - self.last_answer
        if silent >= (min(GONE_AFTER_S, self.timeout_s) if _DOUBT.is_set() else self.timeout_s):
            return (f"the rendezvous store has not answered for {silent:.0f} s (its host, {rank_name(0)} or torchrun, "
                    f"gone?)"), False
        return None, False

    def _read(self, now: float) -> tuple[str | None, bool]:
        store = self.store
        store.add(self._key(f"heartbeat/{self.rank}"), 1)
        phase = progress.current()
        if phase is not self.published:
            store.set(self._key(f"phase/{self.rank}"), f"{phase.wall}\t{phase.name}")
            moves = store.add(self._key("phase_changes"), 1)
            self.published = phase
        else:
            moves = store.add(self._key("phase_changes"), 0)
        failed = store.add(self._key("failures"), 0) > 0
        peer = next_watched(self.rank, self.world, self.finished)
        while peer is not None and store.add(self._key(f"finished/{peer}"), 0) > 0:
            self.finished.add(peer)
            peer = next_watched(self.rank, self.world, self.finished)
        count = store.add(self._key(f"heartbeat/{peer}"), 0) if peer is not None else 0
        reason = store.get(self._key("failure")).decode() if failed else None  # set before the count
        self.last_answer = now
        if reason is not None:
            return reason, False
        silent = self.silence.heard(peer, count, now) if peer is not None else 0.0
        if silent >= self.timeout_s:
            return f"{rank_name(peer)} has not been heard from for {silent:.0f} s (killed?)", True
        if _DOUBT.is_set() and (gone := self._gone_peer(now)) is not None:
            # Recorded for every rank to stop on where this rank failed on it. On torchrun's signal
            # alone, torchrun stops the others: trainers may be saving the checkpoint of their stop.
            return gone, self.connection_lost
        quiet = self.job_quiet.heard(-1, moves, now)
        if self.stall_timeout_s and phase.guarded and quiet >= self.stall_timeout_s:
            self.stalled = True
            return (f"no rank has moved to a new phase for {quiet:.0f} s (guards.stall_timeout_s: "
                    f"{self.stall_timeout_s:g}): the job is hung"), True
        return None, False

    def _gone_peer(self, now: float) -> str | None:
        """In doubt: the first peer that has neither finished nor been heard from for GONE_AFTER_S."""
        for peer in set(range(self.world)) - {self.rank} - self.finished:
            if self.store.add(self._key(f"finished/{peer}"), 0) > 0:
                self.finished.add(peer)
                continue
            silent = self.silence.heard(peer, self.store.add(self._key(f"heartbeat/{peer}"), 0), now)
            if silent >= min(GONE_AFTER_S, self.timeout_s):
                return f"{rank_name(peer)} died or stopped answering (not heard from for {silent:.0f} s)"
        return None

    def where_report(self) -> str:
        """Where every rank was, as each last published it: one line per phase, the oldest first."""
        since: dict[str, list[float]] = {}
        ranks: dict[str, list[int]] = {}
        try:
            for peer in range(self.world):
                key = self._key(f"phase/{peer}")
                wall, name = self.store.get(key).decode().split("\t", 1) if self.store.check([key]) else ("inf", "not started")
                since.setdefault(name, []).append(float(wall))
                ranks.setdefault(name, []).append(peer)
        except Exception:  # noqa: BLE001 - the store is gone: nothing to report
            return "vlrft: where each rank was: unknown (the store did not answer)"
        lines = ["vlrft: where each rank was (the phase it last entered; since, by its own clock):"]
        for name in sorted(since, key=lambda n: min(since[n])):
            first = min(since[name])
            when = f"  since {time.strftime('%H:%M:%S', time.localtime(first))}" if first != float("inf") else ""
            lines.append(f"  {name}: {rank_ranges(ranks[name])}{when}")
        return "\n".join(lines)

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            reason, found_here = self.tick(time.monotonic())
            if reason is not None:
                self._end(reason, found_here)
                return

    def _end(self, reason: str, found_here: bool) -> None:
        # A tick for this rank's own main thread to reach `fail` first: when every rank raises
        # after the same collective, each prints its own message.
        if self._stop.wait(TICK_S):
            return
        with self._lock:
            if self._stop.is_set():
                return
            # Every rank sees the job-wide count stand still at about the same tick (and two may find
            # deaths at once): the first to claim the report writes it, the others stop as readers.
            claimed = found_here and self._claim_report()
            # A death found in doubt is the whole story: where this rank's main thread waits
            # (for the dead peer) adds nothing.
            at = "" if _DOUBT.is_set() else f" [its main thread is at {main_thread_at()}]"
            say(f"vlrft: {rank_name(self.rank)} stops: {reason}{at}", sys.stderr)
            if claimed:
                if not _DOUBT.is_set():
                    say(self.where_report(), sys.stderr)
                # Every rank is alive in a stall and reads the record; a dead rank never does.
                self._record(reason, expected=self.world if self.stalled else self.world - 1)
            elif not self.store_lost:
                if found_here:  # found at the same tick as the rank that claimed the report: its record
                    self._await_record()
                self._settle()
                time.sleep(LINGER_S)
            sys.stdout.flush()
            sys.stderr.flush()
            # os._exit, not an exception or sys.exit: those would end only this thread, while
            # the main thread may sit in a collective that never returns; atexit handlers and
            # the process group's destruction could block on the dead peer the same way.
            os._exit(STOPPED_EXIT_CODE)

    def _await_record(self) -> None:
        deadline = time.monotonic() + ACK_WAIT_S
        try:
            while self.store.add(self._key("failures"), 0) == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store is gone: nothing to wait for
            pass

    def _claim_report(self) -> bool:
        try:
            return self.store.add(self._key("reporter"), 1) == 1
        except Exception:  # noqa: BLE001 - the store is gone: nobody else can report either
            return True

    def _settle(self) -> None:
        """Tell a failing rank that this one has read its record (or failed itself)."""
        try:
            self.store.add(self._key("settled"), 1)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is waiting
            pass

    def _record(self, reason: str, expected: int) -> None:
        """Leave `reason` for every rank to stop on, then wait (ACK_WAIT_S at most) until
        `expected` ranks have read it, so that a store this rank hosts outlives the reading."""
        if self.store_lost:
            return
        try:
            self.store.set(self._key("failure"), reason)
            self.store.add(self._key("failures"), 1)
            self.store.add(self._key("settled"), 1)
            deadline = time.monotonic() + ACK_WAIT_S
            while self.store.add(self._key("settled"), 0) < expected and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store is gone: the others find that out themselves
            pass

    def _hold_off(self) -> None:
        """No stop from the watch thread after this returns (it may be exiting the process now)."""
        with self._lock:
            self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def fail(self, message: str, reason: str) -> None:
        """This rank failed: print `message` (here only, so it appears once), then record
        `reason` (one line naming this rank) so that every other rank stops on it."""
        self._hold_off()
        say(message, sys.stderr)
        if self.active:
            self._record(reason, expected=self.world)

    def stop_on_lost_connection(self, err: BaseException) -> bool:
        """The main thread caught `err`. If it is a lost connection (a peer or the store gone),
        stop with one line naming the dead peer, which the watch thread finds and stops on (it
        ends the process), and True; else False, and nothing done."""
        lost = lost_connection(err)
        if lost is None or self.world == 1:
            return False
        if self.active:
            self.connection_lost = True
            doubt_peers()
            # The watch thread ends the process once it finds the dead peer: a tick to first
            # see each peer, GONE_AFTER_S of silence, a tick before it stops, and some slack.
            self._thread.join(min(GONE_AFTER_S, self.timeout_s) + 6 * TICK_S)
            why = "no peer has gone silent"
        else:
            why = "which peer is not known: guards.peer_timeout_s is 0"
        self.fail(f"vlrft: {rank_name(self.rank)} stops: it lost a connection ({lost}); {why}",
                  f"{rank_name(self.rank)} lost a connection ({lost})")
        return True

    def stop(self) -> None:
        """A clean finish (or a stop on a signal): the watch never fires after this, and the rank
        watching this one moves on to the next instead of waiting for a heartbeat."""
        self._hold_off()
        if self.active and not self.store_lost:
            try:
                self.store.add(self._key(f"finished/{self.rank}"), 1)
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to tell
                pass

    def running_peers(self, silence: Silence, now: float) -> set[int]:
        """The peers that have neither stopped their watch nor gone silent for GONE_AFTER_S
        (`silence`: the heartbeats seen so far, by this rank's clock)."""
        running = set()
        for peer in set(range(self.world)) - {self.rank}:
            if self.store.add(self._key(f"finished/{peer}"), 0) > 0:
                continue
            if silence.heard(peer, self.store.add(self._key(f"heartbeat/{peer}"), 0), now) < GONE_AFTER_S:
                running.add(peer)
        return running

    def linger(self, limit_s: float = LINGER_LIMIT_S) -> None:
        """After `stop` on a signal: wait until no peer is running (`running_peers`), for
        `limit_s` at most. Each rank's exit makes torchrun end the others, so a rank that left
        first would cut short a peer that is still stopping: an asynchronous run's rollout
        ranks finish their batch in flight and meet in an all-reduce before they stop."""
        if not self.active or self.store_lost:
            return
        silence, start = Silence(), time.monotonic()
        try:
            while (running := self.running_peers(silence, time.monotonic())) and time.monotonic() - start < limit_s:
                time.sleep(TICK_S / 4)
            gone = [p for p in set(range(self.world)) - {self.rank} - running
                    if self.store.add(self._key(f"finished/{p}"), 0) == 0]
        except Exception:  # noqa: BLE001 - the store is gone: so is whoever hosted it
            return
        for peer in sorted(gone):  # silent without having stopped: killed (torchrun's signal to the others may say so)
            say(f"vlrft: {rank_name(self.rank)} stops: {rank_name(peer)} died or stopped answering (it went silent "
                f"without stopping)", sys.stderr)


def main_thread_at() -> str:
    """The line the main thread is at: the innermost frame of vlrft's or the user's code, and the
    library call it is inside of (a collective's wait, a lock)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "an unknown line"
    stack = traceback.extract_stack(frame)

    def line(f) -> str:
        return f"{f.filename}:{f.lineno} in {f.name}"

    paths = sysconfig.get_paths()
    library = (paths["stdlib"], paths["purelib"], paths["platlib"], "<frozen")
    vlrft_dir = os.path.dirname(os.path.abspath(__file__))  # (installed into site-packages, or not)
    own = next((f for f in reversed(stack) if f.filename.startswith(vlrft_dir) or not f.filename.startswith(library)), None)
    if own is None or own is stack[-1]:
        return line(stack[-1])
    return f"{line(own)}, inside {line(stack[-1])}"


def rank_ranges(ranks: list[int]) -> str:
    """`[0, 1, 2, 5]` -> "ranks 0-2, 5"; `[3]` -> "rank 3"; `[]` -> "no rank"."""
    if not ranks:
        return "no rank"
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def start_rank_watch(timeout_s: float, stall_timeout_s: float = 0.0) -> RankWatch:
    """Watch this rank's peers (guards.peer_timeout_s; 0 = off) and its own progress
    (guards.stall_timeout_s; 0 = off). Call once the process group exists; in a world of one
    the watch is off."""
    from vlrft.distributed import rank, watch_store, world_size

    if world_size() == 1 or timeout_s <= 0:
        return RankWatch(None, rank(), world_size(), timeout_s)
    # torchrun's store outlives a restart of the workers: the keys of a failed attempt must not
    # stop the next one.
    prefix = f"vlrft/rank_watch/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return RankWatch(watch_store(timeout_s), rank(), world_size(), timeout_s, prefix, stall_timeout_s).start()
