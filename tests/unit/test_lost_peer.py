"""A peer's death seen first on this rank (vlrft/lost_connection.py, the rank watch's doubt):
gloo's lost connection or torchrun's signal, then one line naming the dead rank and its role.
Driven tick by tick on an in-memory store, as tests/unit/test_rank_watch.py; the runs are in
tests/integration/test_async_dead_peer.py and test_async_training.py's kill test."""

import threading

import pytest
import torch.distributed as dist

from tests.unit.test_rank_watch import MemoryStore
from vlrft import rank_watch
from vlrft.lost_connection import lost_connection
from vlrft.rank_watch import RankWatch

# As torch 2.x's gloo words them (a receive, an all-reduce, a broadcast from a killed peer).
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:16786. This is typically caused by a remote worker crashing. Check the logs of the "
               "remote worker before reporting an error. GLHF! 🏖️")
GLOO_RESET = "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [10.0.0.2]:41234: Connection reset by peer"


@pytest.fixture(autouse=True)
def async_roles(monkeypatch):
    """Ranks 0 and 1 train, 2 generates; nothing doubted yet (module state, per test)."""
    monkeypatch.setattr(rank_watch, "ROLES", {0: "trainer", 1: "trainer", 2: "rollout"})
    monkeypatch.setattr(rank_watch, "_DOUBT", threading.Event())


def test_a_lost_connection_is_told_from_any_other_error():
    assert lost_connection(RuntimeError(GLOO_CLOSED)) == "gloo: Connection closed by peer [127.0.0.1]:16786"
    assert lost_connection(RuntimeError(GLOO_RESET)) == "gloo: Read error [10.0.0.2]:41234: Connection reset by peer"
    assert lost_connection(dist.DistNetworkError("Connection reset by peer")) == "the job's store: Connection reset by peer"
    assert lost_connection(RuntimeError("Connection closed by peer")) is None  # not gloo's: a bug to show whole
    assert lost_connection(RuntimeError("CUDA error: an illegal memory access was encountered")) is None
    assert lost_connection(ValueError(GLOO_CLOSED)) is None


# A death found after this rank's own call lost its connection is recorded for every rank to stop
# on (this rank failed); one found on torchrun's signal alone is not: torchrun stops the others.
@pytest.mark.parametrize("connection_lost", [False, True])
def test_in_doubt_a_peer_silent_for_seconds_is_dead_and_named_with_its_role(connection_lost):
    store = MemoryStore()
    r0, r1, r2 = (RankWatch(store, r, 3, timeout_s=60.0) for r in range(3))
    r2.connection_lost = connection_lost
    for now in (0.0, 1.0, 2.0):
        for watch in (r0, r1, r2):
            watch.tick(now)
    # rank 1 (a trainer) is killed after its tick at t=2; the rollout rank 2 watches rank 0 in the ring
    for now in range(3, 9):
        assert r2.tick(float(now)) == (None, False)  # within guards.peer_timeout_s, and no doubt
        r0.tick(float(now))
    rank_watch.doubt_peers()  # a lost connection, or torchrun's signal during a wait
    assert r2.tick(9.0) == (None, False)  # first sight of rank 1 here
    for now in range(10, 14):
        assert r2.tick(float(now)) == (None, False)
        r0.tick(float(now))
    assert r2.tick(14.0) == ("rank 1 (trainer) died or stopped answering (not heard from for 5 s)", connection_lost)


def test_in_doubt_a_peer_that_finished_or_still_beats_is_not_dead():
    store = MemoryStore()
    r0, r1, r2 = (RankWatch(store, r, 3, timeout_s=60.0) for r in range(3))
    for watch in (r0, r1, r2):
        watch.tick(0.0)
    r1.stop()  # a clean stop, then silence
    rank_watch.doubt_peers()
    for now in range(1, 30):
        assert r2.tick(float(now)) == (None, False)
        r0.tick(float(now))


def test_in_doubt_a_store_gone_for_seconds_names_its_host():
    store = MemoryStore()
    r2 = RankWatch(store, 2, 3, timeout_s=60.0)
    r2.tick(0.0)
    store.gone = True
    rank_watch.doubt_peers()
    for now in range(1, 5):
        assert r2.tick(float(now)) == (None, False)
    assert r2.tick(5.0) == ("the rendezvous store has not answered for 5 s (its host, rank 0 (trainer) or torchrun, gone?)",
                            False)


