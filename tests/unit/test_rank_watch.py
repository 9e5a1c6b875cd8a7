"""The rank watch's decisions (vlrft/rank_watch.py), driven tick by tick on an in-memory store
and a made-up clock: no processes, threads or sleeps. The 2-rank runs are in
tests/integration/test_rank_failure.py."""

import re
import threading
import time

import pytest

from vlrft import progress, rank_watch
from vlrft.config import ConfigError, load_config
from vlrft.rank_watch import RankWatch, Silence, next_watched, rank_ranges


class MemoryStore:
    """The calls the watch makes on a torch.distributed Store; `gone` makes every call fail as a
    closed TCPStore does."""

    def __init__(self):
        self.values: dict[str, object] = {}
        self.gone = False

    def _check(self):
        if self.gone:
            raise RuntimeError("Broken pipe")

    def add(self, key, amount):
        self._check()
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]

    def set(self, key, value):
        self._check()
        self.values[key] = value.encode()

    def get(self, key):
        self._check()
        return self.values[key]

    def check(self, keys):
        self._check()
        return all(key in self.values for key in keys)


def watches(store, world, timeout_s=60.0):
    return [RankWatch(store, r, world, timeout_s) for r in range(world)]


def test_the_ring_skips_finished_ranks_and_ends_when_all_have():
    assert next_watched(0, 4, set()) == 1
    assert next_watched(3, 4, set()) == 0
    assert next_watched(1, 4, {2, 3}) == 0
    assert next_watched(1, 4, {0, 2, 3}) is None
    assert next_watched(0, 1, set()) is None


def test_silence_counts_from_the_last_change_by_this_ranks_clock():
    silence = Silence()
    assert silence.heard(1, 5, now=100.0) == 0.0  # first sight: nothing to compare with
    assert silence.heard(1, 5, now=130.0) == 30.0
    assert silence.heard(1, 6, now=131.0) == 0.0
    assert silence.heard(1, 6, now=140.0) == 9.0


def test_live_peers_never_stop_anyone():
    store = MemoryStore()
    ranks = watches(store, 3)
    for now in range(0, 300):
        for watch in ranks:
            assert watch.tick(float(now)) == (None, False)


@pytest.mark.parametrize("timeout_s", [5.0, 60.0])
def test_a_silent_peer_is_dead_after_the_timeout_and_only_its_watcher_finds_it(timeout_s):
    store = MemoryStore()
    r0, r1, r2 = watches(store, 3, timeout_s)
    for now in range(3):
        for watch in (r2, r0, r1):
            watch.tick(float(now))
    # rank 2 is killed after its tick at t=2: only rank 1 (just before it in the ring) watches it
    now = 2.0
    while now < 2.0 + timeout_s - 1:
        now += 1.0
        assert r0.tick(now) == (None, False) and r1.tick(now) == (None, False)
    now += 1.0
    assert r0.tick(now) == (None, False)
    assert r1.tick(now) == (f"rank 2 has not been heard from for {timeout_s:.0f} s (killed?)", True)


def test_a_recorded_failure_stops_every_other_rank_with_its_line(monkeypatch, capsys):
    monkeypatch.setattr(rank_watch, "ACK_WAIT_S", 0.0)  # nobody here reads it back
    store = MemoryStore()
    r0, r1, r2 = watches(store, 3)
    for watch in (r0, r1, r2):
        watch.tick(0.0)
    r1.fail("vlrft: error: disk full", "rank 1 failed with OSError (its message is above)")  # prints, records
    assert r0.tick(1.0) == ("rank 1 failed with OSError (its message is above)", False)
    assert r2.tick(1.0) == ("rank 1 failed with OSError (its message is above)", False)
    assert capsys.readouterr().err == "vlrft: error: disk full\n"  # the failing rank's message, once


