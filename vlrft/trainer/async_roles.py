"""Asynchronous training (`train.mode: async`, docs/async.md): the last `rollout.ranks` ranks
generate and score while the other ranks train, in one torchrun job. (The trainers come first:
global rank 0 writes the run's files, and transformers' save_pretrained writes on no other.)

    rollout rank j                              trainer rank t = j mod M (M trainer ranks)
    --------------                              ---------------------------------------------
    wait for weights version >= i - 1 - S  <--  broadcast version i - 1 (after update i - 1)
    generate + score batch i
    send batch i (non-blocking)            -->  receive batch i; experience pass; update i

Batch i is trained at version i - 1, so a batch generated with version v is at most
S = `train.max_staleness` updates old when it trains: the rollout ranks wait for weights (they
throttle) rather than drop late samples. S = 0 is the synchronous schedule, step for step.
Each rank's collectives (rank balance, metrics, DeepSpeed's gradients) run within its role's
group (vlrft.distributed.take_role); the roles meet only in the messages above and on the
job's key-value store (VersionBoard: versions announced, batches received, evaluations, a stop).
How the weights travel, both sides: trainer/weights_delivery.py.
"""

from __future__ import annotations

import functools
import signal
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from vlrft import progress
from vlrft.distributed import (
    EMA_HEADER,
    all_reduce_max_int,
    all_reduce_sum,
    global_rank,
    global_world_size,
    isend_object_to,
    receive_weights,
    recv_object_from,
)
from vlrft.distributed import world_size as role_world_size
from vlrft.multiturn.in_flight import InFlight
from vlrft.rank_watch import doubt_peers, rank_ranges
from vlrft.trainer.checkpoint import checkpoint_dir, checkpoint_due, rng_state, set_rng_state
from vlrft.trainer.checkpoint_io import TrainingStopped, save_checkpoint
from vlrft.trainer.checkpoint_read import load_state, restoring
from vlrft.trainer.dynamic_sampling import draw_prompts, round_seed
from vlrft.trainer.weights_delivery import POLL_S, WEIGHTS_SOURCE, take_version
from vlrft.trainer.version_board import VersionBoard

# How often a decoding rollout rank with partial rollouts looks there for new weights: a look
# is a round trip to the store, which every decoding step would pay otherwise (8% of a tiny
# model's decoding time on CPU).
WEIGHTS_POLL_S = 0.05


# A rollout rank's own metrics (the others are all-reduced among the rollout ranks): the trainers
# log their mean over the rollout ranks.
ROLLOUT_RANK_OWN = ("async/rollout_wait_seconds", "async/started_ahead", "async/updates_mid_batch")


def trainer_of(rollout_rank: int, trainers: int) -> int:
    """The trainer (its role rank = its global rank) that receives rollout role rank
    `rollout_rank`'s batches."""
    return rollout_rank % trainers


def sources_of(trainer_rank: int, rollout_ranks: int, trainers: int) -> list[int]:
    """The global ranks of the rollout ranks whose batches trainer `trainer_rank` receives."""
    return [trainers + j for j in range(rollout_ranks) if trainer_of(j, trainers) == trainer_rank]


def needed_version(step: int, max_staleness: int) -> int:
    """The oldest weights version batch `step` (1-based) may be generated with: it trains at
    version step - 1, at most `max_staleness` updates later."""
    return max(step - 1 - max_staleness, 0)


def staleness(step: int, version: int) -> int:
    """Updates between the weights that generated batch `step` and the ones it trains at."""
    return step - 1 - version


def takes_while_waiting(version: int, sent_step: int) -> bool:
    """Whether a rollout rank holding weights `version`, waiting for its trainer to receive
    batch `sent_step`, takes the next version there. The trainers broadcast each version up to
    sent_step - 1 before they receive that batch, so every rollout rank takes those there (and
    waits for them even if the receipt came first); version sent_step comes only after the
    receipt. Otherwise a rank that read the receipt's absence just before it came, and the
    announcement of sent_step just after, would take (and maybe evaluate, a collective of the
    rollout ranks) a version its peers take at another point of their loop: with several rollout
    ranks, a deadlock."""
    return version < sent_step - 1


