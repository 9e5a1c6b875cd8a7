import pytest

from vlrft.config import ConfigError, load_config
from vlrft.config_checks import check_world_size


def write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


BASE = "model: {path: m}\ndata: {train_path: d.jsonl}\n"


def test_paths_resolve_relative_to_the_config_file(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.model.path == str(tmp_path / "m")
    assert cfg.data.train_path == str(tmp_path / "d.jsonl")


def test_unknown_key_names_key_and_valid_keys(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, BASE + "train: {learning_rate: 0.1}\n"))
    message = str(err.value)
    assert "\n" not in message
    assert "'train.learning_rate'" in message
    assert "lr" in message and "micro_batch_tokens" in message


def test_unknown_top_level_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'trainer'; valid keys here: model, data"):
        load_config(write(tmp_path, BASE + "trainer: {}\n"))


def test_dotted_overrides_are_parsed_as_yaml(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["train.lr=1e-3", "rollout.n_samples_per_prompt=4", "algo.kl.coef=0.5"])
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.rollout.n_samples_per_prompt == 4
    assert cfg.algo.kl.coef == 0.5


def test_override_of_unknown_key_fails(tmp_path):
    with pytest.raises(ConfigError, match="'rollout.samples'"):
        load_config(write(tmp_path, BASE), ["rollout.samples=3"])


def test_wrong_type_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="'train.total_steps' must be int"):
        load_config(write(tmp_path, BASE), ["train.total_steps=many"])


def test_group_estimator_needs_two_samples(tmp_path):
    with pytest.raises(ConfigError, match="n_samples_per_prompt must be >= 2"):
        load_config(write(tmp_path, BASE), ["rollout.n_samples_per_prompt=1"])


def test_unknown_algorithm_name_lists_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="unknown KL estimator .k9.; valid: abs, k1, k2, k3, full, auto"):
        load_config(write(tmp_path, BASE), ["algo.kl.estimator=k9"])
    with pytest.raises(ConfigError, match="valid: token-mean"):
        load_config(write(tmp_path, BASE), ["algo.loss_agg_mode=mean"])


def test_reward_specs_are_typed(tmp_path):
    text = BASE + "reward:\n  by_data_source:\n    maths: [{recipe: exact_match, weight: 2}]\n"
    cfg = load_config(write(tmp_path, text))
    spec = cfg.reward.by_data_source["maths"][0]
    assert spec.recipe == "exact_match" and spec.weight == 2.0 and spec.kwargs == {}


def test_rollout_prompts_must_divide_over_ranks(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["rollout.rollout_prompts=3"])
    check_world_size(cfg, 1)
    with pytest.raises(ConfigError, match="divisible by the world size"):
        check_world_size(cfg, 2)


def test_invalid_algorithm_combinations_fail_at_load(tmp_path):
    with pytest.raises(ConfigError, match="'algo.dual_clip_c' must be 0 \\(off\\) or > 1"):
        load_config(write(tmp_path, BASE), ["algo.dual_clip_c=0.5"])
    with pytest.raises(ConfigError, match="applies to grpo only, not 'rloo'"):
        load_config(write(tmp_path, BASE), ["algo.advantage=rloo", "algo.scale_by_std=false"])
    with pytest.raises(ConfigError, match="'rloo' compares responses within a group"):
        load_config(write(tmp_path, BASE), ["algo.advantage=rloo", "rollout.n_samples_per_prompt=1"])


