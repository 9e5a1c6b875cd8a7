"""Exactness fixes found by a float64 re-implementation of the formulas (each case failed on the
code before its fix): all-equal GRPO groups, GSPO past its clamp, whitening of large values,
entropy of confident tokens, truncated responses in whitening statistics."""

from __future__ import annotations

import torch

from vlrft.algo import aggregate
from vlrft.algo.advantages import grpo_advantages, masked_whiten, rloo_advantages
from vlrft.algo.entropy import token_entropy
from vlrft.algo.estimate import AdvantageOptions, estimate_advantages
from vlrft.algo.losses import LossSettings, policy_loss
from vlrft.models.chunked import chunked_token_stats


def test_grpo_all_equal_group_gives_exactly_zero():
    # float32 mean of 8 x 0.1 is one rounding step off; divided by (std + 1e-6) that was -0.0074.
    for value, size in ((0.1, 8), (1.1, 16), (0.7, 3), (1.1, 5)):
        rewards = torch.full((size,), value)
        assert torch.equal(grpo_advantages(rewards, torch.zeros(size, dtype=torch.long)), torch.zeros(size))
        assert torch.equal(grpo_advantages(rewards, torch.zeros(size, dtype=torch.long), scale_by_std=False), torch.zeros(size))
        assert torch.equal(rloo_advantages(rewards, torch.zeros(size, dtype=torch.long)), torch.zeros(size))


def test_grpo_group_whose_spread_is_rounding_noise_gives_zero():
    # "exact match 1.0 + format 0.1" summed in two orders: equal rewards one ulp apart.
    a = torch.tensor(1.0) + torch.tensor(0.1)
    b = torch.tensor(0.1) + torch.tensor(1.0) + torch.tensor(1e-7)
    rewards = torch.stack([a, b, a, b])
    assert not torch.equal(a, b)
    groups = torch.tensor([0, 0, 0, 0])
    assert torch.equal(grpo_advantages(rewards, groups), torch.zeros(4))
    # A real spread in another group is untouched: (1 - 0.5) / std, std = sqrt(1/3) by hand.
    mixed = grpo_advantages(torch.cat([rewards, torch.tensor([1.0, 0.0, 1.0, 0.0])]), torch.tensor([0] * 4 + [1] * 4))
    expected = 0.5 / (torch.tensor(1 / 3).sqrt() + 1e-6)
    torch.testing.assert_close(mixed[4:], torch.stack([expected, -expected, expected, -expected]))


def test_gspo_gradient_is_zero_past_the_clamp_like_the_sequence_objective():
    old = torch.tensor([[-1.0, -2.0]])
    logp = (old + 25).requires_grad_(True)  # sequence log-ratio 25: clamped to 20
    mask = torch.ones(1, 2)
    loss, _ = policy_loss("gspo", logp, old, torch.full((1, 2), -1.0), mask, LossSettings(0.2, 0.28))
    aggregate(loss, mask, "seq-mean-token-mean", 2.0, 1.0, 2).backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))  # was 2.4e8 per token
    # PPO with the same numbers also gives 0 (its clamp stops the gradient).
    ppo_logp = (old + 25).requires_grad_(True)
    ppo, _ = policy_loss("ppo", ppo_logp, old, torch.full((1, 2), -1.0), mask, LossSettings(0.2, 0.28))
    aggregate(ppo, mask, "seq-mean-token-mean", 2.0, 1.0, 2).backward()
    assert torch.equal(ppo_logp.grad, torch.zeros(1, 2))
    # Inside the clamp the token form still carries the sequence gradient: s * A / L per token.
    inside = (old + 0.1).requires_grad_(True)
    loss, _ = policy_loss("gspo", inside, old, torch.full((1, 2), 1.0), mask, LossSettings(0.2, 0.28))
    aggregate(loss, mask, "seq-mean-token-mean", 2.0, 1.0, 2).backward()
    s = torch.exp(torch.tensor(0.1))
    torch.testing.assert_close(inside.grad, torch.full((1, 2), -float(s) / 2))


def test_whitening_is_exact_for_large_means():
    g = torch.Generator().manual_seed(0)
    x = 1000 + 1.5 * torch.randn(64, 32, generator=g)
    mask = (torch.rand(64, 32, generator=g) > 0.2).float()
    exact = x.double()[mask.bool()]
    reference = (x.double() - exact.mean()) / torch.sqrt(exact.var() + 1e-8)  # Bessel, as documented
    error = ((masked_whiten(x, mask).double() - reference) * mask).abs().max()
    assert error < 1e-4  # the one-pass variance was off by 0.14


def test_entropy_of_confident_tokens_is_exact():
    # A near-certain token: the entropy is tiny and lse - sum(p z) cancelled in fp32.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 4096, generator=g)
    logits[:, 7] += 18.0
    exact = torch.distributions.Categorical(logits=logits.double()).entropy()
    relative = ((token_entropy(logits).double() - exact).abs() / exact).max()
    assert relative < 1e-5
    head = torch.nn.Linear(4096, 4096, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(4096))
    _, chunked, _ = chunked_token_stats(logits, torch.zeros(16, dtype=torch.long), head, 1.0)
    assert ((chunked.double() - exact).abs() / exact).max() < 1e-5


