"""Hand-computed checks of the estimator, critic, KL-controller, shaping and overlong math.

The arithmetic is written next to every expected value (docs/algorithms.md describes the options).
"""

import math

import pytest
import torch
from torch.testing import assert_close

from reward_recipes.overlong import overlong_penalty, soft_overlong_penalty
from vlrft.algo.advantages import (
    discounted_returns,
    gae_advantages,
    masked_whiten,
    reinforce_pp_baseline_advantages,
    token_rewards,
)
from vlrft.algo.estimate import AdvantageOptions, estimate_advantages
from vlrft.algo.kl import AdaptiveKLController, FixedKLController, full_kl
from vlrft.algo.shaping import approx_kl, best_of_n, groups_with_spread, should_stop_early
from vlrft.algo.value import ReturnStats, value_loss

T = torch.tensor


# ----------------------------------------------------------------------------- advantages.py


def test_reinforce_pp_baseline_subtracts_group_mean_only():
    # group 5: 1, 0, 0 -> mean 1/3 ; group 9: 2, 4 -> mean 3 ; group 2: 7, 7 -> all equal -> 0
    rewards = T([1.0, 2.0, 0.0, 7.0, 4.0, 0.0, 7.0])
    groups = T([5, 9, 5, 2, 9, 5, 2])
    expected = T([1 - 1 / 3, 2 - 3.0, 0 - 1 / 3, 0.0, 4 - 3.0, 0 - 1 / 3, 0.0])
    assert_close(reinforce_pp_baseline_advantages(rewards, groups), expected)