def test_a_rank_that_finished_cleanly_is_not_dead_and_its_watcher_moves_on():
    store = MemoryStore()
    r0, r1, r2 = watches(store, 3, timeout_s=5.0)
    for watch in (r0, r1, r2):
        watch.tick(0.0)
    r1.stop()
    for now in range(1, 20):  # rank 1 is silent for good, but finished
        assert r0.tick(float(now)) == (None, False)
        assert r2.tick(float(now)) == (None, False)
    # rank 0 now watches rank 2: a kill of rank 2 (it ticks no more) is still found
    for now in range(20, 25):
        assert r0.tick(float(now)) == (None, False)
    assert r0.tick(25.0) == ("rank 2 has not been heard from for 5 s (killed?)", True)


def test_a_stopped_rank_lingers_until_each_peer_has_stopped_or_gone_silent():
    store = MemoryStore()
    r0, r1, r2 = watches(store, 3)
    for watch in (r0, r1, r2):
        watch.tick(0.0)
    r0.stop()
    silence = Silence()
    assert r0.running_peers(silence, 0.0) == {1, 2}
    for now in range(1, 5):  # rank 1 still stopping (its heartbeat moves), rank 2 killed
        r1.tick(float(now))
        assert r0.running_peers(silence, float(now)) == {1, 2}
    r1.tick(5.0)
    assert r0.running_peers(silence, 5.0) == {1}  # rank 2 silent for GONE_AFTER_S: gone
    r1.stop()
    assert r0.running_peers(silence, 6.0) == set()
    r0.linger(limit_s=1.0)  # returns at once: nobody is running


def test_a_store_that_stops_answering_counts_as_a_silent_peer():
    store = MemoryStore()
    (r0, r1) = watches(store, 2, timeout_s=10.0)
    r0.tick(0.0)
    r1.tick(0.0)
    store.gone = True  # rank 0 hosted it and was killed
    for now in range(1, 10):
        assert r1.tick(float(now)) == (None, False)
    reason, found_here = r1.tick(10.0)
    assert reason == "the rendezvous store has not answered for 10 s (its host, rank 0 or torchrun, gone?)"
    assert not found_here  # nowhere to record it: every rank finds it itself


def test_after_a_clean_stop_the_watch_never_ends_the_process():
    store = MemoryStore()
    r0, r1 = watches(store, 2, timeout_s=10.0)
    r0.tick(0.0)
    store.gone = True  # e.g. rank 0 hosted the store and has already exited cleanly
    r1.tick(1.0)
    r1.stop()  # must not touch the lost store
    assert r1.tick(11.0)[0] is not None  # a late tick would find a reason to stop...
    r1._end("late", found_here=False)  # ...but ending returns instead of calling os._exit


def test_off_in_a_world_of_one_fail_only_prints(capsys):
    watch = RankWatch(None, 0, 1, 60.0)
    assert not watch.active
    watch.start().fail("vlrft: error: disk full", "unused")
    watch.stop()
    assert capsys.readouterr().err == "vlrft: error: disk full\n"


@pytest.mark.parametrize("key", ["peer_timeout_s", "stall_timeout_s"])
def test_the_watch_timeouts_must_not_be_negative(key, tmp_path):
    (tmp_path / "c.yaml").write_text(f"model: {{path: m}}\ndata: {{train_path: t.jsonl}}\nguards: {{{key}: -1}}\n")
    with pytest.raises(ConfigError, match=rf"^config key 'guards.{key}' must be >= 0 \(0 = off\), got -1"):
        load_config(str(tmp_path / "c.yaml"))


def in_phase(monkeypatch, phase: progress.Phase) -> None:
    """This rank's main thread is in `phase` (entered on the made-up clock of the ticks)."""
    monkeypatch.setattr(progress, "_current", phase)


def recorded_sets(store, monkeypatch) -> list[str]:
    """The keys the watches `set` on `store`, in order (the list grows as they do)."""
    sets, real_set = [], store.set
    monkeypatch.setattr(store, "set", lambda key, value: (sets.append(key), real_set(key, value)))
    return sets


