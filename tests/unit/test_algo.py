"""Hand-computed checks of the algorithm math (the arithmetic is written out)."""

import math

import torch

from vlrft.algo import aggregate
from vlrft.algo.advantages import grpo_advantages, rloo_advantages
from vlrft.algo.kl import kl_abs, kl_k1, kl_k2, kl_k3
from vlrft.algo.losses import LossSettings, policy_loss


def test_grpo_uses_explicit_groups_and_bessel_std():
    # group 7: rewards 1, 0, 0 -> mean 1/3, std = sqrt(((2/3)^2 + 2*(1/3)^2) / 2) = sqrt(1/3)
    # group 3: rewards 1, 1 -> all equal -> 0
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([7, 3, 7, 3, 7])  # interleaved: groups are ids, not positions
    adv = grpo_advantages(rewards, groups)
    std = math.sqrt(1 / 3)
    expected = torch.tensor([(2 / 3) / (std + 1e-6), 0.0, (-1 / 3) / (std + 1e-6), 0.0, (-1 / 3) / (std + 1e-6)])
    torch.testing.assert_close(adv, expected)


def test_grpo_without_std_scaling_is_dr_grpo():
    rewards = torch.tensor([2.0, 0.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1])
    torch.testing.assert_close(grpo_advantages(rewards, groups, scale_by_std=False), torch.tensor([1.0, -1.0, -2.0, 2.0]))


def test_ppo_clip_loss_by_hand():
    # ratios e^0.5=1.6487 (A=+1 -> clipped at 1.2), e^-0.5=0.6065 (A=-1 -> clipped at 0.8), 1 (A=2)
    logp = torch.tensor([0.5, -0.5, 0.0])
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, clipped = policy_loss("ppo", logp, old, adv, torch.ones(3), LossSettings(0.2, 0.2))
    # token 0: -min(1.6487*1, 1.2*1) = -1.2 ; token 1: -min(-0.6065, -0.8) = 0.8 ; token 2: -2
    torch.testing.assert_close(loss, torch.tensor([-1.2, 0.8, -2.0]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 1.0, 0.0]))


def test_ppo_clip_higher_uses_its_own_upper_bound():
    loss, _ = policy_loss("ppo", torch.tensor([0.5]), torch.zeros(1), torch.ones(1), torch.ones(1), LossSettings(0.2, 0.28))
    torch.testing.assert_close(loss, torch.tensor([-1.28]))


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-1.0, 0.0])  # d = [1, -1]
    torch.testing.assert_close(kl_k1(logp, ref), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(kl_abs(logp, ref), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(kl_k2(logp, ref), torch.tensor([0.5, 0.5]))
    # k3 = e^-d + d - 1: e^-1 + 0 = 0.3679 ; e^1 - 2 = 0.7183
    torch.testing.assert_close(kl_k3(logp, ref), torch.tensor([math.exp(-1), math.e - 2]))
    big = kl_k3(torch.tensor([-50.0]), torch.tensor([0.0]))  # clamped to <= 10, never inf
    assert big.item() == 10.0


def test_token_mean_and_seq_mean_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # token-mean: (1+2+3+4)/4 = 2.5 ; seq-mean-token-mean: (2 + 4)/2 = 3
    assert aggregate(loss, mask, "token-mean", 4, 2, 3).item() == 2.5
    assert aggregate(loss, mask, "seq-mean-token-mean", 4, 2, 3).item() == 3.0
    # seq-mean-token-sum: (6 + 4)/2 = 5 ; sum-norm: 10 / (2 * 3) = 1.6667
    assert aggregate(loss, mask, "seq-mean-token-sum", 4, 2, 3).item() == 5.0
    assert math.isclose(aggregate(loss, mask, "seq-mean-token-sum-norm", 4, 2, 3).item(), 10 / 6, rel_tol=1e-6)


def test_fully_masked_batch_gives_zero_not_nan():
    loss = torch.ones(2, 3)
    mask = torch.zeros(2, 3)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        value = aggregate(loss, mask, mode, 0, 0, 3)
        assert value.item() == 0.0, mode


def test_split_micro_batches_sum_to_whole_with_global_normaliser():
    torch.manual_seed(0)
    loss = torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).int()
    tokens, seqs = float(mask.sum()), 4.0
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        whole = aggregate(loss, mask, mode, tokens, seqs, 5)
        parts = sum(aggregate(loss[i : i + 1], mask[i : i + 1], mode, tokens, seqs, 5) for i in range(4))
        torch.testing.assert_close(parts, whole)


def test_rloo_leave_one_out_baseline():
    # group 0: rewards 1, 0, 0 -> A_0 = 1 - 0 = 1 ; A_1 = 0 - (1 + 0)/2 = -0.5 ; A_2 = -0.5
    # group 5: rewards 2, 4 -> A = 2 - 4 = -2 and 4 - 2 = 2
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0, 4.0])
    groups = torch.tensor([0, 0, 5, 0, 5])
    torch.testing.assert_close(rloo_advantages(rewards, groups), torch.tensor([1.0, -0.5, -2.0, -0.5, 2.0]))


def test_dual_clip_caps_negative_advantage_losses():
    # ratio e^1 = 2.718, A = -1: PPO loss = -min(-2.718, -1.2) = 2.718 ; dual clip c = 2 caps it at 2
    # A = +1 with the same ratio is untouched: -min(2.718, 1.2) = -1.2
    logp, old = torch.tensor([1.0, 1.0]), torch.zeros(2)
    adv = torch.tensor([-1.0, 1.0])
    plain, _ = policy_loss("ppo", logp, old, adv, torch.ones(2), LossSettings(0.2, 0.2))
    dual, hit = policy_loss("ppo", logp, old, adv, torch.ones(2), LossSettings(0.2, 0.2, dual_clip_c=2.0))
    torch.testing.assert_close(plain, torch.tensor([math.e, -1.2]))
    torch.testing.assert_close(dual, torch.tensor([2.0, -1.2]))
    torch.testing.assert_close(hit, torch.tensor([1.0, 1.0]))


def test_gspo_with_identical_token_deltas_equals_ppo_on_the_sequence():
    # every token has delta 0.1 -> sequence ratio e^0.1 = 1.105, same as each token's ratio
    logp = torch.tensor([[0.1, 0.1, 0.1]])
    old = torch.zeros(1, 3)
    adv = torch.full((1, 3), 2.0)
    mask = torch.ones(1, 3)
    gspo, _ = policy_loss("gspo", logp, old, adv, mask, LossSettings(0.2, 0.2))
    ppo, _ = policy_loss("ppo", logp, old, adv, mask, LossSettings(0.2, 0.2))
    torch.testing.assert_close(gspo, ppo)
    torch.testing.assert_close(gspo, torch.full((1, 3), -2.0 * math.exp(0.1)))


def test_gspo_value_and_gradient_follow_the_sequence_ratio():
    # deltas 0.2 and -0.1 (third token masked): s = exp(0.05) on each valid token;
    # d loss_t / d logp_t = -s * A (unclipped), and nothing flows through the sequence mean.
    logp = torch.tensor([[0.2, -0.1, 5.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    adv = torch.ones(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = policy_loss("gspo", logp, old, adv, mask, LossSettings(0.2, 0.2))
    s = math.exp(0.05)
    torch.testing.assert_close(loss[0, :2], torch.tensor([-s, -s]))
    (loss * mask).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-s, -s, 0.0]]))


def test_empty_sequence_gives_finite_gspo_loss():
    loss, _ = policy_loss("gspo", torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), torch.zeros(1, 3), LossSettings(0.2, 0.2))
    assert torch.isfinite(loss).all()
