"""No dead options: changing a config key changes what one training step does.

Each case runs one in-process RL step (world of one, DeepSpeed ZeRO-2) from the same seed and
compares the parameter update with the baseline's.
"""

import pytest
import torch

from vlrft.config import ConfigError, load_config

RECIPE = (
    "def distinct_chars(completions, samples):\n"
    "    return [len(set(c)) / 10 for c in completions]\n"
    "\n"
    "def half_constant(completions, samples):\n"
    "    # rows with an even id digit score 0 whatever the response: all-equal groups\n"
    "    return [len(set(c)) / 10 * (int(s['id'][-1]) % 2) for c, s in zip(completions, samples)]\n"
    "\n"
    "def dense_first(completions, samples):\n"
    "    # a per-token reward on the first response token only\n"
    "    return [[0.3] + [0.0] * (s['response_length'] - 1) if s['response_length'] else [] for s in samples]\n"
)


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


def flat_parameters(trainer) -> torch.Tensor:
    """Actor and (when present) critic parameters, flattened into one vector."""
    modules = [trainer.backend.module] + ([trainer.critic.module] if trainer.critic is not None else [])
    return torch.cat([p.detach().flatten().clone() for m in modules for p in m.parameters()])


def update_after_one_step(overrides, steps: int = 1):
    """The parameter change of the last of `steps` steps, and that step's actor grad norm."""
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    trainer = SPMDTrainer(load_config(None, overrides))
    for _ in range(steps):
        before = flat_parameters(trainer)
        metrics = trainer.train_step()
    return flat_parameters(trainer) - before, metrics.get("train/grad_norm", 0.0)


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
    "algo.kl_cov_ratio": "algo.kl_cov_ratio=0.5",
    "algo.kl.coef": "algo.kl.coef=0",
    "algo.kl.estimator": "algo.kl.estimator=k2",
    "model.compute_dtype": "model.compute_dtype=bfloat16",
    "train.lr": "train.lr=0.01",
    "train.lr_schedule": "train.lr_schedule=cosine",
    "train.weight_decay": "train.weight_decay=0.5",
    "train.grad_clip": "train.grad_clip=0.001",
    "train.ppo_epochs": "train.ppo_epochs=1",
    "train.mini_batches": "train.mini_batches=2",
    "train.warmup_steps": "train.warmup_steps=1",
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
    torch.testing.assert_close(split, whole, rtol=1e-3, atol=1e-4)  # lr 1e-3: a mis-weighting moves many by ~1e-3


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


def test_all_zero_rewards_stop_training_after_patience(setup, tmp_path, capsys):
    from vlrft.rewards.mix import RewardError
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    (tmp_path / "zero.py").write_text("def broken(completions, samples):\n    return [0.0] * len(completions)\n")
    overrides = setup[1] + [f"reward.default=[{{recipe: '{tmp_path / 'zero.py'}:broken'}}]"]
    patient = SPMDTrainer(load_config(None, overrides + ["algo.zero_reward_patience=2"]))
    patient.train_step()
    with pytest.raises(RewardError, match="exactly 0 for 2 consecutive steps: check the reward recipes \\(broken\\)"):
        patient.train_step()
    never = SPMDTrainer(load_config(None, overrides))
    for step in range(3):
        never.train_step()
        out = capsys.readouterr().out
        warning = "vlrft: warning: every reward was exactly 0 for 3 consecutive steps: check the reward recipes (broken)"
        assert (warning in out) == (step == 2)  # the default warns instead of stopping