def stall_watches(store, world=2, stall_timeout_s=30.0):
    return [RankWatch(store, r, world, 60.0, stall_timeout_s=stall_timeout_s) for r in range(world)]


def tick_in(monkeypatch, watch, phase, now):
    """One tick of `watch` while its rank's main thread is in `phase` (each rank its own)."""
    in_phase(monkeypatch, phase)
    return watch.tick(now)


def test_when_no_rank_moves_to_a_new_phase_for_the_stall_timeout_the_job_is_hung(monkeypatch):
    store = MemoryStore()
    r0, r1 = stall_watches(store)
    update, sync = progress.Phase("step 3: update", 100.0, 0.0), progress.Phase("step 3: weight sync", 120.0, 0.0)
    for now in range(100, 150):  # rank 1 moved on at 120: the job moved, its last move counts
        assert tick_in(monkeypatch, r1, update if now < 120 else sync, float(now)) == (None, False)
        assert tick_in(monkeypatch, r0, update, float(now)) == (None, False)
    assert tick_in(monkeypatch, r1, sync, 150.0) == (
        "no rank has moved to a new phase for 30 s (guards.stall_timeout_s: 30): the job is hung", True)
    assert r1.stalled and not r0.stalled


def test_a_rank_that_waits_long_on_a_working_one_is_no_stall(monkeypatch):
    store = MemoryStore()
    trainer, rollout = stall_watches(store)
    waiting = progress.Phase("step 1: waiting for the batch of rank 1", 0.0, 0.0)
    for now in range(0, 300):  # the rollout rank evaluates, a decoding batch every 20 s
        batch = progress.Phase("step 0: evaluation", float(now - now % 20), 0.0)
        assert tick_in(monkeypatch, rollout, batch, float(now)) == (None, False)
        assert tick_in(monkeypatch, trainer, waiting, float(now)) == (None, False)


def test_building_the_trainer_is_never_a_stall(monkeypatch):
    store = MemoryStore()
    r0, r1 = stall_watches(store)
    building = progress.Phase("building the trainer (models, engine, data)", 0.0, 0.0, guarded=False)
    for now in range(0, 3600, 10):  # rank 0 downloads the model, rank 1 waits for it
        assert tick_in(monkeypatch, r0, building, float(now)) == (None, False)
        assert tick_in(monkeypatch, r1, building, float(now)) == (None, False)


def test_the_line_a_stopping_rank_names_is_its_own_code_inside_the_library_call():
    from vlrft.rank_watch import main_thread_at

    seen, asked = [], threading.Event()

    def ask():
        asked.wait()
        seen.append(main_thread_at())

    def waiting_in_the_loop(released):
        asked.set()
        released.wait(timeout=30)  # a lock's wait, in the standard library

    released = threading.Event()
    helper = threading.Thread(target=lambda: (ask(), released.set()))
    helper.start()
    waiting_in_the_loop(released)
    helper.join()
    assert re.fullmatch(rf"{re.escape(__file__)}:\d+ in waiting_in_the_loop, inside .*threading\.py:\d+ in wait", seen[0]), seen


def test_advance_in_another_thread_is_not_the_loop_moving():
    progress.enter("step 1: update")
    before = progress.current()
    helper = threading.Thread(target=progress.advance)  # a reward model's engine in a worker thread
    helper.start()
    helper.join()
    assert progress.current() is before
    progress.advance()
    assert progress.current() is not before and progress.current().name == "step 1: update"


def test_with_the_stall_timeout_off_a_phase_may_last_forever(monkeypatch):
    store = MemoryStore()
    r0, r1 = (RankWatch(store, r, 2, 60.0) for r in range(2))
    in_phase(monkeypatch, progress.Phase("step 1: generating and scoring", 0.0, 0.0))
    for now in range(0, 100_000, 1000):
        assert r0.tick(float(now)) == (None, False) and r1.tick(float(now)) == (None, False)