def evaluation_due(version: int, every: int, total: int, sources: list) -> bool:
    """Whether the rollout ranks evaluate weights `version` (step 0, every `every`, the last)."""
    return bool(every and sources) and (version % every == 0 or version == total)


def takes_mid_batch(version: int, rollout_ranks: int, every: int, total: int, sources: list) -> bool:
    """Whether a rollout rank with partial rollouts takes weights `version` between two decoding
    steps. A version the rollout ranks evaluate waits for the batch's end when there are several
    (evaluation is a collective of theirs): each takes those at the same points of its loop,
    where every one of them takes the same versions up to the same one, while the others may be
    taken anywhere, since each rollout rank receives them on its own."""
    return rollout_ranks == 1 or not evaluation_due(version, every, total, sources)


class StoppedMidBatch(Exception):
    """The trainers stopped while a rollout rank with peers waited mid-batch for a version."""


@dataclass
class StartedBatch:
    """A step's first sampling round, started by the rollout rank during an earlier step, while
    that step's batch waited on its environments (partial rollouts with a multi-turn environment)."""

    step: int
    prompts: list
    skipped: int  # bad prompts skipped while drawing them (all ranks)
    rollouts: InFlight
    version: int  # the weights it started with: the oldest any of its tokens is sampled with
    consumed_before: int  # the sampler's position before its prompts were drawn


def rollout_rank_state(trainer) -> dict:
    """What a rollout rank resumes from, taken right after it generated a batch: it travels to
    its trainer with that batch, which writes it into the checkpoint of that step as this
    rank's rank file (the rollout ranks take no part in saving). Batches started ahead were
    never trained: a resumed run draws their prompts again."""
    ahead = trainer.started_ahead
    return {"rng": rng_state(), "prompts_consumed": ahead[0].consumed_before if ahead else trainer.sampler.consumed,
            "dropped_rows": sorted(trainer.bad_input.dropped_rows)}


def resume_rollout_rank(trainer, path) -> None:
    """A rollout rank resumes from a checkpoint: the prompt position and random streams it had
    right after generating the checkpoint's step, and the checkpoint's policy from trainer rank
    0 (the batches it had generated beyond that step were never trained: it generates them again)."""
    trainer_file, rank_file = path / "trainer.pt", path / f"rank{global_rank()}.pt"
    step = load_state(trainer_file, mmap=True)["step"]  # (checked by rank 0: checkpoint.check_checkpoint)
    mine = load_state(rank_file)
    trainer.global_step = step
    with restoring(rank_file):
        trainer.sampler.consumed = mine["prompts_consumed"]
        trainer.bad_input.dropped_rows = set(mine.get("dropped_rows", ()))
    trainer.weights_version = take_version(trainer, VersionBoard(), step, lambda: None)
    with restoring(rank_file):
        set_rng_state(mine["rng"])


def doubt_if_signalled(trainer) -> None:
    """Called at a wait for a peer. A signal then may be torchrun's after a peer died: the wait
    would never end, so the rank watch now takes a peer silent for seconds as dead."""
    if trainer.stop_signal is not None:
        doubt_peers()


def run_role(trainer) -> list[tuple[int, float]]:
    """The asynchronous loop of this rank's role. Returns the evaluations (trainer rank 0)."""
    return run_rollout(trainer) if trainer.role == "rollout" else run_trainer(trainer)


