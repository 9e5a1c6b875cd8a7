"""Rollout correction (algo.rollout_correction): weights and masks by hand, the HF engine's own
logprobs, and an engine serving stale weights corrected as the formulas say."""

import math

import torch

from tests.unit.test_logprob_consistency import SEVERAL_STEPS, build_trainer
from vlrft.algo.correction import correction_weights, mismatch_sums

# Two responses: 3 tokens and 2 tokens (+ padding). log r = old - engine per token.
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0]])
ENGINE = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -2.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# log r: [0.5, -1.0, 0.0], [0.0, -1.0, (pad)] -> r: [1.6487, 0.3679, 1.0], [1.0, 0.3679, -]


def test_tis_truncates_the_ratio_from_above():
    w = correction_weights(OLD, ENGINE, MASK, "tis", cap=1.5, low=0.5, high=2.0)
    expected = torch.tensor([[1.5, math.exp(-1.0), 1.0], [1.0, math.exp(-1.0), 0.0]])
    torch.testing.assert_close(w, expected)


def test_icepop_masks_tokens_outside_the_band_on_both_sides():
    w = correction_weights(OLD, ENGINE, MASK, "icepop", cap=2.0, low=0.5, high=1.5)
    # 1.6487 > 1.5 and 0.3679 < 0.5 are dropped; padding stays 0
    assert w.tolist() == [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]


def test_mis_masks_whole_sequences_by_their_geometric_mean_ratio():
    # sequence 0: exp((0.5 - 1 + 0) / 3) = 0.846; sequence 1: exp((0 - 1) / 2) = 0.607
    w = correction_weights(OLD, ENGINE, MASK, "mis", cap=2.0, low=0.7, high=2.0)
    assert w.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert correction_weights(OLD, ENGINE, MASK, "none", 2.0, 0.5, 2.0).tolist() == MASK.tolist()


def test_mismatch_sums_by_hand():
    w = correction_weights(OLD, ENGINE, MASK, "icepop", cap=2.0, low=0.5, high=1.5)
    tokens, kl, total, squares, masked = mismatch_sums(OLD, ENGINE, w, MASK).tolist()
    k3 = lambda lr: math.exp(lr) - 1 - lr  # noqa: E731  r - 1 - log r
    assert tokens == 5 and total == squares == 2 and masked == 3
    assert kl == pytest_approx(k3(0.5) + 2 * k3(-1.0))


def pytest_approx(value):
    import pytest

    return pytest.approx(value, rel=1e-6)


def test_hf_engine_reports_the_logprobs_it_sampled_from(tiny_text, addition_data, tmp_path, world_of_one):
    # temperature 0.7, no top-p, no banned tokens: the engine's sampling distribution is the
    # trainer's old policy. (With the vision tokens banned, as in training, the engine samples
    # from the policy renormalised without them: log(638/633) = 0.008 for this tiny model.)
    trainer = build_trainer(tiny_text, addition_data, tmp_path, [SEVERAL_STEPS])
    trainer.engine.banned_ids = []
    torch.manual_seed(1)
    prompts = [trainer.encoder.encode(trainer.train_rows[row], pos) for pos, row in trainer.sampler.next_indices()]
    experiences, metrics = trainer.maker.make(prompts)
    for e in experiences:
        assert len(e.rollout.logprobs) == len(e.rollout.response_ids)
        torch.testing.assert_close(torch.tensor(e.rollout.logprobs), e.old_logprobs, rtol=0, atol=1e-5)
    assert metrics["rollout/mismatch_kl"] < 1e-9 and metrics["rollout/engine_logprob_diff_max"] < 1e-5


def stale_engine_experiences(trainer):
    """Experiences whose engine served the weights from before a (random) update of the trainer."""
    with torch.no_grad():  # the trainer moves on; the engine keeps serving the old weights
        g = torch.Generator().manual_seed(0)
        for p in trainer.backend.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    torch.manual_seed(1)
    prompts = [trainer.encoder.encode(trainer.train_rows[row], pos) for pos, row in trainer.sampler.next_indices()]
    experiences, metrics = trainer.maker.make(prompts)
    ratios = [torch.exp(e.old_logprobs - torch.tensor(e.rollout.logprobs)) for e in experiences]  # pi_old / pi_engine
    return experiences, ratios, metrics


def test_stale_engine_weights_are_masked_by_icepop_as_the_formulas_say(tiny_text, addition_data, tmp_path, world_of_one):
    trainer = build_trainer(tiny_text, addition_data, tmp_path, [SEVERAL_STEPS, "algo.rollout_correction=icepop",
                                                                  "algo.rollout_correction_low=0.8",
                                                                  "algo.rollout_correction_high=1.25"])
    experiences, ratios, metrics = stale_engine_experiences(trainer)
    for e, ratio in zip(experiences, ratios):
        assert torch.equal(e.correction, ((ratio >= 0.8) & (ratio <= 1.25)).float())  # IcePop by hand
    every = torch.cat(ratios)
    assert (every < 0.8).any() and (every > 1.25).any() and ((every >= 0.8) & (every <= 1.25)).any()  # both bounds act
    dropped = float(((every < 0.8) | (every > 1.25)).float().mean())
    assert metrics["rollout/correction_masked_frac"] == pytest_approx(dropped)
    k3 = float((every - 1 - every.log()).mean())
    assert metrics["rollout/mismatch_kl"] == pytest_approx(k3) and k3 > 1e-3


def test_stale_engine_weights_are_truncated_by_tis_and_masked_by_mis(tiny_text, addition_data, tmp_path, world_of_one):
    tis = build_trainer(tiny_text, addition_data, tmp_path / "tis", [SEVERAL_STEPS, "algo.rollout_correction=tis",
                                                                      "algo.rollout_correction_cap=1.1"])
    experiences, ratios, metrics = stale_engine_experiences(tis)
    for e, ratio in zip(experiences, ratios):
        torch.testing.assert_close(e.correction, ratio.clamp(max=1.1))
    assert (torch.cat(ratios) > 1.1).any()  # the cap binds
    # The stale engine's responses have geometric-mean ratios of about 0.5-0.85 here.
    mis = build_trainer(tiny_text, addition_data, tmp_path / "mis", [SEVERAL_STEPS, "algo.rollout_correction=mis",
                                                                      "algo.rollout_correction_low=0.6",
                                                                      "algo.rollout_correction_high=1.0"])
    experiences, ratios, _ = stale_engine_experiences(mis)
    kept = []
    for e, ratio in zip(experiences, ratios):
        geometric = float(torch.exp(ratio.log().mean()))
        kept.append(0.6 <= geometric <= 1.0)
        assert torch.equal(e.correction, torch.full_like(ratio, float(kept[-1])))  # whole sequences
    assert any(kept) and not all(kept)
