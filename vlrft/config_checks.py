"""Cross-field config checks: what a single field's type cannot express. Each failure is a
ConfigError whose one-line message names the key (config.load_config runs them)."""

from __future__ import annotations

import importlib.util
import math

from vlrft.config import (
    LR_SCHEDULES,
    AlgoConfig,
    DistillConfig,
    OFFLOAD_CHOICES,
    ON_BAD_SAMPLE,
    WANDB_MODES,
    Config,
    ModelConfig,
    RewardConfig,
    TeacherConfig,
    component_name,
    optimizer_steps_of_run,
    rollout_correction_mode,
)
from vlrft.errors import ConfigError


def _validate_model(model: ModelConfig, zero_stage: int) -> None:
    from vlrft.models.attention import precision_config_problem

    from vlrft.models.compiled_layers import compile_config_problem

    problem = precision_config_problem(model.attention, model.compute_dtype, zero_stage) or compile_config_problem(model.compile, zero_stage)
    if problem:
        raise ConfigError(problem)
    from vlrft.models.fused_head import fused_head_problem

    if problem := fused_head_problem(model.fused_head, model.compute_dtype):
        raise ConfigError(problem)
    lora = model.lora
    if lora.rank < 0:
        raise ConfigError(f"config key 'model.lora.rank' must be >= 0 (0 = full fine-tuning), got {lora.rank}")
    if lora.rank == 0:
        if _changed_key(lora, ("alpha", "dropout", "lr_ratio", "target_modules")):
            raise ConfigError("config keys 'model.lora.*' apply to LoRA training: set model.lora.rank > 0")
        return
    if lora.alpha <= 0:
        raise ConfigError(f"config key 'model.lora.alpha' must be > 0, got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"config key 'model.lora.dropout' must be in [0, 1), got {lora.dropout}")
    if lora.lr_ratio <= 0:
        raise ConfigError(f"config key 'model.lora.lr_ratio' must be > 0, got {lora.lr_ratio}")
    if not lora.target_modules:
        raise ConfigError("config key 'model.lora.target_modules' must name at least one module")
    if model.ref_path:
        raise ConfigError(
            "config key 'model.ref_path' cannot be combined with model.lora: the reference of a LoRA policy "
            "is its base model (adapters off)"
        )


def _validate_multi_turn(rollout, unsafe_no_isolation: bool) -> None:
    if not rollout.environment:
        return
    from vlrft.multiturn.environment import resolve_environment
    from vlrft.multiturn.tools import BUILTIN_TOOLS, ToolEnvironment, resolve_tool
    from vlrft.isolation.sandbox import check_can_run_code, runs_code

    factory = resolve_environment(rollout.environment)  # one line when it cannot be found or loaded
    tools = rollout.environment_args.get("tools", ["calculator"]) if factory is ToolEnvironment else []
    for spec in tools if isinstance(tools, list) else []:  # (a malformed list fails when the environment is built)
        if isinstance(spec, str) and (spec == "python" if spec in BUILTIN_TOOLS else runs_code(resolve_tool(spec)[1])):
            check_can_run_code(f"tool '{spec}'", unsafe_no_isolation)
    if rollout.max_turns < 1:
        raise ConfigError(f"config key 'rollout.max_turns' must be >= 1, got {rollout.max_turns}")
    if rollout.max_trajectory_tokens < rollout.max_new_tokens:
        raise ConfigError(
            f"config key 'rollout.max_trajectory_tokens' ({rollout.max_trajectory_tokens}) must be >= "
            f"rollout.max_new_tokens ({rollout.max_new_tokens}): a trajectory holds at least one turn"
        )
    if rollout.environment_workers < 1:
        raise ConfigError(f"config key 'rollout.environment_workers' must be >= 1, got {rollout.environment_workers}")
    if rollout.environment_timeout_s <= 0:
        raise ConfigError(f"config key 'rollout.environment_timeout_s' must be > 0, got {rollout.environment_timeout_s}")


TRAIN_MODES = ("sync", "async")


def _validate_mode(cfg: Config) -> None:
    """train.mode and what asynchronous training supports so far (docs/async.md)."""
    train = cfg.train
    if train.mode not in TRAIN_MODES:
        raise ConfigError(f"config key 'train.mode' is '{train.mode}'; valid: {', '.join(TRAIN_MODES)}")
    if train.max_staleness < 0:
        raise ConfigError(f"config key 'train.max_staleness' must be >= 0, got {train.max_staleness}")
    if train.mode == "sync":
        if cfg.rollout.ranks:
            raise ConfigError("config key 'rollout.ranks' needs train.mode async (sync: every rank generates)")
        if train.partial_rollouts:
            raise ConfigError("config key 'train.partial_rollouts' needs train.mode async")
        return
    if train.partial_rollouts and cfg.rollout.engine_tp_size != 1:
        # A tensor-parallel engine decodes in step on all its ranks: each would look for new
        # weights at a moment of its own.
        raise ConfigError("config key 'train.partial_rollouts' needs rollout.engine_tp_size 1 (docs/async.md)")
    if cfg.rollout.ranks < 1:
        raise ConfigError("train.mode async needs rollout.ranks >= 1: the ranks that generate")


def validate(cfg: Config) -> None:
    """Cross-field checks that a single field's type cannot express."""
    from vlrft.algo import ADVANTAGES, POLICY_LOSSES
    from vlrft.engines import ENGINES
    from vlrft.engines.static_decode import HF_DECODE_MODES

    if not cfg.model.path:
        raise ConfigError("config key 'model.path' is required (an HF checkpoint directory)")
    if not cfg.data.train_path:
        raise ConfigError("config key 'data.train_path' is required (a JSONL file)")
    ADVANTAGES.check(cfg.algo.advantage, "algo.advantage")
    POLICY_LOSSES.check(cfg.algo.policy_loss, "algo.policy_loss")
    _validate_algo(cfg)
    _validate_sequence_parallel(cfg)  # (before the model's: its attention line is the one that applies)
    _validate_model(cfg.model, cfg.train.zero_stage)
    ENGINES.check(cfg.rollout.engine, "rollout.engine")
    if cfg.rollout.engine_tp_size < 1:
        raise ConfigError(f"config key 'rollout.engine_tp_size' must be >= 1, got {cfg.rollout.engine_tp_size}")
    if cfg.rollout.engine != "vllm" and cfg.rollout.engine_tp_size != 1:
        raise ConfigError("config key 'rollout.engine_tp_size' applies to rollout.engine 'vllm' only")
    if cfg.rollout.hf_decode not in HF_DECODE_MODES:
        raise ConfigError(f"config key 'rollout.hf_decode' is '{cfg.rollout.hf_decode}'; valid: {', '.join(HF_DECODE_MODES)}")
    if cfg.logging.wandb not in WANDB_MODES:
        raise ConfigError(f"config key 'logging.wandb' is '{cfg.logging.wandb}'; valid: {', '.join(WANDB_MODES)}")
    # Checked here, before models load, rather than when rank 0 builds the sinks.
    needed = {"logging.wandb": ("wandb", "pip install 'vlrft[wandb]'")} if cfg.logging.wandb != "disabled" else {}
    if cfg.logging.tensorboard:
        needed["logging.tensorboard"] = ("tensorboard", "pip install 'vlrft[tensorboard]'")
    for key, (package, install) in needed.items():
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"config key '{key}' needs the {package} package, which is not installed: {install}")
    if cfg.checkpoint.save_steps < 0:
        raise ConfigError(f"config key 'checkpoint.save_steps' must be >= 0 (0 = only on a signal), got {cfg.checkpoint.save_steps}")
    if cfg.checkpoint.keep_last < 1:
        raise ConfigError(f"config key 'checkpoint.keep_last' must be >= 1, got {cfg.checkpoint.keep_last}")
    if (cfg.guards.sync_max_logprob_gap or 0) < 0:
        raise ConfigError(f"config key 'guards.sync_max_logprob_gap' must be >= 0 (0 = off), got {cfg.guards.sync_max_logprob_gap}")
    for key in ("step_reward_budget_s", "component_patience", "memory_window",
                "peer_timeout_s", "stall_timeout_s", "collapse_drop", "plateau_patience", "plateau_tolerance"):
        if getattr(cfg.guards, key) < 0:
            raise ConfigError(f"config key 'guards.{key}' must be >= 0 (0 = off), got {getattr(cfg.guards, key)}")
    if cfg.guards.collapse_window < 1:
        raise ConfigError(f"config key 'guards.collapse_window' must be >= 1, got {cfg.guards.collapse_window}")
    if cfg.guards.on_collapse not in ("warn", "stop", "rollback"):
        raise ConfigError(f"config key 'guards.on_collapse' is '{cfg.guards.on_collapse}'; valid: warn, stop, rollback")
    if not 0 < cfg.guards.rollback_lr_factor <= 1:
        raise ConfigError(f"config key 'guards.rollback_lr_factor' must be in (0, 1], got {cfg.guards.rollback_lr_factor}")
    if cfg.guards.on_collapse == "rollback" and cfg.checkpoint.save_steps == 0:
        raise ConfigError("config key 'guards.on_collapse' is 'rollback', which restores a checkpoint from before "
                          "the fall: set checkpoint.save_steps > 0")
    if cfg.guards.on_collapse == "rollback" and cfg.train.mode != "sync":
        raise ConfigError("config key 'guards.on_collapse' is 'rollback', which train.mode: async does not support "
                          "(the rollout ranks' weight versions would have to go back too): warn or stop")
    if cfg.trajectory.save_every < 0:
        raise ConfigError(f"config key 'trajectory.save_every' must be >= 0 (0 = off), got {cfg.trajectory.save_every}")
    if not 0 < cfg.rollout.vllm_memory_fraction <= 1:
        raise ConfigError(f"config key 'rollout.vllm_memory_fraction' must be in (0, 1], got {cfg.rollout.vllm_memory_fraction}")
    if cfg.train.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"config key 'train.lr_schedule' is '{cfg.train.lr_schedule}'; valid: {', '.join(LR_SCHEDULES)}")
    if cfg.train.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"config key 'train.zero_stage' must be 0, 1, 2 or 3, got {cfg.train.zero_stage}")
    _validate_mode(cfg)
    if cfg.train.offload not in OFFLOAD_CHOICES:
        raise ConfigError(f"config key 'train.offload' is '{cfg.train.offload}'; valid: {', '.join(OFFLOAD_CHOICES)}")
    if cfg.train.offload == "optimizer" and cfg.train.zero_stage == 0:
        raise ConfigError("config key 'train.offload' optimizer needs train.zero_stage 1, 2 or 3 (ZeRO-Offload)")
    if cfg.train.offload == "all" and cfg.train.zero_stage != 3:
        raise ConfigError("config key 'train.offload' all (parameters too) needs train.zero_stage 3")
    positive = {
        "rollout.rollout_prompts": cfg.rollout.rollout_prompts,
        "rollout.max_new_tokens": cfg.rollout.max_new_tokens,
        "train.total_steps": cfg.train.total_steps,
        "train.ppo_epochs": cfg.train.ppo_epochs,
        "train.mini_batches": cfg.train.mini_batches,
        "train.micro_batch_tokens": cfg.train.micro_batch_tokens,
        "data.max_prompt_tokens": cfg.data.max_prompt_tokens,
        "data.max_frames": cfg.data.max_frames,
        "data.video_max_decoded_pixels": cfg.data.video_max_decoded_pixels,
        "data.ptx_rows_per_step": cfg.data.ptx_rows_per_step,
        "rollout.max_sampling_rounds": cfg.rollout.max_sampling_rounds,
        "algo.kl.horizon": cfg.algo.kl.horizon,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {value}")
    optimizer_steps = optimizer_steps_of_run(cfg)
    if not 0 <= cfg.train.warmup_steps < optimizer_steps:
        raise ConfigError(
            f"config key 'train.warmup_steps' must be in [0, {optimizer_steps}) (the run's optimizer steps: "
            f"total_steps x ppo_epochs x mini_batches), got {cfg.train.warmup_steps}"
        )
    _validate_multi_turn(cfg.rollout, cfg.sandbox.unsafe_no_isolation)
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"config key 'rollout.top_p' must be in (0, 1], got {cfg.rollout.top_p}")
    if cfg.rollout.temperature <= 0:
        raise ConfigError("config key 'rollout.temperature' must be > 0 (evaluation is greedy on its own)")
    if not 0 < cfg.data.video_decode_timeout_s < math.inf:
        raise ConfigError("config key 'data.video_decode_timeout_s' must be a finite number > 0, "
                          f"got {cfg.data.video_decode_timeout_s}")
    for key in ("max_pixels", "video_max_pixels"):
        if cfg.data.min_pixels > getattr(cfg.data, key):
            raise ConfigError(f"config key 'data.min_pixels' must be <= 'data.{key}'")
    if "{prompt}" not in cfg.data.prompt_template:
        raise ConfigError(f"config key 'data.prompt_template' must contain '{{prompt}}', got {cfg.data.prompt_template!r}")
    for key in ("prompt_key", "answer_key", "image_key"):
        if not getattr(cfg.data, key):
            raise ConfigError(f"config key 'data.{key}' must name a column")
    if cfg.data.on_bad_sample not in ON_BAD_SAMPLE:
        raise ConfigError(f"config key 'data.on_bad_sample' is '{cfg.data.on_bad_sample}'; valid: {', '.join(ON_BAD_SAMPLE)}")
    if "" in cfg.data.media_roots:  # "" would resolve to the working directory, allowing all of it
        raise ConfigError("config key 'data.media_roots' has an empty entry; each names a directory")
    _validate_rewards(cfg.reward, cfg.sandbox.unsafe_no_isolation, cfg.teacher.enabled())
    _validate_distillation(cfg)


