"""No dead options: changing a config key changes what one training step does.

Each case runs one in-process RL step (world of one, DeepSpeed ZeRO-2) from the same seed and
compares the parameter update with the baseline's.
"""

import pytest
import torch

from vlrft.config import load_config

RECIPE = "def distinct_chars(completions, samples):\n    return [len(set(c)) / 10 for c in completions]\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_text, addition_data, world_of_one):
    from data_tools.make_tiny_model import build_text_model

    root = tmp_path_factory.mktemp("wiring")
    (root / "recipe.py").write_text(RECIPE)
    other_ref = build_text_model(root / "other_ref", warmup_steps=0, seed=1)
    base = [
        f"model.path={tiny_text}",
        f"data.train_path={addition_data / 'train.jsonl'}",
        "rollout.rollout_prompts=2",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=6",
        "train.ppo_epochs=2",  # the second epoch is off-policy, so clipping can act
        "train.lr=0.001",
        "train.total_steps=4",
        "algo.kl.coef=0.1",
        f"reward.default=[{{recipe: '{root / 'recipe.py'}:distinct_chars'}}]",
        f"output.dir={root / 'run'}",
    ]
    return root, base, str(other_ref)


def update_after_one_step(overrides):
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    trainer = SPMDTrainer(load_config(None, overrides))
    before = torch.cat([p.detach().flatten().clone() for p in trainer.backend.module.parameters()])
    metrics = trainer.train_step()
    after = torch.cat([p.detach().flatten() for p in trainer.backend.module.parameters()])
    return after - before, metrics["train/grad_norm"]


@pytest.fixture(scope="module")
def baseline(setup):
    return update_after_one_step(setup[1])[0]


CHANGES = {
    "algo.clip_eps_low": "algo.clip_eps_low=0.0001",
    "algo.clip_eps_high": "algo.clip_eps_high=0.0001",
    "algo.loss_agg_mode": "algo.loss_agg_mode=seq-mean-token-sum",
    "algo.advantage": "algo.advantage=rloo",
    "algo.scale_by_std": "algo.scale_by_std=false",
    "algo.policy_loss": "algo.policy_loss=gspo",
    "algo.dual_clip_c": "algo.dual_clip_c=1.0001",
    "algo.entropy_coef": "algo.entropy_coef=0.1",
    "algo.reward_clip": "algo.reward_clip=0.05",
    "algo.zero_reward_truncated": "algo.zero_reward_truncated=true",
    "algo.high_entropy_token_ratio": "algo.high_entropy_token_ratio=0.2",
    "algo.kl.coef": "algo.kl.coef=0",
    "algo.kl.estimator": "algo.kl.estimator=k2",
    "train.lr": "train.lr=0.01",
    "train.lr_schedule": "train.lr_schedule=cosine",
    "train.weight_decay": "train.weight_decay=0.5",
    "train.grad_clip": "train.grad_clip=0.001",
    "train.ppo_epochs": "train.ppo_epochs=1",
    "train.seed": "train.seed=7",
    "rollout.temperature": "rollout.temperature=0.5",
    "rollout.top_p": "rollout.top_p=0.5",
    "rollout.n_samples_per_prompt": "rollout.n_samples_per_prompt=3",
    "rollout.rollout_prompts": "rollout.rollout_prompts=3",
    "rollout.max_new_tokens": "rollout.max_new_tokens=3",
}


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_changing_key_changes_the_update(key, setup, baseline):
    changed, _ = update_after_one_step(setup[1] + [CHANGES[key]])
    assert not torch.allclose(changed, baseline, rtol=1e-3, atol=1e-7), key


def test_reference_path_changes_the_update(setup, baseline):
    changed, _ = update_after_one_step(setup[1] + [f"model.ref_path={setup[2]}"])
    assert not torch.allclose(changed, baseline, rtol=1e-3, atol=1e-7)


def test_micro_batch_split_does_not_change_the_update(setup):
    # Global normalisers: one big micro-batch or one sequence per micro-batch, same step. The
    # pre-clip gradient norm catches a wrong overall scale (which Adam's update would hide);
    # the update catches a wrong relative weighting of micro-batches. atol: a few parameters
    # with near-zero gradients flip Adam's normalised step on float noise.
    whole, whole_norm = update_after_one_step(setup[1] + ["train.micro_batch_tokens=10000"])
    split, split_norm = update_after_one_step(setup[1] + ["train.micro_batch_tokens=1"])
    assert split_norm == pytest.approx(whole_norm, rel=1e-4)
    torch.testing.assert_close(split, whole, rtol=1e-3, atol=1e-5)


def test_entropy_mask_of_ratio_one_equals_no_mask(setup):
    plain, plain_norm = update_after_one_step(setup[1])
    masked, masked_norm = update_after_one_step(setup[1] + ["algo.high_entropy_token_ratio=1"])
    assert masked_norm == plain_norm
    torch.testing.assert_close(masked, plain, rtol=0, atol=0)


def test_reward_scale_and_bias_change_the_update_where_they_can(setup):
    # GRPO's std normalisation cancels a scale and a shift; Dr.GRPO keeps the scale, and a
    # clip makes the shift matter.
    dr = setup[1] + ["algo.scale_by_std=false"]
    assert not torch.allclose(update_after_one_step(dr)[0], update_after_one_step(dr + ["algo.reward_scale=3"])[0])
    clipped = setup[1] + ["algo.reward_clip=0.3"]  # rewards here are 0.8..1.5: all clip
    shifted = clipped + ["algo.reward_bias=1.2"]  # now they spread over [-0.3, 0.3]
    assert not torch.allclose(update_after_one_step(clipped)[0], update_after_one_step(shifted)[0])


def test_all_zero_rewards_stop_training_after_patience(setup, tmp_path):
    from vlrft.rewards.mix import RewardError
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    (tmp_path / "zero.py").write_text("def broken(completions, samples):\n    return [0.0] * len(completions)\n")
    overrides = setup[1] + [f"reward.default=[{{recipe: '{tmp_path / 'zero.py'}:broken'}}]"]
    patient = SPMDTrainer(load_config(None, overrides + ["algo.zero_reward_patience=2"]))
    patient.train_step()
    with pytest.raises(RewardError, match="exactly 0 for 2 consecutive steps: check the reward recipes \\(broken\\)"):
        patient.train_step()
    never = SPMDTrainer(load_config(None, overrides))
    for _ in range(3):
        never.train_step()