GAE = ["algo.advantage=gae", "critic.enabled=true", "critic.lr=0.001"]
PTX = ["algo.ptx_coef=0.5"]  # data.ptx_path is added by the test (a file it writes)
# The half_constant recipe (ROOT = the fixture's directory): its all-equal groups are dropped.
HALF = ["reward.default=[{recipe: 'ROOT/recipe.py:half_constant'}]"]
# key -> (overrides of the comparison's base, the change, steps): the base is the module's
# baseline plus the first list; a key whose effect starts at step 2 compares the second step.
PAIRED = {
    "algo.advantage=reinforce_pp": ([], "algo.advantage=reinforce_pp", 1),
    "algo.advantage=reinforce_pp_baseline": ([], "algo.advantage=reinforce_pp_baseline", 1),
    "algo.gamma": (["algo.advantage=reinforce_pp"], "algo.gamma=0.5", 1),
    "algo.lam": (GAE, "algo.lam=0.5", 1),
    "algo.whiten_advantages": (GAE, "algo.whiten_advantages=false", 1),
    "algo.advantage_clip": ([], "algo.advantage_clip=0.1", 1),
    # (the loss values cispo/sapo/gmpo and the correction modes have hand-computed unit tests:
    # test_algo_exactness.py, test_rollout_correction.py)
    # top-p 0.3: the engine samples from the nucleus, renormalised, so pi_old / pi_engine is the
    # nucleus mass, in [0.3, 1] (the cap and the upper bound act with a stale engine instead:
    # test_rollout_correction.py)
    "algo.rollout_correction=tis": (["rollout.top_p=0.3"], "algo.rollout_correction=tis", 1),
    "algo.rollout_correction_low": (["rollout.top_p=0.3", "algo.rollout_correction=icepop"], "algo.rollout_correction_low=0.1", 1),
    # the gate temperatures act off-policy: the second of the setup's two epochs
    "algo.sapo_tau_pos": (["algo.policy_loss=sapo"], "algo.sapo_tau_pos=5.0", 1),
    "algo.sapo_tau_neg": (["algo.policy_loss=sapo"], "algo.sapo_tau_neg=5.0", 1),
    "algo.mask_truncated": ([], "algo.mask_truncated=true", 1),
    "algo.early_stop_ratio": ([], "algo.early_stop_ratio=0.000000001", 1),
    "algo.target_kl": ([], "algo.target_kl=0.000000000001", 1),
    "algo.kl.placement": ([], "algo.kl.placement=reward", 1),
    "algo.kl.estimator=full": ([], "algo.kl.estimator=full", 1),
    "algo.kl.target": ([], "algo.kl.target=0.0001", 2),
    "algo.kl.horizon": (["algo.kl.target=0.0001"], "algo.kl.horizon=10", 2),
    "algo.kl.ref_ema_eta": ([], "algo.kl.ref_ema_eta=0.5", 2),
    "rollout.generation_size": ([], "rollout.generation_size=8", 1),
    "dense rewards (reinforce_pp)": (
        ["algo.advantage=reinforce_pp"],
        "reward.default=[{recipe: 'ROOT/recipe.py:distinct_chars'}, {recipe: 'ROOT/recipe.py:dense_first'}]",
        1,
    ),
    "rollout.dynamic_sampling": (HALF, "rollout.dynamic_sampling=true", 1),
    "rollout.max_sampling_rounds": (HALF + ["rollout.dynamic_sampling=true"], "rollout.max_sampling_rounds=1", 1),
    "critic.lr": (GAE, "critic.lr=0.01", 1),
    "critic.value_clip": (GAE, "critic.value_clip=0.000001", 1),
    "critic.value_norm": (GAE, "critic.value_norm=ma", 1),
    "critic.value_norm_beta": (GAE + ["critic.value_norm=exp"], "critic.value_norm_beta=0.5", 2),
    "critic.freeze_actor_steps": (GAE, "critic.freeze_actor_steps=1", 1),
    "algo.ptx_coef": (PTX, "", 1),
    "data.ptx_rows_per_step": (PTX, "data.ptx_rows_per_step=2", 1),
}