def _validate_sequence_parallel(cfg: Config) -> None:
    """What does not compose with train.sequence_parallel yet, each refused in one line."""
    from vlrft.algo.kl import FULL_KL
    from vlrft.models.attention import SEQUENCE_PARALLEL_ATTENTION

    sequence = cfg.train.sequence_parallel
    if sequence < 1:
        raise ConfigError(f"config key 'train.sequence_parallel' must be >= 1, got {sequence}")
    if sequence == 1:
        return
    refused = [
        (cfg.model.attention not in ("auto", *SEQUENCE_PARALLEL_ATTENTION),
         f"model.attention {cfg.model.attention} (only auto, sdpa_segments and torch_varlen exchange heads for tokens)"),
        (cfg.algo.policy_loss in ("gspo", "gmpo"),
         f"algo.policy_loss {cfg.algo.policy_loss} (its sequence-level ratio would see one shard of each response)"),
        (cfg.train.mode == "async", "train.mode async (sequence parallelism runs in sync mode)"),
        (cfg.algo.kl.estimator == FULL_KL and cfg.algo.kl.coef > 0, "algo.kl.estimator full (it needs every rank's logits)"),
        (cfg.algo.moe_aux_coef > 0, "algo.moe_aux_coef (the router's loss would see a shard's tokens only)"),
        (cfg.model.compile == "on", "model.compile on (the exchange inside a compiled layer is not measured yet)"),
    ]
    for clash, what in refused:
        if clash:
            raise ConfigError(f"config key 'train.sequence_parallel' ({sequence}) does not compose with {what}")


