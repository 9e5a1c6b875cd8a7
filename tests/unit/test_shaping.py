import torch

from vlrft.algo.shaping import ZeroRewardWatch, transform_rewards, zero_truncated


def test_reward_transform_by_hand():
    r = torch.tensor([0.0, 1.0, 5.0])
    # (r - 1) * 2 = [-2, 0, 8], clipped to +-3 -> [-2, 0, 3]
    torch.testing.assert_close(transform_rewards(r, 1.0, 2.0, 3.0), torch.tensor([-2.0, 0.0, 3.0]))
    torch.testing.assert_close(transform_rewards(r, 1.0, 2.0, 0.0), torch.tensor([-2.0, 0.0, 8.0]))  # 0 = no clip


def test_truncated_responses_get_zero_reward():
    r = torch.tensor([1.0, 0.5, 2.0])
    torch.testing.assert_close(zero_truncated(r, torch.tensor([False, True, True])), torch.tensor([1.0, 0.0, 0.0]))


def test_zero_reward_watch_counts_consecutive_steps():
    watch = ZeroRewardWatch(patience=2)
    assert [watch.update(z) for z in (True, False, True, True)] == [False, False, False, True]
    never = ZeroRewardWatch(patience=0)
    assert not any(never.update(True) for _ in range(5))


def test_zero_reward_watch_warns_once_per_streak_at_three_steps():
    watch = ZeroRewardWatch(patience=0)
    warned = []
    for all_zero in (True, True, True, True, False, True, True, True):
        watch.update(all_zero)
        warned.append(watch.warn_now())
    assert warned == [False, False, True, False, False, False, False, True]
    soon = ZeroRewardWatch(patience=2)  # stops at 2: no warning first
    assert not any((soon.update(True), soon.warn_now())[1] for _ in range(3))
    late = ZeroRewardWatch(patience=5)  # warns at 3, stops at 5
    assert [(late.update(True), late.warn_now()) for _ in range(5)][2:] == [(False, True), (False, False), (True, False)]
