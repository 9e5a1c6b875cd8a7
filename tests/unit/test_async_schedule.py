"""The schedule arithmetic of asynchronous training (trainer/async_roles.py), by hand."""

import pytest

from vlrft.trainer.async_roles import needed_version, sources_of, staleness, takes_while_waiting, trainer_of
from vlrft.trainer.weights_delivery import role_ranks


@pytest.mark.parametrize("step, max_staleness, version", [
    (1, 0, 0), (2, 0, 1), (5, 0, 4),  # synchronous: batch i waits for update i - 1
    (1, 1, 0), (2, 1, 0), (3, 1, 1), (5, 1, 3),  # one update behind
    (1, 2, 0), (3, 2, 0), (4, 2, 1),
])
def test_a_batch_waits_for_the_weights_its_staleness_bound_needs(step, max_staleness, version):
    assert needed_version(step, max_staleness) == version
    # Generated with exactly that version, batch `step` trains max_staleness updates later
    # (fewer at the start, where version 0 is the oldest there is).
    assert staleness(step, version) == min(max_staleness, step - 1)


def test_a_waiting_rollout_rank_takes_only_the_versions_broadcast_before_its_receipt():
    # Waiting for the receipt of batch 5: the trainers broadcast versions 1..4 before they
    # receive it (each rollout rank takes them there), version 5 only after.
    assert [takes_while_waiting(held, sent_step=5) for held in (0, 2, 3, 4, 5)] == [True, True, True, False, False]
    assert not takes_while_waiting(0, sent_step=1)  # batch 1 follows no update


def test_trainers_come_first_and_each_rollout_rank_feeds_one_trainer():
    assert role_ranks(1, 2) == ([1], [0])
    assert role_ranks(2, 5) == ([3, 4], [0, 1, 2])
    # 3 trainers, 2 rollout ranks: trainer 2 gets no batches (it trains a placeholder).
    assert [trainer_of(j, 3) for j in range(2)] == [0, 1]
    assert [sources_of(t, 2, 3) for t in range(3)] == [[3], [4], []]
    # 1 trainer, 3 rollout ranks: it gets all three batches, from global ranks 1, 2, 3.
    assert sources_of(0, 3, 1) == [1, 2, 3]
    # Every rollout rank has exactly one trainer.
    for rollouts, trainers in [(2, 3), (3, 1), (4, 2)]:
        fed = sorted(r for t in range(trainers) for r in sources_of(t, rollouts, trainers))
        assert fed == list(range(trainers, trainers + rollouts))


def test_the_schedule_model_by_hand():
    from bench.async_overlap import best_split, period_async, period_sync

    # G = 4 GPU-s to generate, T = 2 GPU-s to train, W = 0.5 s to send the weights.
    assert period_sync(4, 2, 0.5, gpus=2) == 2 + 1 + 0.5
    assert period_async(4, 2, 0.5, rollout_gpus=1, trainer_gpus=1) == 4  # generation sets the pace
    assert period_async(4, 2, 0.5, rollout_gpus=4, trainer_gpus=4) == 1.0  # 4/4 = 2/4 + 0.5: balanced
    assert period_async(4, 2, 0.5, rollout_gpus=4, trainer_gpus=4, max_staleness=0) == 2.0  # the roles take turns
    # 2 GPUs: either split leaves one role waiting; async is slower than sync (3.5 / 4).
    assert best_split(4, 2, 0.5, gpus=2) == (1, 3.5 / 4)
    # 8 GPUs: sync 0.5 + 0.25 + 0.5 = 1.25 s; 4 + 4 balances at 1.0 s.
    assert best_split(4, 2, 0.5, gpus=8) == (4, 1.25)