def _validate_distillation(cfg: Config) -> None:
    from vlrft.algo.distill import DISTILL_MODES

    distill, teacher = cfg.algo.distill, cfg.teacher
    if not teacher.enabled():
        if distill != DistillConfig() or teacher != TeacherConfig():
            raise ConfigError("config keys 'algo.distill.*' and 'teacher.*' apply to on-policy distillation: "
                              "set teacher.path or teacher.url")
        return
    if distill.mode not in DISTILL_MODES:
        raise ConfigError(f"config key 'algo.distill.mode' is '{distill.mode}'; valid: {', '.join(DISTILL_MODES)}")
    if not distill.coef > 0:
        raise ConfigError(f"config key 'algo.distill.coef' must be > 0, got {distill.coef}")
    _validate_top_k_distillation(cfg)
    if teacher.compute_dtype not in ("", "float32", "bfloat16"):
        raise ConfigError(f"config key 'teacher.compute_dtype' is '{teacher.compute_dtype}'; valid: float32, bfloat16 "
                          "(empty: model.compute_dtype)")
    _validate_remote_teacher(teacher)


def _validate_top_k_distillation(cfg: Config) -> None:
    """algo.distill.mode jsd: its keys in range, a head that gives every top-k token's logprob."""
    from vlrft.algo.distill import MAX_TOP_K, MIN_TOP_K

    distill = cfg.algo.distill
    if distill.mode != "jsd":
        if changed := _changed_key(distill, ("top_k", "beta")):
            raise ConfigError(f"config key 'algo.distill.{changed}' applies to algo.distill.mode jsd")
        return
    if not MIN_TOP_K <= distill.top_k <= MAX_TOP_K:
        raise ConfigError(f"config key 'algo.distill.top_k' must be in {MIN_TOP_K}..{MAX_TOP_K} (renormalised on one "
                          f"token, both distributions are the same), got {distill.top_k}")
    if not 0.0 <= distill.beta <= 1.0:
        raise ConfigError(f"config key 'algo.distill.beta' must be in [0, 1], got {distill.beta}")
    if cfg.teacher.url:
        raise ConfigError("config key 'algo.distill.mode' jsd needs a local teacher (teacher.path): a teacher server "
                          "answers the sampled tokens' logprobs only")
    if cfg.model.fused_head == "liger":
        raise ConfigError("config key 'algo.distill.mode' jsd needs the student's logprob of every top-k token, which "
                          "model.fused_head liger does not give: use model.fused_head auto or chunked")