INVALID = {
    "dual clip on a loss without a clip": (["algo.policy_loss=sapo", "algo.dual_clip_c=2"],
                                          "'algo.dual_clip_c' applies to policy_loss ppo and gspo, not 'sapo'"),
    "sapo temperatures for another loss": (["algo.sapo_tau_pos=2"], "apply to policy_loss sapo, not 'ppo'"),
    "a non-positive sapo temperature": (["algo.policy_loss=sapo", "algo.sapo_tau_neg=0"], "must be > 0"),
    "mini-batches below one": (["train.mini_batches=0"], "'train.mini_batches' must be >= 1"),
    "an unknown rollout correction": (["algo.rollout_correction=is"], "'algo.rollout_correction' is 'is'; valid: auto, none, tis, mis, icepop"),
    "a correction cap below one": (["algo.rollout_correction=tis", "algo.rollout_correction_cap=0.5"], "must be >= 1"),
    "a correction band for tis": (["algo.rollout_correction=tis", "algo.rollout_correction_low=0.2"],
                                  "apply to rollout_correction mis and icepop, not 'tis'"),
    "a band not around one": (["algo.rollout_correction=icepop", "algo.rollout_correction_low=1.5"], "0 < low <= 1 <= high"),
    "warm-up longer than the run": (["train.total_steps=2", "train.warmup_steps=2"],
                                    r"'train.warmup_steps' must be in \[0, 2\)"),
    "gae without a critic": (["algo.advantage=gae"], "algo.advantage 'gae' needs a critic"),
    "a critic without gae": (["critic.enabled=true"], "critic.enabled: true is only used by algo.advantage 'gae'"),
    "reinforce_pp_baseline with one sample": (
        ["algo.advantage=reinforce_pp_baseline", "rollout.n_samples_per_prompt=1"],
        "'reinforce_pp_baseline' compares responses within a group",
    ),
    "whitening switch outside gae": (["algo.whiten_advantages=false"], "applies to gae only, not 'grpo'"),
    "best-of-n smaller than the group": (["rollout.generation_size=4"], "'rollout.generation_size' \\(4\\) must be 0 or >="),
    "dynamic sampling with one sample": (
        ["rollout.dynamic_sampling=true", "rollout.n_samples_per_prompt=1", "algo.advantage=reinforce_pp"],
        "dynamic_sampling drops groups",
    ),
    "unknown KL placement": (["algo.kl.placement=logits"], "'algo.kl.placement' must be loss or reward"),
    "adaptive KL without a reference": (["algo.kl.target=6"], "need a reference model: set algo.kl.coef > 0"),
    "ref EMA without a reference": (["algo.kl.ref_ema_eta=0.1"], "need a reference model"),
    "ref EMA out of range": (["algo.kl.coef=0.1", "algo.kl.ref_ema_eta=2"], "'algo.kl.ref_ema_eta' must be in \\[0, 1\\]"),
    "PTX coef without data": (["algo.ptx_coef=0.1"], "'algo.ptx_coef' \\(> 0\\) and 'data.ptx_path' go together"),
    "PTX data without coef": (["data.ptx_path=p.jsonl"], "go together"),
    "unknown value normalisation": (
        ["algo.advantage=gae", "critic.enabled=true", "critic.value_norm=std"], "'critic.value_norm' is 'std'; valid: none, exp, ma"
    ),
    "policy EMA of one": (["train.ema_beta=1"], "'train.ema_beta' must be in \\[0, 1\\)"),
    "negative early stop": (["algo.target_kl=-1"], "'algo.target_kl' must be >= 0"),
    "gamma above one": (["algo.gamma=1.5"], "'algo.gamma' and 'algo.lam' must be in \\[0, 1\\]"),
    "zero sampling rounds": (["rollout.max_sampling_rounds=0"], "'rollout.max_sampling_rounds' must be >= 1"),
    "no video frames": (["data.max_frames=0"], "'data.max_frames' must be >= 1"),
    "video frames under the image floor": (["data.video_max_pixels=100"], "'data.min_pixels' must be <= 'data.video_max_pixels'"),
    "rollback without checkpoints": (["guards.on_collapse=rollback", "checkpoint.save_steps=0"],
                                     "restores a checkpoint from before the fall: set checkpoint.save_steps > 0"),
    "rollback in async mode": (["guards.on_collapse=rollback", "train.mode=async", "rollout.ranks=1"],
                               "which train.mode: async does not support"),
    "rollback factor of zero": (["guards.rollback_lr_factor=0"], "'guards.rollback_lr_factor' must be in \\(0, 1\\]"),
    "unknown collapse action": (["guards.on_collapse=restart"], "valid: warn, stop, rollback"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_algorithm_options_fail_at_load_with_one_line(case, tmp_path):
    overrides, message = INVALID[case]
    with pytest.raises(ConfigError, match=message) as err:
        load_config(write(tmp_path, BASE), overrides)
    assert "\n" not in str(err.value)


def test_kl_estimator_auto_depends_on_placement(tmp_path):
    from vlrft.config import kl_estimator_name

    assert kl_estimator_name(load_config(write(tmp_path, BASE)).algo.kl) == "k3"
    assert kl_estimator_name(load_config(write(tmp_path, BASE), ["algo.kl.placement=reward"]).algo.kl) == "k1"
    assert kl_estimator_name(load_config(write(tmp_path, BASE), ["algo.kl.estimator=full"]).algo.kl) == "full"


def test_async_mode_needs_rollout_ranks_that_leave_trainers(tmp_path):
    with pytest.raises(ConfigError, match="train.mode' is 'overlap'; valid: sync, async"):
        load_config(write(tmp_path, BASE), ["train.mode=overlap"])
    with pytest.raises(ConfigError, match="async needs rollout.ranks >= 1"):
        load_config(write(tmp_path, BASE), ["train.mode=async", "checkpoint.save_steps=0"])
    with pytest.raises(ConfigError, match="'rollout.ranks' needs train.mode async"):
        load_config(write(tmp_path, BASE), ["rollout.ranks=1"])
    with pytest.raises(ConfigError, match="'train.max_staleness' must be >= 0"):
        load_config(write(tmp_path, BASE), ["train.max_staleness=-1"])
    partial = ["train.mode=async", "checkpoint.save_steps=0", "train.partial_rollouts=true"]
    load_config(write(tmp_path, BASE), partial + ["rollout.ranks=2"])  # each rollout rank takes weights on its own
    with pytest.raises(ConfigError, match="'train.partial_rollouts' needs rollout.engine_tp_size 1"):
        load_config(write(tmp_path, BASE), partial + ["rollout.ranks=2", "rollout.engine=vllm", "rollout.engine_tp_size=2"])
    cfg = load_config(write(tmp_path, BASE), ["train.mode=async", "rollout.ranks=2", "checkpoint.save_steps=0",
                                              "rollout.rollout_prompts=6"])
    check_world_size(cfg, 3)  # 2 generate, 1 trains; 6 prompts split over the 2 that generate
    with pytest.raises(ConfigError, match="'rollout.ranks' \\(2\\) must leave ranks to train: the run has 2"):
        check_world_size(cfg, 2)
    cfg = load_config(write(tmp_path, BASE), ["train.mode=async", "rollout.ranks=4", "checkpoint.save_steps=0",
                                              "rollout.rollout_prompts=6"])
    with pytest.raises(ConfigError, match="divisible by rollout.ranks \\(4\\)"):
        check_world_size(cfg, 5)


def test_async_tensor_parallel_engines_must_fit_the_rollout_ranks_and_the_nodes(tmp_path):
    base = ["train.mode=async", "checkpoint.save_steps=0", "rollout.engine=vllm", "rollout.engine_tp_size=2",
            "rollout.rollout_prompts=12"]
    check_world_size(load_config(write(tmp_path, BASE), base + ["rollout.ranks=2"]), 3)  # one node: any trainer count
    check_world_size(load_config(write(tmp_path, BASE), base + ["rollout.ranks=4"]), 8, ranks_per_node=4)
    with pytest.raises(ConfigError, match="'rollout.engine_tp_size' \\(2\\) must divide rollout.ranks \\(3\\)"):
        check_world_size(load_config(write(tmp_path, BASE), base + ["rollout.ranks=3"]), 4)
    # 3 trainers first: the rollout ranks' pair would be global ranks 3 and 4, on two nodes.
    with pytest.raises(ConfigError, match="divide the ranks per node \\(4\\) and the trainer ranks \\(3\\)"):
        check_world_size(load_config(write(tmp_path, BASE), base + ["rollout.ranks=2"]), 5, ranks_per_node=4)


def test_rollout_correction_auto_corrects_only_where_async_samples_from_older_weights(tmp_path):
    from vlrft.config import rollout_correction_mode

    mode = lambda *overrides: rollout_correction_mode(load_config(write(tmp_path, BASE), list(overrides)))  # noqa: E731
    assert mode() == "none"  # sync: the engine serves the weights being trained
    async_run = ["train.mode=async", "rollout.ranks=1", "checkpoint.save_steps=0"]
    assert mode(*async_run) == "behaviour"  # max_staleness 1 by default
    assert mode(*async_run, "train.max_staleness=0") == "none"  # the synchronous schedule
    assert mode(*async_run, "train.max_staleness=0", "train.partial_rollouts=true") == "behaviour"
    assert mode(*async_run, "algo.rollout_correction=icepop") == "icepop"
    assert mode(*async_run, "rollout.top_p=0.9") == "tis"  # the engine's logprobs are the nucleus's
    with pytest.raises(ConfigError, match="behaviour needs rollout.top_p 1"):
        mode("algo.rollout_correction=behaviour", "rollout.top_p=0.9")
    assert mode("algo.rollout_correction=mis") == "mis"