def run_rollout(trainer) -> list[tuple[int, float]]:
    """A rollout rank: for each step, wait for the weights the staleness bound needs, generate
    and score its share of the batch, send it to its trainer; evaluate each version that is due.
    Partial rollouts take newer weights between two decoding steps as well."""
    cfg = trainer.cfg
    total, every = cfg.train.total_steps, cfg.eval.every_steps
    rollout_ranks, world = cfg.rollout.ranks, global_world_size()
    destination = trainer_of(trainer.rank, world - rollout_ranks)
    version = trainer.weights_version  # 0, or a resumed run's step
    taken_mid_batch = 0  # versions a partial rollout took while this batch was generated

    def evaluate_if_due() -> None:
        if evaluation_due(version, every, total, trainer.eval_sources):
            hook, trainer.engine.new_weights = trainer.engine.new_weights, None  # (no update inside evaluation)
            live = None
            if cfg.train.ema_beta > 0 and version > 0:  # the trainers send the policy EMA after this version: it is evaluated
                live = list(trainer.engine.named_weights())
                receive_weights(trainer.weights.group, WEIGHTS_SOURCE, version,
                                lambda named: trainer.guards.digests.update(named, f"at EMA weights version {version}"),
                                header=EMA_HEADER)
            stop_if_a_peer_stopped()
            metrics = trainer.evaluate_engine()  # a collective of the rollout ranks
            if live is not None:
                trainer.guards.digests.update(live, f"after evaluating the EMA of version {version}")
            trainer.engine.new_weights = hook
            if trainer.rank == 0:  # the same numbers on every rollout rank: one posts them
                board.post_evaluation(version, metrics)

    board = VersionBoard()

    def stopped(step: int) -> TrainingStopped:
        return TrainingStopped(step, checkpoint_dir(trainer.out_dir, step), trainer.stop_signal or signal.SIGTERM)

    # The rollout ranks stop together, so that none is left inside a collective of theirs that
    # a stopped peer never joins. A rank that meets the trainers' stop at a wait joins one
    # all-reduce, which its peers meet at their own next wait or before their next collectives
    # (a batch's, an evaluation's); a rank may stop mid-batch only when it is the only one.
    def stop_if_the_trainers_stopped() -> None:  # at a wait for the trainers: nothing more comes
        step = board.stopped_after()
        if step:
            all_reduce_max_int(step)
            raise stopped(step)
        doubt_if_signalled(trainer)

    def stop_if_a_peer_stopped() -> None:
        step = all_reduce_max_int(0)
        if step:
            raise stopped(step)

    sent, sent_step = 0, trainer.global_step  # batches sent to the trainer; the step of the last

    def wait_until_received(pending) -> None:
        """Until the trainer has received every batch sent (it acknowledges each on the store),
        take the weights it sends meanwhile: with S >= 2 it sends a version before it receives
        the batch, and a rollout rank that waited only for the receipt would deadlock it."""
        progress.enter(f"step {sent_step}: waiting for trainer rank {destination} to receive the batch")
        while (takes := takes_while_waiting(version, sent_step)) or board.received(global_rank()) < sent:
            if takes and board.newest() > version:
                next_version()
                continue
            stop_if_the_trainers_stopped()
            if trainer.maker.between_turns is None or not trainer.maker.between_turns():  # (the next batch goes on)
                time.sleep(POLL_S)
        stop_if_the_trainers_stopped()  # (they would never receive the next batch: they may be gone)
        if pending is not None:
            pending.wait()

    def next_version(stop_if_the_trainers_stopped=stop_if_the_trainers_stopped) -> None:
        nonlocal version
        version = take_version(trainer, board, version + 1, stop_if_the_trainers_stopped)
        evaluate_if_due()

    if cfg.train.partial_rollouts:

        looked = 0.0  # when new_weights last looked at the store
        stop_seen = False  # several rollout ranks: the trainers stopped while this batch decoded

        def note_the_stop() -> None:
            if board.stopped_after():
                raise StoppedMidBatch
            doubt_if_signalled(trainer)

        def new_weights() -> bool:  # between two decoding steps: take what the trainer announced
            nonlocal taken_mid_batch, looked, stop_seen
            if stop_seen or time.monotonic() - looked < WEIGHTS_POLL_S:
                return False
            looked = time.monotonic()
            took = False
            while version < board.newest() and takes_mid_batch(version + 1, rollout_ranks, every, total, trainer.eval_sources):
                try:
                    next_version(stop_if_the_trainers_stopped if rollout_ranks == 1 else note_the_stop)
                except StoppedMidBatch:  # the batch ends with the weights it has; the stop is met at the next wait
                    stop_seen = True
                    break
                taken_mid_batch += 1
                took = True
            return took

        trainer.engine.new_weights = new_weights
        # (Batches started ahead draw prompts, a collective of the rollout ranks when there are several.)
        if trainer.maker.settings.multi_turn is not None and not cfg.rollout.dynamic_sampling and rollout_ranks == 1:
            trainer.maker.between_turns = partial(start_next_batch, trainer, new_weights, lambda: version, board)

    evaluate_if_due()  # (a resumed run evaluates its step again: discard_after dropped that line)
    pending = None  # the last batch's send, still in flight
    for step in range(trainer.global_step + 1, total + 1):
        waited = time.perf_counter()
        while version < needed_version(step, cfg.train.max_staleness):
            next_version()
        waited = time.perf_counter() - waited
        stop_if_a_peer_stopped()
        trainer.begin_step()
        ahead = next((batch for batch in trainer.started_ahead if batch.step == step), None)
        started_at, taken_mid_batch = version if ahead is None else ahead.version, 0
        kept, generated, metrics = trainer.collect_experiences()
        resume = rollout_rank_state(trainer)  # for the checkpoint of this step, if one is due
        metrics["async/rollout_wait_seconds"] = waited
        metrics["async/started_ahead"] = float(ahead is not None)
        metrics["async/updates_mid_batch"] = float(taken_mid_batch)
        wait_until_received(pending)
        # The batch's version is the oldest its tokens were sampled with. A signal this rank got
        # travels with it: the trainers stop after that step, saving a checkpoint.
        pending = isend_object_to(destination, {"step": step, "version": started_at, "kept": kept, "generated": generated,
                                                "metrics": metrics, "resume": resume, "signal": trainer.stop_signal})
        sent, sent_step = sent + 1, step
    while version < total:  # the remaining updates (and their evaluations)
        next_version()
    wait_until_received(pending)
    return []