def _changed_key(section, keys: tuple[str, ...]) -> str | None:
    """The first of `keys` that a config `section` (a dataclass) sets away from its default."""
    defaults = type(section)()
    return next((key for key in keys if getattr(section, key) != getattr(defaults, key)), None)


def _validate_remote_teacher(teacher: TeacherConfig) -> None:
    """teacher.url: an http(s) URL instead of teacher.path; its client's keys only with it."""
    remote_keys = ("token_file", "timeout_s", "retries", "deadline_s")
    if not teacher.url:
        if changed := _changed_key(teacher, remote_keys):
            raise ConfigError(f"config key 'teacher.{changed}' applies to a remote teacher: set teacher.url")
        return
    if teacher.path:
        raise ConfigError("config keys 'teacher.path' and 'teacher.url' are both set: give one (a local or a remote teacher)")
    if teacher.compute_dtype:
        raise ConfigError("config key 'teacher.compute_dtype' applies to a local teacher (teacher.path); "
                          "a remote teacher's is its server's --compute-dtype")
    scheme, _, rest = teacher.url.partition("://")
    if scheme not in ("http", "https") or not rest.strip("/"):
        raise ConfigError(f"config key 'teacher.url' must be an http:// or https:// URL, got {teacher.url!r:.80}")
    if not (teacher.timeout_s > 0 and teacher.deadline_s > 0 and teacher.retries >= 0):
        raise ConfigError("config keys 'teacher.timeout_s' and 'teacher.deadline_s' must be > 0, "
                          "'teacher.retries' >= 0")