def test_a_lost_connection_stops_with_one_line_and_anything_else_is_left_alone(capsys):
    off = RankWatch(None, 2, 3, timeout_s=0.0)  # guards.peer_timeout_s: 0
    assert off.stop_on_lost_connection(ValueError("bad batch")) is False
    assert RankWatch(None, 0, 1, 60.0).stop_on_lost_connection(RuntimeError(GLOO_CLOSED)) is False  # no peers
    assert capsys.readouterr().err == ""
    assert off.stop_on_lost_connection(RuntimeError(GLOO_CLOSED)) is True
    assert capsys.readouterr().err == ("vlrft: rank 2 (rollout) stops: it lost a connection (gloo: Connection closed by "
                                       "peer [127.0.0.1]:16786); which peer is not known: guards.peer_timeout_s is 0\n")


def test_a_rank_that_stops_names_a_peer_that_went_silent_without_stopping(monkeypatch, capsys):
    monkeypatch.setattr(rank_watch, "GONE_AFTER_S", 0.3)
    store = MemoryStore()
    r0, r1, r2 = (RankWatch(store, r, 3, timeout_s=60.0) for r in range(3))
    for watch in (r0, r1, r2):
        watch.tick(0.0)
    r1.stop()  # stopped as asked; rank 2 was killed
    r0.stop()
    r0.linger(limit_s=30.0)
    assert capsys.readouterr().err == ("vlrft: rank 0 (trainer) stops: rank 2 (rollout) died or stopped answering "
                                       "(it went silent without stopping)\n")


# Trainer rank 0's waits on the job's store for a rollout rank: for its evaluation, and (after the
# last step, when no signal ends that wait) for it to be ready to take the step's weights.
@pytest.mark.parametrize("wait", ["evaluation", "weights taken"])
def test_torchrun_s_signal_reaches_trainer_rank_0_waiting_for_a_dead_rollout_rank(wait, monkeypatch):
    """The rollout rank was killed, so the wait never ends by itself: torchrun's SIGTERM must be
    handled within a look, and the wait then doubts its peers. One blocking get on a real
    TCPStore would hold the handler off until the store's timeout."""
    import datetime
    import os
    import signal
    import time
    from types import SimpleNamespace

    from vlrft.trainer import version_board
    from vlrft.trainer.async_roles import doubt_if_signalled
    from vlrft.trainer.weights_delivery import RolloutRanks, WeightsRoutes

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    monkeypatch.setattr(version_board, "watch_store", lambda timeout_s: store)
    trainer = SimpleNamespace(stop_signal=None)

    class Doubted(Exception):
        pass

    def waiting():
        doubt_if_signalled(trainer)
        if rank_watch._DOUBT.is_set():
            raise Doubted  # (where the rank watch ends the process, naming the silent peer)

    if wait == "evaluation":
        board = version_board.VersionBoard()
        waits = lambda: board.evaluation(2, waiting)  # noqa: E731
    else:
        delivery = RolloutRanks(WeightsRoutes([None], [[1]], None), 0, True, lambda version: None, lambda: iter(()))
        delivery.version, delivery.while_waiting = 6, waiting
        # The last step's: `stopping()` stays False, but for a bound, so that a wait that never
        # doubts fails this test instead of hanging it.
        bound = time.monotonic() + 20
        delivery.stopping = lambda: time.monotonic() > bound
        waits = lambda: delivery._next_ready([0])  # noqa: E731
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: setattr(trainer, "stop_signal", signum))
    torchrun = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        torchrun.start()
        start = time.monotonic()
        with pytest.raises(Doubted):
            waits()
        assert time.monotonic() - start < 10
    finally:
        torchrun.cancel()  # (a wait that ended first must not leave the signal to kill pytest)
        torchrun.join()
        signal.signal(signal.SIGTERM, previous)
    if wait == "evaluation":
        board.post_evaluation(4, {"eval/accuracy": 0.5})
        assert board.evaluation(4, waiting) == {"eval/accuracy": 0.5}  # posted already: no wait