def test_token_rewards_on_last_valid_token_and_empty_response():
    scores = T([1.0, 2.0, 3.0])
    mask = T([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    # row 0: length 2 -> position 1 ; row 1: empty -> nothing ; row 2: length 3 -> position 2
    expected = T([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    assert_close(token_rewards(scores, mask), expected)


def test_discounted_returns_by_hand_with_padding_and_empty_row():
    rewards = T([[1.0, 0.0, 2.0, 9.0], [5.0, 1.0, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # gamma 0.5, row 0: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5; the padded 9 is ignored
    # row 1 is fully masked -> all zeros
    expected = T([[1.5, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    out = discounted_returns(rewards, mask, gamma=0.5)
    assert_close(out, expected)
    assert not out.isnan().any()


def test_gae_by_hand_with_padding_and_empty_row():
    rewards = T([[0.0, 0.0, 1.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    values = T([[0.5, 0.2, 0.4, 7.0], [2.0, 2.0, 2.0, 2.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    gamma, lam = 0.9, 0.8
    # t=2: delta = 1 + 0.9*0 - 0.4 = 0.6 (V after the last token = 0), A2 = 0.6
    # t=1: delta = 0 + 0.9*0.4 - 0.2 = 0.16, A1 = 0.16 + 0.72*0.6 = 0.592
    # t=0: delta = 0 + 0.9*0.2 - 0.5 = -0.32, A0 = -0.32 + 0.72*0.592 = 0.10624
    a2 = 1 - 0.4
    a1 = 0.9 * 0.4 - 0.2 + gamma * lam * a2
    a0 = 0.9 * 0.2 - 0.5 + gamma * lam * a1
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    assert_close(adv, T([[a0, a1, a2, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    # R = A + V on valid tokens, 0 elsewhere
    assert_close(ret, T([[a0 + 0.5, a1 + 0.2, a2 + 0.4, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert not adv.isnan().any() and not ret.isnan().any()


def test_gae_skips_a_masked_position_in_the_middle():
    rewards = T([[0.0, 9.0, 1.0]])
    values = T([[0.5, 3.0, 0.4]])
    mask = T([[1.0, 0.0, 1.0]])
    # gamma = lam = 1: t=2: A2 = 1 - 0.4 = 0.6 ; t=1 skipped (its 9 and 3 never enter)
    # t=0: delta = 0 + 0.4 - 0.5 = -0.1, A0 = -0.1 + 0.6 = 0.5
    adv, ret = gae_advantages(rewards, values, mask, 1.0, 1.0)
    assert_close(adv, T([[0.5, 0.0, 0.6]]))
    assert_close(ret, T([[0.5 + 0.5, 0.0, 0.6 + 0.4]]))


def test_masked_whiten_by_hand():
    x = T([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # valid 1, 2, 3, 4: mean 2.5, Bessel var = (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3
    expected = (x - 2.5) / math.sqrt(5 / 3 + 1e-8) * mask
    assert_close(masked_whiten(x, mask), expected)


def test_masked_whiten_count_below_two_has_no_nan():
    # one valid value: no spread -> returned as is (masked); none valid -> zeros
    assert_close(masked_whiten(T([[3.0, 5.0]]), T([[1.0, 0.0]])), T([[3.0, 0.0]]))
    out = masked_whiten(T([[3.0, 5.0]]), T([[0.0, 0.0]]))
    assert_close(out, T([[0.0, 0.0]]))
    assert not out.isnan().any()


def test_masked_whiten_two_fake_ranks_equal_whitening_the_concatenation():
    x0, m0 = T([[1.0, 2.0], [3.0, 0.0]]), T([[1.0, 1.0], [1.0, 0.0]])
    x1, m1 = T([[4.0, 5.0, 6.0]]), T([[1.0, 1.0, 0.0]])
    # Two reductions per whitening: (count, sum), then the squared deviations from the global
    # mean. Global valid values 1..5: mean 3, Bessel var = (4 + 1 + 0 + 1 + 4) / 4 = 2.5.
    # Rank 0 holds 1, 2, 3 (count 3, sum 6, deviations 4 + 1 + 0); rank 1 holds 4, 5 (2, 9, 1 + 4).
    def peer(*contributions):
        sent = iter(contributions)  # what the other rank adds to each reduction, in order
        return lambda t: t + T(next(sent))

    out0 = masked_whiten(x0, m0, reduce_sum=peer([2.0, 9.0], [5.0]))
    out1 = masked_whiten(x1, m1, reduce_sum=peer([3.0, 6.0], [5.0]))
    assert_close(out0, (x0 - 3) / math.sqrt(2.5 + 1e-8) * m0)
    assert_close(out1, (x1 - 3) / math.sqrt(2.5 + 1e-8) * m1)
    # and the same as whitening both ranks' valid values in one batch
    whole = masked_whiten(T([[1.0, 2.0, 3.0, 4.0, 5.0]]), torch.ones(1, 5))
    assert_close(torch.cat([out0[0], out0[1, :1], out1[0, :2]]), whole[0])


# ----------------------------------------------------------------------------- estimate.py


def _run(name, scores, groups, mask, terms=None, **kw):
    terms = torch.zeros_like(mask) if terms is None else terms
    values = kw.pop("values", None)
    return estimate_advantages(AdvantageOptions(name=name, **kw), scores, groups, mask, terms, values)


def test_estimate_grpo_broadcasts_and_keeps_padding_zero():
    scores, groups = T([1.0, 0.0, 2.0, 2.0]), T([0, 0, 1, 1])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    # group 0: mean 0.5, std = sqrt((0.25 + 0.25) / 1) ; group 1 all equal -> 0
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    adv, ret = _run("grpo", scores, groups, mask)
    assert_close(adv, T([[a, a, 0.0], [-a, -a, -a], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert ret is None
    dr, _ = _run("grpo", scores, groups, mask, scale_by_std=False)  # Dr.GRPO: r - mean
    assert_close(dr, T([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_estimate_rloo_leave_one_out():
    scores, groups, mask = T([1.0, 0.0, 0.0]), T([3, 3, 3]), torch.ones(3, 2)
    # A0 = 1 - (0 + 0)/2 = 1 ; A1 = A2 = 0 - (1 + 0)/2 = -0.5
    adv, _ = _run("rloo", scores, groups, mask)
    assert_close(adv, T([[1.0, 1.0], [-0.5, -0.5], [-0.5, -0.5]]))


def test_estimate_reinforce_pp_baseline_then_batch_whitening():
    scores, groups, mask = T([1.0, 0.0, 3.0, 1.0]), T([0, 0, 1, 1]), torch.ones(4, 2)
    # r - mean_g = 0.5, -0.5, 1, -1 ; tokens: mean 0, Bessel var = (4*0.25 + 4*1) / 7 = 5/7
    base = T([[0.5, 0.5], [-0.5, -0.5], [1.0, 1.0], [-1.0, -1.0]])
    adv, _ = _run("reinforce_pp_baseline", scores, groups, mask)
    assert_close(adv, base / math.sqrt(5 / 7 + 1e-8))


def test_estimate_reinforce_pp_adds_token_terms_per_token_then_whitens():
    scores, groups = T([1.0, 0.0]), T([0, 1])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    terms = T([[-0.1, 0.0, -0.2], [0.0, -0.3, 5.0]])  # the 5 sits on padding: dropped
    # token rewards row 0: -0.1, 0, 1 - 0.2 = 0.8 -> G (gamma 1) = 0.7, 0.8, 0.8
    # token rewards row 1: 0, -0.3 + 0 -> G = -0.3, -0.3
    returns = T([[0.7, 0.8, 0.8], [-0.3, -0.3, 0.0]])
    valid = T([0.7, 0.8, 0.8, -0.3, -0.3])
    expected = (returns - valid.mean()) / torch.sqrt(valid.var() + 1e-8) * mask  # var: Bessel
    adv, ret = _run("reinforce_pp", scores, groups, mask, terms, gamma=1.0)
    assert_close(adv, expected)
    assert ret is None


def test_estimate_sequence_estimators_sum_token_terms_into_the_score():
    scores, groups = T([0.0, 0.0]), T([0, 0])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    terms = T([[1.0, 2.0, 7.0], [0.0, 0.0, 0.0]])  # 7 on padding is dropped: sequence = 3, 0
    # Dr.GRPO: 3 - 1.5 = 1.5 ; 0 - 1.5 = -1.5
    adv, _ = _run("grpo", scores, groups, mask, terms, scale_by_std=False)
    assert_close(adv, T([[1.5, 1.5, 0.0], [-1.5, -1.5, -1.5]]))


def test_estimate_gae_with_and_without_whitening():
    scores, groups, mask = T([1.0]), T([0]), T([[1.0, 1.0, 1.0, 0.0]])
    values = T([[0.5, 0.2, 0.4, 7.0]])
    # same numbers as test_gae_by_hand: A = 0.10624, 0.592, 0.6 ; R = A + V
    a = T([[0.10624, 0.592, 0.6, 0.0]])
    r = T([[0.10624 + 0.5, 0.592 + 0.2, 0.6 + 0.4, 0.0]])
    adv, ret = _run("gae", scores, groups, mask, values=values, gamma=0.9, lam=0.8, whiten_gae=False)
    assert_close(adv, a)
    assert_close(ret, r)
    adv_w, ret_w = _run("gae", scores, groups, mask, values=values, gamma=0.9, lam=0.8)
    valid = a[0, :3]
    assert_close(adv_w, (a - valid.mean()) / torch.sqrt(valid.var() + 1e-8) * mask)
    assert_close(ret_w, r)  # returns are never whitened


def test_estimate_gae_adds_token_terms_per_token():
    scores, groups, mask = T([1.0]), T([0]), T([[1.0, 1.0]])
    terms = T([[0.5, -0.25]])
    # rewards 0.5, 1 - 0.25 = 0.75 ; V = 0, gamma = lam = 1 -> A = returns-to-go = 1.25, 0.75
    adv, ret = _run("gae", scores, groups, mask, terms, values=torch.zeros(1, 2), gamma=1.0, lam=1.0, whiten_gae=False)
    assert_close(adv, T([[1.25, 0.75]]))
    assert_close(ret, T([[1.25, 0.75]]))


def test_estimate_gae_needs_values():
    with pytest.raises(ValueError):
        _run("gae", T([1.0]), T([0]), torch.ones(1, 2))


def test_estimate_advantage_clip():
    scores, groups, mask = T([3.0, -1.0]), T([0, 0]), T([[1.0, 1.0], [1.0, 0.0]])
    # Dr.GRPO: 3 - 1 = 2, -1 - 1 = -2 -> clamped to +-1.5 ; padding stays 0
    adv, _ = _run("grpo", scores, groups, mask, scale_by_std=False, clip=1.5)
    assert_close(adv, T([[1.5, 1.5], [-1.5, 0.0]]))


# ----------------------------------------------------------------------------- value.py


def test_value_loss_clipped_and_unclipped():
    values, old, returns = T([1.0, 0.5, 2.0]), T([0.5, 0.5, 1.0]), T([0.0, 1.0, 1.9])
    # 0: plain (1-0)^2 = 1, clipped V = 0.5+0.2 = 0.7 -> 0.49 ; max 1    -> 0.5
    # 1: plain (0.5-1)^2 = 0.25, V unchanged -> 0.25                     -> 0.125
    # 2: plain (2-1.9)^2 = 0.01, clipped V = 1.2 -> (1.2-1.9)^2 = 0.49     -> 0.245
    assert_close(value_loss(values, old, returns, clip=0.2), T([0.5 * 1, 0.5 * 0.25, 0.5 * 0.49]))
    # clip 0: 0.5 * (V - R)^2
    assert_close(value_loss(values, old, returns, clip=0.0), T([0.5 * 1, 0.5 * 0.25, 0.5 * 0.01]))


def test_return_stats_exp_first_update_is_batch_stats_then_debiased():
    stats = ReturnStats("exp", beta=0.5)
    x, mask = T([[1.0, 2.0, 3.0], [5.0, 100.0, 100.0]]), T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    stats.update(x, mask)
    # valid 1, 2, 3, 5: mean 2.75, E[x^2] = 39/4, population var = 9.75 - 2.75^2 = 2.1875
    assert stats.mean == pytest.approx(2.75)
    assert stats.std == pytest.approx(math.sqrt(2.1875))
    stats.update(T([[4.0]]), T([[1.0]]))
    # debiased: mean = (0.5*2.75 + 4) / (0.5 + 1), E[x^2] = (0.5*9.75 + 16) / 1.5
    mean = (0.5 * 2.75 + 4) / 1.5
    assert stats.mean == pytest.approx(mean)
    assert stats.std == pytest.approx(math.sqrt((0.5 * 9.75 + 16) / 1.5 - mean**2))


def test_return_stats_exp_default_beta_first_update():
    stats = ReturnStats("exp")
    stats.update(T([1.0, 3.0]), T([1.0, 1.0]))  # mean 2, population std 1 despite beta = 0.99995
    assert stats.mean == pytest.approx(2.0)
    assert stats.std == pytest.approx(1.0, rel=1e-4)


def test_return_stats_ma_cumulative_and_masked_entries_ignored():
    stats = ReturnStats("ma")
    assert (stats.mean, stats.std) == (0.0, 1.0)  # before any data: identity normalisation
    stats.update(T([1.0, 2.0, 3.0, -50.0]), T([1.0, 1.0, 1.0, 0.0]))
    stats.update(T([5.0, 7.0, 99.0]), T([1.0, 1.0, 0.0]))
    stats.update(T([8.0]), T([0.0]))  # fully masked: no change
    # all valid values 1, 2, 3, 5, 7: mean 18/5 = 3.6, var = 88/5 - 3.6^2 = 4.64
    assert stats.mean == pytest.approx(3.6)
    assert stats.std == pytest.approx(math.sqrt(88 / 5 - 3.6**2))


def test_return_stats_normalize_roundtrip_state_dict_and_std_floor():
    stats = ReturnStats("ma")
    stats.update(T([1.0, 2.0, 3.0]), T([1.0, 1.0, 1.0]))  # mean 2, std sqrt(2/3)
    s = math.sqrt(2 / 3)
    assert_close(stats.normalize(T([2.0, 2.0 + s, 2.0 - 2 * s])), T([0.0, 1.0, -2.0]))
    x = T([-3.0, 0.5, 10.0])
    assert_close(stats.denormalize(stats.normalize(x)), x)
    restored = ReturnStats("ma")
    restored.load_state_dict(stats.state_dict())
    assert (restored.mean, restored.std) == (stats.mean, stats.std)
    stats.update(T([9.0]), T([1.0]))
    restored.update(T([9.0]), T([1.0]))
    assert (restored.mean, restored.std) == (stats.mean, stats.std)
    flat = ReturnStats("exp")
    flat.update(T([4.0, 4.0]), T([1.0, 1.0]))  # no spread: std floored at eps = 1e-5
    assert flat.std == pytest.approx(1e-5)
    with pytest.raises(ValueError):
        ReturnStats("none")


# ----------------------------------------------------------------------------- kl.py


def test_full_kl_by_hand():
    p0, r0 = T([0.5, 0.25, 0.25]), T([1 / 3, 1 / 3, 1 / 3])
    p1, r1 = T([0.2, 0.3, 0.5]), T([0.5, 0.25, 0.25])
    logits = torch.stack([p0.log(), p1.log() + 7.0]).unsqueeze(0)  # [1, 2, 3]; a shift changes nothing
    ref = torch.stack([r0.log() - 2.0, r1.log()]).unsqueeze(0)
    # token 0: 0.5 ln(0.5/(1/3)) + 2 * 0.25 ln(0.25/(1/3)) ; token 1: 0.2 ln(0.4) + 0.3 ln(1.2) + 0.5 ln 2
    kl0 = 0.5 * math.log(1.5) + 0.5 * math.log(0.75)
    kl1 = 0.2 * math.log(0.4) + 0.3 * math.log(1.2) + 0.5 * math.log(2)
    expected = T([[kl0, kl1]])
    assert_close(full_kl(logits, ref), expected)


def test_full_kl_identical_zero_chunked_equal_and_nonnegative():
    g = torch.Generator().manual_seed(0)
    logits, ref = torch.randn(2, 3, 5, generator=g) * 3, torch.randn(2, 3, 5, generator=g) * 3
    assert_close(full_kl(logits, logits), torch.zeros(2, 3))
    whole = full_kl(logits, ref)
    assert whole.shape == (2, 3)
    assert_close(full_kl(logits, ref, chunk_size=1), whole)
    assert_close(full_kl(logits, ref, chunk_size=4), whole)  # a ragged last chunk
    assert (whole >= 0).all() and (whole > 0).any()


def test_fixed_kl_controller_never_moves():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.coef == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.coef == 0.05


def test_adaptive_kl_controller_by_hand():
    above = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    above.update(current_kl=12.0, n_steps=100)  # 12/6 - 1 = 1 -> clipped 0.2
    assert above.coef == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))  # 0.1002
    below = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    below.update(current_kl=3.0, n_steps=100)  # 3/6 - 1 = -0.5 -> clipped -0.2
    assert below.coef == pytest.approx(0.1 * (1 - 0.2 * 100 / 10000))  # 0.0998
    inside = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    inside.update(current_kl=6.6, n_steps=100)  # 6.6/6 - 1 = 0.1, not clipped
    assert inside.coef == pytest.approx(0.1 * (1 + 0.1 * 100 / 10000))  # 0.1001
    restored = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    restored.load_state_dict(above.state_dict())
    assert restored.coef == above.coef


# ----------------------------------------------------------------------------- shaping.py


def test_groups_with_spread():
    rewards = T([1.0, 2.0, 1.0, 0.0, 2.0, 3.0])
    groups = T([4, 8, 4, 4, 8, 9])
    # group 4: 1, 1, 0 -> spread ; group 8: 2, 2 -> all equal ; group 9: one response -> no spread
    assert groups_with_spread(rewards, groups).tolist() == [True, False, True, True, False, False]
    assert groups_with_spread(T([]), T([], dtype=torch.long)).tolist() == []


def test_best_of_n_ties_keep_earliest_and_input_order():
    groups = T([1, 0, 1, 0, 1, 0])
    rewards = T([2.0, 5.0, 2.0, 7.0, 3.0, 5.0])
    # group 1 (0, 2, 4): best 4 (3), then the tie 0 vs 2 (both 2) -> 0
    # group 0 (1, 3, 5): best 3 (7), then the tie 1 vs 5 (both 5) -> 1
    assert best_of_n(rewards, groups, keep=2).tolist() == [0, 1, 3, 4]
    assert best_of_n(rewards, groups, keep=1).tolist() == [3, 4]
    assert best_of_n(rewards, groups, keep=5).tolist() == [0, 1, 2, 3, 4, 5]
    assert best_of_n(T([]), T([], dtype=torch.long), keep=1).tolist() == []


def test_approx_kl():
    # d = 0, -1, 2 -> 0.5 * d^2 = 0, 0.5, 2
    assert_close(approx_kl(T([0.0, -1.0, 1.5]), T([0.0, 0.0, -0.5])), T([0.0, 0.5, 2.0]))


def test_should_stop_early_thresholds():
    assert should_stop_early(1.3, 0.0, early_stop_ratio=1.2, target_kl=0.0)
    assert not should_stop_early(1.2, 0.0, early_stop_ratio=1.2, target_kl=0.0)  # strict >
    assert should_stop_early(1.0, 0.06, early_stop_ratio=0.0, target_kl=0.05)
    assert not should_stop_early(1.0, 0.04, early_stop_ratio=0.0, target_kl=0.05)
    assert not should_stop_early(100.0, 100.0, early_stop_ratio=0.0, target_kl=0.0)  # 0 disables both
    assert should_stop_early(1.0, 0.06, early_stop_ratio=1.2, target_kl=0.05)  # either one suffices


# ----------------------------------------------------------------------------- overlong recipe


def test_overlong_penalty_boundaries():
    # Lmax = 20, Lcache = 4 -> soft start 16
    assert overlong_penalty(10, 20, 4) == 0.0
    assert overlong_penalty(16, 20, 4) == 0.0  # L = Lmax - Lcache
    assert overlong_penalty(17, 20, 4) == pytest.approx((16 - 17) / 4)  # -0.25
    assert overlong_penalty(18, 20, 4) == pytest.approx((16 - 18) / 4)  # -0.5
    assert overlong_penalty(20, 20, 4) == pytest.approx(-1.0)  # (16 - 20) / 4
    assert overlong_penalty(25, 20, 4) == -1.0


def test_soft_overlong_penalty_recipe():
    samples = [{"response_length": n} for n in (3, 16, 18, 20, 30)]
    out = soft_overlong_penalty(["c"] * 5, samples, max_tokens=20, cache_tokens=4)
    assert out == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    # cache = max is allowed: soft start 0, L = 10 -> (0 - 10) / 20
    assert soft_overlong_penalty(["c"], [{"response_length": 10}], 20, 20) == pytest.approx([-0.5])
    for bad in (0, -1, 21):
        with pytest.raises(ValueError):
            soft_overlong_penalty(["c"], [{"response_length": 1}], max_tokens=20, cache_tokens=bad)
