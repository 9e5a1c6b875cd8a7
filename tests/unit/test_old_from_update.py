"""One optimizer step per batch: the experience pass skips the policy forward and the update's
forward supplies the old logprobs (ratio exactly 1). Same loss, same gradient, same metrics as
with the separate pass; the pass stays whenever several optimizer steps share the batch."""

import copy
import functools

import pytest
import torch

from tests.unit.test_logprob_consistency import build_trainer
from tests.unit.test_mini_batches import scored_prompts
from vlrft.config import Config
from vlrft.trainer.build import old_logprobs_from_update, update_settings
from vlrft.trainer.update import policy_update


def perturb(trainer) -> None:
    """The same random change of the trainer's weights, whatever the trainer."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.backend.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def finish_and_update(trainer, experiences, policy_pass: bool):
    trainer.maker.settings.policy_pass = policy_pass
    experiences, made = trainer.maker.finish(experiences)
    trainer.buffer.clear()
    trainer.buffer.add(experiences)
    update = policy_update(trainer.backend, trainer.buffer, update_settings(trainer.cfg), trainer.kl_controller.coef,
                           trainer.reference, old_from_update=not policy_pass)
    return experiences, made, update


@pytest.mark.parametrize("correction", ["none", "icepop"])
def test_update_forward_replaces_the_policy_pass(correction, tiny_text, addition_data, tmp_path, world_of_one):
    # KL in the loss (k3) with a reference model. The trainers move on from the weights the
    # engine sampled with (a stale engine), so icepop masks some tokens.
    extra = ["train.lr=0.001"]
    if correction != "none":
        extra += [f"algo.rollout_correction={correction}", "algo.rollout_correction_low=0.8",
                  "algo.rollout_correction_high=1.25"]
    skip, keep = (build_trainer(tiny_text, addition_data, tmp_path / name, extra) for name in ("skip", "keep"))
    assert old_logprobs_from_update(skip.cfg) and not skip.maker.settings.policy_pass
    experiences = scored_prompts(skip)
    for trainer in (skip, keep):
        perturb(trainer)
    calls = []
    skip.backend.module.model.register_forward_hook(lambda *_: calls.append(1))  # the decoder policy_forward runs
    filled, made_skip, update_skip = finish_and_update(skip, copy.deepcopy(experiences), policy_pass=False)
    assert len(calls) == len(skip.buffer.micro_batches(shuffle=False))  # the update's forwards only
    with_pass, made_keep, update_keep = finish_and_update(keep, copy.deepcopy(experiences), policy_pass=True)

    assert all(e.old_logprobs is not None and e.entropy is not None for e in filled)
    for a, b in zip(filled, with_pass):
        torch.testing.assert_close(a.old_logprobs, b.old_logprobs, rtol=0, atol=1e-5)
        torch.testing.assert_close(a.entropy, b.entropy, rtol=0, atol=1e-5)
    # The metrics the pass reported come after the update instead, equal.
    after = skip.maker.policy_metrics(filled)[0]
    assert set(after) == {k for k in made_keep if k != "rollout/skipped_samples"} - set(made_skip)
    for key, value in after.items():
        assert value == pytest.approx(made_keep[key], abs=1e-5), key
    for key in ("train/loss", "train/pg_loss", "train/kl", "train/ratio_mean", "train/grad_norm"):
        assert update_skip[key] == pytest.approx(update_keep[key], rel=1e-4, abs=1e-6), key
    assert update_skip["train/ratio_mean"] == 1.0  # exactly: old is the forward's own logprob
    if correction == "icepop":  # the weights act in the loss, the same as the pass's
        assert 0 < made_keep["rollout/correction_masked_frac"] < 1
        plain = build_trainer(tiny_text, addition_data, tmp_path / "plain", extra[:1])
        perturb(plain)
        _, _, update_plain = finish_and_update(plain, copy.deepcopy(experiences), policy_pass=False)
        assert update_plain["train/pg_loss"] != pytest.approx(update_skip["train/pg_loss"], rel=1e-3)


@pytest.mark.parametrize("overrides, skipped", [
    ({}, True),
    ({"algo.kl.coef": 0.1}, True),  # KL in the loss: the reference pass stays, the policy's goes
    ({"train.ppo_epochs": 2}, False),
    ({"train.mini_batches": 2}, False),
    ({"algo.kl.coef": 0.1, "algo.kl.placement": "reward"}, False),  # the reward needs the policy's KL
    ({"algo.kl.coef": 0.1, "algo.kl.estimator": "full"}, False),  # the exact KL needs the policy's logits
    ({"critic.freeze_actor_steps": 2}, False),  # no update fills them
])
def test_when_the_policy_pass_is_skipped(overrides, skipped):
    cfg = Config()
    for key, value in overrides.items():
        *path, name = key.split(".")
        setattr(functools.reduce(getattr, path, cfg), name, value)
    assert old_logprobs_from_update(cfg) is skipped


def test_behaviour_takes_the_ppo_ratio_against_the_engines_logprobs(tiny_text, addition_data, tmp_path, world_of_one):
    """algo.rollout_correction behaviour: no weights; the ratio (and so PPO's clip) is pi_theta
    over the engine's logprob of each sampled token. Before the step pi_theta is the trainer's
    old policy, so the update's mean ratio is the mean of pi_old / pi_engine, by hand (1 on a
    response without engine logprobs)."""
    trainer = build_trainer(tiny_text, addition_data, tmp_path, ["train.lr=0.001", "algo.rollout_correction=behaviour"])
    experiences = scored_prompts(trainer)
    perturb(trainer)  # the engine sampled with the weights from before
    experiences[0].rollout.logprobs = None  # a response the engine reported no logprobs for keeps pi_old
    filled, made, update = finish_and_update(trainer, experiences, policy_pass=False)
    ratios = torch.cat([torch.ones_like(e.old_logprobs) if e.rollout.logprobs is None else
                        torch.exp(e.old_logprobs - torch.tensor(e.rollout.logprobs)) for e in filled])
    assert float(ratios.std()) > 0.05  # far from 1: the clip has work to do
    assert update["train/ratio_mean"] == pytest.approx(float(ratios.mean()), rel=1e-4)
    assert 0 < update["train/clip_frac"] < 1