def start_next_batch(trainer, new_weights: Callable[[], bool], held_version: Callable[[], int], board: VersionBoard) -> bool:
    """A rollout rank with partial rollouts, while its batch waits on its environments: take
    the weights the trainer announced, start the next step's batch as soon as the staleness
    bound allows it (with S = `train.max_staleness`, up to S batches ahead), and decode a
    started batch's next turn once its environment calls have answered. Whether it did any of that."""
    took = new_weights()
    started = trainer.started_ahead
    following = (started[-1].step if started else trainer.global_step) + 1
    if (following <= trainer.cfg.train.total_steps
            and held_version() >= needed_version(following, trainer.cfg.train.max_staleness)
            and not board.stopped_after()):
        consumed = trainer.sampler.consumed
        prompts, skipped = draw_prompts(trainer)
        # Its environment calls are bounded by their timeout alone: the step budget restarts
        # with each step, and a batch started ahead would meet the end of another step's.
        rollouts = trainer.maker.start_rollouts(prompts, round_seed(trainer, following, 0), step_budget=False)
        started.append(StartedBatch(following, prompts, skipped, rollouts, held_version(), consumed))
        return True
    for batch in started:
        if batch.rollouts.ready():
            batch.rollouts.advance()
            return True
    return took


def run_trainer(trainer) -> list[tuple[int, float]]:
    """A trainer rank: for each step, receive the batches of its rollout ranks and learn from
    them (experience pass, update, weights to the rollout ranks); log; checkpoint (with its
    rollout ranks' states) when due; export at the end."""
    cfg = trainer.cfg
    rollout_ranks, trainers = cfg.rollout.ranks, role_world_size()
    sources = sources_of(trainer.rank, rollout_ranks, trainers)
    board = VersionBoard()

    def receive() -> list[dict]:
        if sources:
            progress.enter(f"step {trainer.global_step + 1}: waiting for the batch of {rank_ranges(sources)}")
        messages = [recv_object_from(source) for source in sources]
        for source in sources:
            board.acknowledge(source)
        return messages

    next_evaluation = trainer.global_step  # (a resumed run's rollout ranks evaluate its step again)
    doubt = functools.partial(doubt_if_signalled, trainer)  # at its waits on the store for a rollout rank
    trainer.engine.while_waiting = doubt  # (for the rollout ranks to take weights)

    def log_evaluations(upto: int, wait: bool) -> None:
        """Log the rollout ranks' evaluations of versions up to `upto` in order (trainer rank 0,
        the one that logs); `wait`: for each that is due, else only those posted already."""
        nonlocal next_evaluation
        while trainer.writes_output and next_evaluation <= upto:
            if evaluation_due(next_evaluation, cfg.eval.every_steps, cfg.train.total_steps, trainer.eval_sources):
                if not board.has_evaluation(next_evaluation):
                    if not wait:
                        return
                    progress.enter(f"waiting for the rollout ranks' evaluation of version {next_evaluation}")
                metrics = board.evaluation(next_evaluation, doubt)
                trainer.eval_history.append((next_evaluation, metrics["eval/accuracy"]))
                trainer.logger.log(next_evaluation, metrics)
            next_evaluation += 1

    for step in range(trainer.global_step + 1, cfg.train.total_steps + 1):
        waited = time.perf_counter()
        messages = receive()
        waited = time.perf_counter() - waited
        start = trainer.begin_step()
        assert all(m["step"] == step for m in messages), [m["step"] for m in messages]
        kept = [e for m in messages for e in m["kept"]]
        generated = [e for m in messages for e in m["generated"]]
        # Rollout metrics are the same on every rollout rank (all-reduced there), but for each
        # one's own timings and counts: those are averaged over the rollout ranks.
        metrics = dict(messages[0]["metrics"]) if messages else {}
        ages = [staleness(step, m["version"]) for m in messages]
        own = torch.tensor([[m["metrics"][key] for key in ROLLOUT_RANK_OWN] for m in messages], dtype=torch.float64)
        age_sum, batches, *own_sums = all_reduce_sum(
            torch.cat([torch.tensor([float(sum(ages)), float(len(ages))]), own.reshape(-1, len(ROLLOUT_RANK_OWN)).sum(0)])
        ).tolist()
        metrics |= {key: total / max(batches, 1.0) for key, total in zip(ROLLOUT_RANK_OWN, own_sums)}
        metrics["async/staleness_mean"] = age_sum / max(batches, 1.0)
        metrics["async/staleness_max"] = float(all_reduce_max_int(max(ages, default=0)))
        metrics["async/trainer_wait_seconds"] = waited
        # A signal that has come by the time trainer rank 0 waits for the rollout ranks to take
        # this step's weights stops the run after this step without sending them (the
        # checkpoint holds them). Not after the last step: the rollout ranks wait for it.
        sent_signal = next((m["signal"] for m in messages if m["signal"] is not None), None)  # (a rollout rank's)
        trainer.engine.stopping = lambda: step < cfg.train.total_steps and (trainer.stop_signal or sent_signal) is not None
        metrics = trainer.learn(kept, generated, metrics, start)
        trainer.logger.log(step, metrics)
        log_evaluations(step, wait=False)
        # A signal on any rank (a rollout rank's came with its batch) stops the run after this
        # step; after the last one the run simply ends.
        signum = trainer.stop_signal or sent_signal or 0
        stop = all_reduce_max_int(signum) if step < cfg.train.total_steps else 0
        assert stop or not trainer.engine.skipped, "weights withheld without a stop"
        if stop or checkpoint_due(step, cfg.checkpoint.save_steps, cfg.train.total_steps):
            # Every version before this step was evaluated already (the rollout ranks evaluate a
            # version as they take it, before they take the next): the checkpoint holds them all.
            log_evaluations(step - 1, wait=True)
            saved = save_checkpoint(trainer, {source: m["resume"] for source, m in zip(sources, messages)})
        if stop:
            if trainer.rank == 0:
                board.stop(step)  # the rollout ranks stop at their next wait
            trainer.logger.close()
            raise TrainingStopped(step, saved, stop)
    log_evaluations(cfg.train.total_steps, wait=True)
    trainer.export_final()
    return trainer.eval_history