def _validate_rewards(reward: RewardConfig, unsafe_no_isolation: bool, teacher: bool = False) -> None:
    from vlrft.rewards.loading import resolve_recipe  # imports the recipes: unknown names fail here
    from vlrft.isolation.sandbox import check_can_run_code, runs_code

    for source, mix in {"default": reward.default, **reward.by_data_source}.items():
        if not mix and not (teacher and source == "default"):  # a teacher alone: pure distillation
            raise ConfigError(f"reward mix '{source}' is empty; give at least one recipe (or a teacher: teacher.path or teacher.url)")
        names = set()
        for spec in mix:
            if not spec.recipe:
                raise ConfigError(f"a recipe in reward mix '{source}' has no 'recipe' name")
            recipe = resolve_recipe(spec.recipe)
            missing_package(spec.recipe, recipe)
            if runs_code(recipe):
                check_can_run_code(f"reward recipe '{spec.recipe}'", unsafe_no_isolation)
            if spec.timeout_s <= 0:
                raise ConfigError(f"reward recipe '{spec.recipe}' in mix '{source}': timeout_s must be > 0")
            name = component_name(spec)
            if name in names:
                raise ConfigError(f"reward mix '{source}' uses component name '{name}' twice; give each a distinct 'name'")
            names.add(name)
    missing_package(reward.accuracy_recipe, resolve_recipe(reward.accuracy_recipe))