@pytest.fixture(scope="module")
def ptx_file(setup):
    import json

    root = setup[0]
    rows = [
        {"id": f"ptx-{i}", "data_source": "ptx", "messages": [{"role": "user", "content": [{"type": "text", "text": f"{i} + 1 ="}]}], "answer": str(i + 1)}
        for i in range(6)
    ]
    (root / "ptx.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(root / "ptx.jsonl")


@pytest.mark.parametrize("name", sorted(PAIRED))
def test_changing_key_changes_the_update_paired(name, setup, ptx_file):
    extra, change, steps = PAIRED[name]
    ptx = [f"data.ptx_path={ptx_file}"] if any(o.startswith("algo.ptx_coef") for o in extra) else []
    base = setup[1] + [o.replace("ROOT", str(setup[0])) for o in extra] + ptx
    if name == "algo.ptx_coef":  # compare no PTX with PTX
        reference, _ = update_after_one_step(setup[1])
        changed, _ = update_after_one_step(base)
    else:
        reference, _ = update_after_one_step(base, steps)
        changed, _ = update_after_one_step(base + [change.replace("ROOT", str(setup[0]))], steps)
    assert not torch.allclose(changed, reference, rtol=1e-3, atol=1e-7), name


def build_trainer(overrides):
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    return SPMDTrainer(load_config(None, overrides))


def test_moe_aux_coef_adds_the_router_loss(setup, tiny_text):
    from transformers import AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM

    moe_dir = setup[0] / "tiny_moe"
    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        vocab_size=638, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
    )
    Qwen2MoeForCausalLM(config).save_pretrained(moe_dir)
    AutoTokenizer.from_pretrained(tiny_text).save_pretrained(moe_dir)
    with pytest.raises(ConfigError, match="'algo.moe_aux_coef' needs a mixture-of-experts model"):
        build_trainer(setup[1] + ["algo.moe_aux_coef=0.5"])  # the dense tiny model has no router
    base = setup[1] + [f"model.path={moe_dir}"]
    plain, _ = update_after_one_step(base)
    trainer = build_trainer(base + ["algo.moe_aux_coef=0.5"])
    before = flat_parameters(trainer)
    metrics = trainer.train_step()
    assert metrics["train/moe_aux_loss"] > 0
    assert not torch.allclose(flat_parameters(trainer) - before, plain, rtol=1e-3, atol=1e-7)


def test_policy_ema_tracks_the_updates_and_serves_evaluation(setup, addition_data):
    # ema <- beta * ema + (1 - beta) * theta after each update, from ema = theta_0:
    # beta = 0.5, two steps -> 0.25 theta_0 + 0.25 theta_1 + 0.5 theta_2.
    trainer = build_trainer(setup[1] + ["train.ema_beta=0.5", f"data.eval_path={addition_data / 'test.jsonl'}"])
    names = [n for n, _ in trainer.backend.module.named_parameters()]
    snapshots = [{n: p.detach().clone() for n, p in trainer.backend.module.named_parameters()}]
    for _ in range(2):
        trainer.train_step()
        snapshots.append({n: p.detach().clone() for n, p in trainer.backend.module.named_parameters()})
    for n in names:
        expected = 0.25 * snapshots[0][n] + 0.25 * snapshots[1][n] + 0.5 * snapshots[2][n]
        torch.testing.assert_close(trainer.policy_ema[n], expected)
    served = {}
    real_update = trainer.engine.update_weights

    def record(named):
        named = list(named)
        served.setdefault("first", dict(named))
        real_update(named)

    trainer.engine.update_weights = record
    trainer._maybe_evaluate(2)
    torch.testing.assert_close(served["first"][names[0]], trainer.policy_ema[names[0]])  # evaluated the EMA
    engine_params = dict(trainer.engine.model.named_parameters())
    torch.testing.assert_close(engine_params[names[0]], snapshots[2][names[0]])  # live weights restored


def test_policy_ema_is_exported(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = build_trainer(setup[1] + ["train.ema_beta=0.5", "train.total_steps=1", f"output.dir={tmp_path}"])
    start = {n: p.detach().clone() for n, p in trainer.backend.module.named_parameters()}
    trainer.train()
    final = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "final").named_parameters())
    ema = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "final_ema").named_parameters())
    name = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(ema[name], 0.5 * start[name] + 0.5 * final[name])


def test_dynamic_sampling_with_nothing_to_learn_updates_nothing(setup, tmp_path):
    (tmp_path / "flat.py").write_text("def flat(completions, samples):\n    return [1.0] * len(completions)\n")
    trainer = build_trainer(
        setup[1]
        + [f"reward.default=[{{recipe: '{tmp_path / 'flat.py'}:flat'}}]", "rollout.dynamic_sampling=true",
           "rollout.max_sampling_rounds=2"]
    )
    before = flat_parameters(trainer)
    metrics = trainer.train_step()
    assert metrics["rollout/dropped_group_frac"] == 1.0
    assert metrics["rollout/sampling_rounds"] == 2.0
    assert trainer.sampler.consumed == 2 * 2  # two rounds of rollout_prompts = 2
    assert all(not e.in_loss for e in trainer.buffer.items)  # the placeholder group
    assert torch.equal(flat_parameters(trainer), before)