def test_each_phase_is_published_once_and_the_report_groups_ranks_oldest_phase_first(monkeypatch):
    store = MemoryStore()
    sets = recorded_sets(store, monkeypatch)
    ranks = watches(store, 6)
    # 12:00:10 and later by each rank's clock (the report prints its wall clock, never compares ages)
    base = 1_790_000_000.0
    phases = {rank: progress.Phase(name, since, base + since) for rank, (name, since) in {
        0: ("step 4: weight sync", 40.0), 1: ("step 4: update", 10.0), 2: ("step 4: weight sync", 41.0),
        3: ("step 4: weight sync", 42.0), 5: ("step 4: update", 12.0)}.items()}
    for now in (50.0, 51.0, 52.0):
        for rank, phase in phases.items():
            tick_in(monkeypatch, ranks[rank], phase, now)
    # rank 4 never started its watch; a phase is published when it changes, not every tick
    assert sorted(sets) == [f"vlrft/rank_watch/phase/{rank}" for rank in phases]
    when = {s: time.strftime("%H:%M:%S", time.localtime(base + s)) for s in (10.0, 40.0)}
    assert ranks[0].where_report() == (
        "vlrft: where each rank was (the phase it last entered; since, by its own clock):\n"
        f"  step 4: update: ranks 1, 5  since {when[10.0]}\n"
        f"  step 4: weight sync: ranks 0, 2-3  since {when[40.0]}\n"
        "  not started: rank 4")


def test_a_phase_is_published_again_only_when_the_loop_enters_another(monkeypatch):
    store = MemoryStore()
    sets = recorded_sets(store, monkeypatch)
    (r0, _) = watches(store, 2)
    in_phase(monkeypatch, progress.Phase("step 1: update", 0.0, 0.0))
    for now in range(5):
        r0.tick(float(now))
    assert sets == ["vlrft/rank_watch/phase/0"]
    progress.enter("step 1: weight sync")
    r0.tick(5.0)
    assert sets == ["vlrft/rank_watch/phase/0"] * 2
    assert store.values["vlrft/rank_watch/phase/0"].decode().endswith("\tstep 1: weight sync")


def test_a_wait_inside_a_phase_is_named_while_it_lasts_and_counts_as_progress():
    progress.enter("step 2: generating and scoring")
    entered = progress.current()
    with progress.during("taking weights version 2 from trainer rank 0"):
        assert progress.current().name == "taking weights version 2 from trainer rank 0"
    assert progress.current().name == "step 2: generating and scoring"
    assert progress.current().since >= entered.since and progress.current() is not entered


def test_a_long_phase_that_advances_is_no_stall(monkeypatch):
    store = MemoryStore()
    r0, r1 = (RankWatch(store, r, 2, 60.0, stall_timeout_s=30.0) for r in range(2))
    clock = [0.0]
    monkeypatch.setattr(progress, "monotonic", lambda: clock[0])
    progress.enter("step 1: evaluation")  # at 0
    for now in range(1, 100):
        clock[0] = float(now)
        if now % 20 == 0:
            progress.advance()  # the engine's next decoding batch
            assert progress.current().name == "step 1: evaluation"
        assert r0.tick(float(now)) == (None, False) and r1.tick(float(now)) == (None, False)


def test_of_ranks_that_find_a_stop_at_the_same_tick_one_reports(monkeypatch):
    store = MemoryStore()
    r0, r1, r2 = watches(store, 3)
    assert [r1._claim_report(), r0._claim_report(), r2._claim_report()] == [True, False, False]
    store.gone = True
    assert r0._claim_report()  # no store: nobody else can, so each reports what it knows


def test_a_report_without_a_store_says_so():
    store = MemoryStore()
    (r0, _) = watches(store, 2)
    store.gone = True
    assert r0.where_report() == "vlrft: where each rank was: unknown (the store did not answer)"


def test_rank_ranges_are_compact():
    assert rank_ranges([3]) == "rank 3"
    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "ranks 0-2, 5, 7-8"