def _validate_rollout_correction(cfg: Config, need) -> None:
    from vlrft.algo.correction import ROLLOUT_CORRECTIONS

    algo = cfg.algo
    need(algo.rollout_correction in ("auto", *ROLLOUT_CORRECTIONS),
         f"config key 'algo.rollout_correction' is '{algo.rollout_correction}'; valid: auto, {', '.join(ROLLOUT_CORRECTIONS)}")
    mode = rollout_correction_mode(cfg)
    need(algo.rollout_correction_cap >= 1, f"config key 'algo.rollout_correction_cap' must be >= 1, got {algo.rollout_correction_cap}")
    need(0 < algo.rollout_correction_low <= 1 <= algo.rollout_correction_high,
         "config keys 'algo.rollout_correction_low' / '_high' must satisfy 0 < low <= 1 <= high")
    default = AlgoConfig()
    need(algo.rollout_correction_cap == default.rollout_correction_cap or mode == "tis",
         f"config key 'algo.rollout_correction_cap' applies to rollout_correction tis, not '{mode}'")
    need(mode != "behaviour" or cfg.rollout.top_p == 1.0,
         "algo.rollout_correction behaviour needs rollout.top_p 1: under top-p the engine's logprobs are of the nucleus "
         "alone, so the ratio against them sits below 1 even on-policy (use tis)")
    band = (algo.rollout_correction_low, algo.rollout_correction_high)
    need(band == (default.rollout_correction_low, default.rollout_correction_high) or mode in ("mis", "icepop"),
         f"config keys 'algo.rollout_correction_low' / '_high' apply to rollout_correction mis and icepop, not '{mode}'")


def missing_package(name: str, recipe) -> None:
    """A recipe may declare the modules it imports at call time as `recipe.requires = {module:
    install hint}`; a missing one fails here, at config load, instead of on every call."""
    for module, hint in getattr(recipe, "requires", {}).items():
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"reward recipe '{name}' needs the {module} module, which is not installed: {hint}")