def test_early_stop_skips_the_remaining_epochs(setup):
    assert build_trainer(setup[1]).train_step()["train/epochs_run"] == 2
    metrics = build_trainer(setup[1] + ["algo.target_kl=0.000000000001"]).train_step()
    assert metrics["train/epochs_run"] == 1
    assert metrics["train/drift_kl"] > 0


def test_frozen_actor_trains_only_the_critic(setup):
    trainer = build_trainer(setup[1] + GAE + ["critic.freeze_actor_steps=1"])
    actor = torch.cat([p.detach().flatten().clone() for p in trainer.backend.module.parameters()])
    critic = torch.cat([p.detach().flatten().clone() for p in trainer.critic.module.parameters()])
    metrics = trainer.train_step()
    assert "train/loss" not in metrics and "critic/value_loss" in metrics
    assert torch.equal(torch.cat([p.detach().flatten() for p in trainer.backend.module.parameters()]), actor)
    assert not torch.equal(torch.cat([p.detach().flatten() for p in trainer.critic.module.parameters()]), critic)
    trainer.train_step()  # step 2: the actor moves
    assert not torch.equal(torch.cat([p.detach().flatten() for p in trainer.backend.module.parameters()]), actor)


def test_compiled_layers_give_the_eager_update(setup, baseline):
    from vlrft.models.compiled_layers import compiled_frames

    torch._dynamo.reset()  # nothing compiled by earlier tests is reused: this run compiles its own
    compiled, _ = update_after_one_step(setup[1] + ["model.compile=on"])
    assert compiled_frames() > 0
    torch.testing.assert_close(compiled, baseline, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("mode", ["advantage", "loss", "jsd"])
def test_a_teacher_changes_the_update(mode, setup, baseline):
    changed, _ = update_after_one_step(setup[1] + [f"teacher.path={setup[2]}", f"algo.distill.mode={mode}"])
    assert not torch.allclose(changed, baseline, rtol=1e-3, atol=1e-7), mode


def test_pure_distillation_trains_without_a_reward_recipe(setup):
    # The student's own checkpoint as its teacher: d = 0 at every token, nothing to learn; another
    # model as the teacher: an update, with every reward 0.
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    pure = setup[1] + ["reward.default=[]", "algo.kl.coef=0"]
    itself, _ = update_after_one_step(pure + [f"teacher.path={setup[1][0].split('=', 1)[1]}"])
    assert itself.abs().max() == 0
    trainer = SPMDTrainer(load_config(None, pure + [f"teacher.path={setup[2]}"]))
    metrics = trainer.train_step()
    assert metrics["rollout/reward_mean"] == 0 and metrics["distill/reverse_kl"] != 0 and metrics["train/grad_norm"] > 0


def test_jsd_distillation_measures_the_top_k_divergence(setup):
    # The student's own checkpoint as its teacher: the divergence over its top-k tokens is 0
    # (rounding); another model's: above 0, and the update trains on it with every reward 0.
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    # One optimizer step: the metric is the last step's, and a second epoch's student has moved.
    pure = setup[1] + ["reward.default=[]", "algo.kl.coef=0", "algo.distill.mode=jsd", "algo.distill.top_k=8", "train.ppo_epochs=1"]
    itself = SPMDTrainer(load_config(None, pure + [f"teacher.path={setup[1][0].split('=', 1)[1]}"])).train_step()
    assert abs(itself["train/distill_jsd"]) < 1e-6 and itself["distill/reverse_kl"] == 0
    other = SPMDTrainer(load_config(None, pure + [f"teacher.path={setup[2]}"])).train_step()
    assert other["train/distill_jsd"] > 1e-3 and other["train/grad_norm"] > 0