def test_truncated_responses_leave_whitening_statistics_when_masked():
    # reinforce_pp_baseline whitens over the batch; a truncated response with an extreme reward
    # must not shift the statistics the other responses are whitened with.
    opts = AdvantageOptions(name="reinforce_pp_baseline")
    scores = torch.tensor([1.0, 0.0, 0.5, 100.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 3)
    keep = torch.tensor([1.0, 1.0, 1.0, 0.0])[:, None]  # the last one is truncated and masked
    masked, _ = estimate_advantages(opts, scores, groups, mask * keep, torch.zeros(4, 3))
    assert torch.equal(masked[3], torch.zeros(3))
    # By hand: baselines 0.5 (group 0) and 50.25 (group 1) -> 0.5, -0.5, -49.75 on 3 tokens each,
    # whitened with the mean and Bessel std of those 9 values.
    values = torch.tensor([0.5, -0.5, -49.75]).repeat_interleave(3)
    expected = (values - values.mean()) / torch.sqrt(values.var() + 1e-8)
    torch.testing.assert_close(masked[:3].flatten(), expected)


def test_maker_masks_truncated_responses_before_whitening(tiny_text, addition_data, tmp_path, world_of_one):
    from tests.unit.test_logprob_consistency import build_trainer
    from vlrft.algo.advantages import group_mean_std

    trainer = build_trainer(tiny_text, addition_data, tmp_path, [
        "algo.advantage=reinforce_pp_baseline", "algo.mask_truncated=true"])
    torch.manual_seed(3)
    prompts = [trainer.encoder.encode(trainer.train_rows[row], pos) for pos, row in trainer.sampler.next_indices()]
    scored = trainer.maker.generate_and_score(prompts)
    for i, e in enumerate(scored):  # rewards that differ, so whitening has something to scale
        e.reward = float(i % 5) * (10.0 if i % 3 == 0 else 1.0)
        e.rollout.truncated = i % 3 == 0  # finish() reads the flag: a third are truncated
    experiences, _ = trainer.maker.finish(scored)
    kept = [e for e in experiences if not e.rollout.truncated]
    truncated = [e for e in experiences if e.rollout.truncated]
    assert kept and truncated
    assert all(not e.in_loss and torch.equal(e.advantages, torch.zeros_like(e.advantages)) for e in truncated)
    # By hand over the kept responses only: r - group mean (over the whole group, as scored),
    # then whitening with the kept tokens' mean and Bessel std.
    rewards = torch.tensor([e.reward for e in experiences])
    mean, _ = group_mean_std(rewards, torch.tensor([e.rollout.group_id for e in experiences]))
    baseline = {id(e): float(r - m) for e, r, m in zip(experiences, rewards, mean)}
    tokens = torch.cat([torch.full((len(e.rollout.response_ids),), baseline[id(e)]) for e in kept])
    mu, sd = tokens.mean(), torch.sqrt(tokens.var() + 1e-8)
    for e in kept:
        torch.testing.assert_close(e.advantages, (torch.full_like(e.advantages, baseline[id(e)]) - mu) / sd)


def test_an_empty_response_counts_as_a_sequence_in_seq_mean_modes():
    # The rule (docs/algorithms.md, "Loss aggregation"): a zero-token response that is in the
    # loss counts in the sequence normaliser and contributes 0. It is one of the sampled
    # sequences, so seq-mean stays the mean over what the policy sampled, and Dr.GRPO's
    # normaliser (sequences x max_new_tokens) stays independent of the responses' lengths.
    from vlrft.algo import normaliser_counts

    loss, mask = torch.tensor([[2.0, 4.0], [5.0, 5.0]]), torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    tokens, sequences = normaliser_counts(mask).tolist()
    assert (tokens, sequences) == (2.0, 2.0)
    assert float(aggregate(loss, mask, "seq-mean-token-mean", tokens, sequences, 2)) == (2 + 4) / 2 / 2
    assert float(aggregate(loss, mask, "seq-mean-token-sum", tokens, sequences, 2)) == (2 + 4) / 2
    assert float(aggregate(loss, mask, "seq-mean-token-sum-norm", tokens, sequences, 2)) == (2 + 4) / (2 * 2)
    assert float(aggregate(loss, mask, "token-mean", tokens, sequences, 2)) == (2 + 4) / 2


# ------------------------------------------------------------------ cispo, sapo, gmpo by hand


def loss_and_grad(name, logp_values, old_values, advantages, settings, mode="token-mean"):
    """(per-token loss, d aggregated loss / d logp) of one [1, L] sequence."""
    logp = torch.tensor([logp_values], requires_grad=True)
    old, adv, mask = torch.tensor([old_values]), torch.tensor([advantages]), torch.ones(1, len(logp_values))
    loss, hit = policy_loss(name, logp, old, adv, mask, settings)
    aggregate(loss, mask, mode, float(mask.sum()), 1.0, len(logp_values)).backward()
    return loss.detach()[0], logp.grad[0], hit[0]


def test_cispo_value_and_gradient_by_hand():
    import math

    # ratios e^0.5 = 1.649 (clipped to 1.28), e^-0.1 = 0.905 (inside), e^-1 = 0.368 (clipped to 0.8)
    logp, old, adv = [-0.5, -1.1, -2.0], [-1.0, -1.0, -1.0], [2.0, -1.0, 1.0]
    loss, grad, hit = loss_and_grad("cispo", logp, old, adv, LossSettings(0.2, 0.28))
    weights = [1.28, math.exp(-0.1), 0.8]
    torch.testing.assert_close(loss, torch.tensor([-w * a * lp for w, a, lp in zip(weights, adv, logp)]))
    # token-mean over 3 tokens: d/dlogp = -w A / 3, the weight detached (no ratio term)
    torch.testing.assert_close(grad, torch.tensor([-w * a / 3 for w, a in zip(weights, adv)]))
    assert hit.tolist() == [1.0, 0.0, 1.0]  # clipped tokens still carry gradient (unlike PPO)


def test_sapo_value_and_gradient_by_hand():
    import math

    logp, old, adv = [0.3, -0.2], [0.0, 0.0], [1.5, -2.0]
    loss, grad, hit = loss_and_grad("sapo", logp, old, adv, LossSettings(sapo_tau_pos=1.0, sapo_tau_neg=2.0))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    r1, r2 = math.exp(0.3), math.exp(-0.2)
    expected = [-(4 / 1.0) * sig(1.0 * (r1 - 1)) * 1.5, -(4 / 2.0) * sig(2.0 * (r2 - 1)) * -2.0]
    torch.testing.assert_close(loss, torch.tensor(expected))
    # d/dlogp of -(4/tau) sig(tau (r - 1)) A = -4 sig (1 - sig) r A; token-mean over 2 tokens
    dgate = [4 * sig(1.0 * (r1 - 1)) * (1 - sig(1.0 * (r1 - 1))) * r1, 4 * sig(2.0 * (r2 - 1)) * (1 - sig(2.0 * (r2 - 1))) * r2]
    torch.testing.assert_close(grad, torch.tensor([-dgate[0] * 1.5 / 2, -dgate[1] * -2.0 / 2]))
    # On-policy (rho = 1) the gate's gradient is PPO's: -A per token.
    _, on_policy, _ = loss_and_grad("sapo", [0.0], [0.0], [3.0], LossSettings())
    torch.testing.assert_close(on_policy, torch.tensor([-3.0]))
    assert hit.tolist() == [0.0, 0.0]


def test_gmpo_value_and_gradient_by_hand():
    import math

    # deltas 0.1, 0.6 (above eps_high 0.4), -0.2 with A > 0: the clip takes min(delta, clip) =
    # 0.1, 0.4, -0.2; sequence ratio exp(mean) = exp(0.1); loss -A * ratio on every token.
    logp, old, adv = [0.1, 0.6, -0.2], [0.0, 0.0, 0.0], [2.0, 2.0, 2.0]
    loss, grad, hit = loss_and_grad("gmpo", logp, old, adv, LossSettings(0.4, 0.4), mode="seq-mean-token-mean")
    ratio = math.exp((0.1 + 0.4 - 0.2) / 3)
    torch.testing.assert_close(loss, torch.full((3,), -2.0 * ratio))
    # seq-mean-token-mean of a constant row = -A ratio; d/d delta_t = -A ratio / 3 where unclipped
    torch.testing.assert_close(grad, torch.tensor([-2.0 * ratio / 3, 0.0, -2.0 * ratio / 3]))
    assert hit.tolist() == [0.0, 1.0, 0.0]
    # A < 0 is pessimistic the other way: delta 0.6 stays (max), -0.6 is clipped to -0.4.
    loss, _, hit = loss_and_grad("gmpo", [0.6, -0.6], [0.0, 0.0], [-1.0, -1.0], LossSettings(0.4, 0.4))
    torch.testing.assert_close(loss, torch.full((2,), math.exp((0.6 - 0.4) / 2)))
    assert hit.tolist() == [0.0, 1.0]


def test_a_new_advantage_estimator_is_one_registered_function():
    from vlrft.algo import ADVANTAGES
    from vlrft.algo.estimate import AdvantageInputs

    @ADVANTAGES.register("best_is_one")
    def best_is_one(x: AdvantageInputs, opts: AdvantageOptions):
        best = x.sequence_rewards() == x.sequence_rewards().max()
        return x.broadcast(best.float()), None

    try:
        mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
        out, returns = estimate_advantages(AdvantageOptions(name="best_is_one", clip=0.5), torch.tensor([0.2, 0.7]),
                                           torch.tensor([0, 0]), mask, torch.zeros(2, 2))
        assert torch.equal(out, torch.tensor([[0.0, 0.0], [0.5, 0.0]])) and returns is None  # clip and mask applied after
        assert "best_is_one" in ADVANTAGES.names()
    finally:
        del ADVANTAGES._items["best_is_one"]  # the registry is process-wide