def _validate_algo(cfg: Config) -> None:
    from vlrft.algo import GROUP_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES
    from vlrft.algo.kl import FULL_KL
    from vlrft.algo.value import VALUE_NORMS

    algo, kl, critic, rollout = cfg.algo, cfg.algo.kl, cfg.critic, cfg.rollout

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(algo.loss_agg_mode in LOSS_AGG_MODES,
         f"config key 'algo.loss_agg_mode' is '{algo.loss_agg_mode}'; valid: {', '.join(LOSS_AGG_MODES)}")
    need(algo.advantage not in GROUP_ESTIMATORS or rollout.n_samples_per_prompt >= 2,
         f"algo.advantage '{algo.advantage}' compares responses within a group: "
         "rollout.n_samples_per_prompt must be >= 2")
    need(not rollout.dynamic_sampling or rollout.n_samples_per_prompt >= 2,
         "rollout.dynamic_sampling drops groups whose rewards are all equal: rollout.n_samples_per_prompt must be >= 2")
    need(rollout.generation_size == 0 or rollout.generation_size >= rollout.n_samples_per_prompt,
         f"config key 'rollout.generation_size' ({rollout.generation_size}) must be 0 or >= "
         f"rollout.n_samples_per_prompt ({rollout.n_samples_per_prompt})")
    need(0 <= algo.high_entropy_token_ratio <= 1,
         f"config key 'algo.high_entropy_token_ratio' must be in [0, 1], got {algo.high_entropy_token_ratio}")
    need(0 <= algo.kl_cov_ratio <= 1, f"config key 'algo.kl_cov_ratio' must be in [0, 1], got {algo.kl_cov_ratio}")
    need(algo.kl_cov_coef > 0, f"config key 'algo.kl_cov_coef' must be > 0, got {algo.kl_cov_coef}")
    for key in ("reward_clip", "zero_reward_patience", "advantage_clip", "early_stop_ratio", "target_kl",
                "ptx_coef", "moe_aux_coef"):
        need(getattr(algo, key) >= 0, f"config key 'algo.{key}' must be >= 0, got {getattr(algo, key)}")
    need(algo.dual_clip_c == 0 or algo.dual_clip_c > 1,
         f"config key 'algo.dual_clip_c' must be 0 (off) or > 1, got {algo.dual_clip_c}")
    need(algo.dual_clip_c == 0 or algo.policy_loss in ("ppo", "gspo"),
         f"config key 'algo.dual_clip_c' applies to policy_loss ppo and gspo, not '{algo.policy_loss}'")
    _validate_rollout_correction(cfg, need)
    need(algo.sapo_tau_pos > 0 and algo.sapo_tau_neg > 0,
         "config keys 'algo.sapo_tau_pos' and 'algo.sapo_tau_neg' must be > 0")
    default = AlgoConfig()
    need((algo.sapo_tau_pos, algo.sapo_tau_neg) == (default.sapo_tau_pos, default.sapo_tau_neg) or algo.policy_loss == "sapo",
         f"config keys 'algo.sapo_tau_pos' / 'algo.sapo_tau_neg' apply to policy_loss sapo, not '{algo.policy_loss}'")
    need(algo.scale_by_std or algo.advantage == "grpo",
         f"config key 'algo.scale_by_std: false' applies to grpo only, not '{algo.advantage}'")
    need(algo.whiten_advantages or algo.advantage == "gae",
         f"config key 'algo.whiten_advantages: false' applies to gae only, not '{algo.advantage}'")
    need(0 <= algo.gamma <= 1 and 0 <= algo.lam <= 1, "config keys 'algo.gamma' and 'algo.lam' must be in [0, 1]")
    # KL
    valid_kl = [*KL_ESTIMATORS.names(), FULL_KL, "auto"]
    need(kl.estimator in valid_kl,
         f"config key 'algo.kl.estimator': unknown KL estimator '{kl.estimator}'; valid: {', '.join(valid_kl)}")
    need(kl.placement in ("loss", "reward"), f"config key 'algo.kl.placement' must be loss or reward, got '{kl.placement}'")
    need(kl.coef >= 0 and kl.target >= 0, "config keys 'algo.kl.coef' and 'algo.kl.target' must be >= 0")
    need(0 <= kl.ref_ema_eta <= 1, f"config key 'algo.kl.ref_ema_eta' must be in [0, 1], got {kl.ref_ema_eta}")
    need(kl.ref_ema_eta == 0 or cfg.model.lora.rank == 0,
         "config key 'algo.kl.ref_ema_eta' cannot be combined with model.lora: the reference is the base model itself")
    need(kl.coef > 0 or (kl.target == 0 and kl.ref_ema_eta == 0),
         "config keys 'algo.kl.target' and 'algo.kl.ref_ema_eta' need a reference model: set algo.kl.coef > 0")
    # Critic
    need(critic.enabled == (algo.advantage == "gae"),
         "algo.advantage 'gae' needs a critic (critic.enabled: true)" if algo.advantage == "gae"
         else f"critic.enabled: true is only used by algo.advantage 'gae', not '{algo.advantage}'")
    need(critic.value_norm in VALUE_NORMS,
         f"config key 'critic.value_norm' is '{critic.value_norm}'; valid: {', '.join(VALUE_NORMS)}")
    need(0 < critic.value_norm_beta < 1, "config key 'critic.value_norm_beta' must be in (0, 1)")
    need(critic.freeze_actor_steps >= 0 and critic.value_clip >= 0,
         "config keys 'critic.freeze_actor_steps' and 'critic.value_clip' must be >= 0")
    need(0 <= cfg.train.ema_beta < 1, f"config key 'train.ema_beta' must be in [0, 1), got {cfg.train.ema_beta}")
    need((algo.ptx_coef > 0) == bool(cfg.data.ptx_path),
         "config keys 'algo.ptx_coef' (> 0) and 'data.ptx_path' go together: set both or neither")


def check_world_size(cfg: Config, world_size: int, ranks_per_node: int | None = None) -> None:
    """Checks that need the launch's shape (at start, before models load)."""
    sequence = cfg.train.sequence_parallel
    if sequence > 1 and world_size % sequence:
        raise ConfigError(f"config key 'train.sequence_parallel' ({sequence}) must divide the number of ranks ({world_size})")
    if sequence > 1 and ranks_per_node is not None and ranks_per_node % sequence:
        # Groups are consecutive ranks: one spanning nodes would run its exchanges between them.
        raise ConfigError(f"config key 'train.sequence_parallel' ({sequence}) must divide the ranks per node "
                          f"({ranks_per_node}): a group's two exchanges per attention layer stay within a node")
    if cfg.train.mode == "async":
        rollout_ranks = cfg.rollout.ranks
        if rollout_ranks >= world_size:
            raise ConfigError(
                f"config key 'rollout.ranks' ({rollout_ranks}) must leave ranks to train: the run has {world_size}"
            )
        if cfg.rollout.rollout_prompts % rollout_ranks:
            raise ConfigError(
                f"rollout.rollout_prompts ({cfg.rollout.rollout_prompts}) must be divisible by rollout.ranks ({rollout_ranks})"
            )
        tp, trainers = cfg.rollout.engine_tp_size, world_size - rollout_ranks
        if rollout_ranks % tp:
            raise ConfigError(f"config key 'rollout.engine_tp_size' ({tp}) must divide rollout.ranks ({rollout_ranks})")
        if ranks_per_node is not None and ranks_per_node < world_size and (ranks_per_node % tp or trainers % tp):
            # The trainers take the first ranks, so the rollout ranks' groups start at rank `trainers`.
            raise ConfigError(
                f"config key 'rollout.engine_tp_size' ({tp}) must divide the ranks per node ({ranks_per_node}) and the "
                f"trainer ranks ({trainers}): a tensor-parallel engine group cannot span nodes"
            )
        return
    if cfg.rollout.rollout_prompts % world_size:
        raise ConfigError(
            f"rollout.rollout_prompts ({cfg.rollout.rollout_prompts}) must be divisible by the world size ({world_size})"
        )
    tp = cfg.rollout.engine_tp_size
    if world_size % tp:
        raise ConfigError(f"config key 'rollout.engine_tp_size' ({tp}) must divide the number of ranks ({world_size})")
    if ranks_per_node is not None and ranks_per_node % tp:
        # Groups are consecutive ranks and torchrun numbers ranks node by node: a group fits in
        # a node exactly when the size divides the ranks per node.
        raise ConfigError(
            f"config key 'rollout.engine_tp_size' ({tp}) must divide the ranks per node ({ranks_per_node}): "
            "a tensor-parallel engine group cannot span nodes"
        )
