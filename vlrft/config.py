"""Config tree: dataclasses, YAML loading, dotted CLI overrides, strict validation.

Every field here is read somewhere in the loop; an unknown key is an error naming the valid
keys, so a typo can never silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


LR_SCHEDULES = ("constant", "cosine")
OFFLOAD_CHOICES = ("none", "optimizer", "all")
ON_BAD_SAMPLE = ("error", "skip")


class ConfigError(ValueError):
    """A user-caused configuration problem; the message is one line naming the culprit."""


@dataclass
class ModelConfig:
    path: str = ""  # HF checkpoint directory of the policy (loaded with from_pretrained)
    ref_path: str = ""  # reference model checkpoint; empty = same as `path`
    freeze_vision: bool = False  # train without updating the vision tower (policy and critic)
    # How packed samples are kept apart in attention: auto | sdpa (block-diagonal mask) |
    # flash_attention_2 (varlen kernel; CUDA + flash-attn + bfloat16) | torch_varlen (PyTorch's
    # built-in varlen FlashAttention; CUDA + torch >= 2.10 + bfloat16). See models/attention.py.
    attention: str = "auto"
    # Decoder compute precision for policy, reference and critic forwards: float32 | bfloat16
    # (autocast over fp32 master weights; LM head, logprobs and value head stay fp32).
    compute_dtype: str = "float32"
    # Recompute each decoder layer's activations in backward instead of keeping them (policy and
    # critic): activation memory of one layer instead of all, for ~30% more update compute.
    gradient_checkpointing: bool = False


@dataclass
class DataConfig:
    train_path: str = ""  # JSONL in the canonical row schema
    eval_path: str = ""  # held-out JSONL; empty = no evaluation
    min_pixels: int = 56 * 56  # images are resized into [min_pixels, max_pixels]
    max_pixels: int = 112 * 112
    max_prompt_tokens: int = 1024  # longer prompts are rejected naming the row
    # Supervised rows (canonical schema; `answer` is the target response) mixed into the actor
    # update with algo.ptx_coef; empty = no PTX term.
    ptx_path: str = ""
    ptx_rows_per_step: int = 8  # PTX rows per optimizer step, per rank
    # A bad row (load time) or prompt (encoding: unreadable image, too long): `error` stops the
    # run naming it; `skip` drops it with a one-line note and counts it (README, "Bad input").
    on_bad_sample: str = "error"


@dataclass
class RolloutConfig:
    engine: str = "hf"  # rollout engine: hf (HF generate, CPU default) | vllm (colocated vLLM)
    engine_tp_size: int = 1  # vllm: consecutive ranks per tensor-parallel engine; divides the world size
    # vllm: fraction of accelerator memory (CPU backend: of RAM) the engine may take for weights
    # and KV cache; its name on the vLLM side is gpu_memory_utilization.
    vllm_memory_fraction: float = 0.5
    rollout_prompts: int = 16  # prompts per step, global over all ranks
    n_samples_per_prompt: int = 8  # responses per prompt (the GRPO group size)
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    # Best-of-n: generate this many responses per prompt and keep the n_samples_per_prompt
    # highest-reward ones (AReaL). 0 = generate exactly n_samples_per_prompt.
    generation_size: int = 0
    # DAPO dynamic sampling: drop groups whose rewards are all equal, and sample more prompts
    # until rollout_prompts groups are kept or max_sampling_rounds rounds were generated.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3


@dataclass
class KLConfig:
    coef: float = 0.0  # beta (initial value when adaptive); 0 disables KL and the reference model
    estimator: str = "auto"  # k1 | k2 | k3 | abs | full; auto = k1 in the reward, k3 in the loss
    placement: str = "loss"  # loss: beta * agg(kl) added to the loss; reward: r_t -= beta * kl_t
    target: float = 0.0  # adaptive controller's target KL per sequence; 0 = fixed beta
    horizon: int = 10000  # adaptive controller's horizon (in sequences)
    ref_ema_eta: float = 0.0  # after each update: ref <- (1 - eta) ref + eta policy; 0 = frozen ref


@dataclass
class AlgoConfig:
    advantage: str = "grpo"  # grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae
    scale_by_std: bool = True  # grpo only; false = Dr.GRPO (r - group mean)
    gamma: float = 1.0  # discount (reinforce_pp, gae)
    lam: float = 0.95  # GAE lambda
    whiten_advantages: bool = True  # gae only: whiten advantages over the global batch
    advantage_clip: float = 0.0  # clamp advantages to +-clip after estimation; 0 = off
    policy_loss: str = "ppo"  # policy loss: ppo | gspo
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # > clip_eps_low = DAPO's clip-higher
    dual_clip_c: float = 0.0  # dual-clip bound for A < 0 (0 = off, else > 1)
    loss_agg_mode: str = "token-mean"
    kl: KLConfig = field(default_factory=KLConfig)
    # Reward transform before advantages: clip((r - reward_bias) * reward_scale, +-reward_clip).
    reward_bias: float = 0.0
    reward_scale: float = 1.0
    reward_clip: float = 0.0  # 0 = no clipping
    zero_reward_truncated: bool = False  # responses without a stop token get reward 0
    mask_truncated: bool = False  # responses without a stop token are left out of the loss
    # Stop with an error after this many consecutive steps whose rewards were all exactly 0.
    zero_reward_patience: int = 0  # 0 = never
    entropy_coef: float = 0.0  # entropy bonus: loss -= coef * agg(H)
    # Keep only the top fraction of tokens by entropy in the policy-gradient term (0 = off).
    high_entropy_token_ratio: float = 0.0
    # Stop the remaining ppo_epochs of a step when the mean importance ratio (AReaL) or the
    # approximate KL 0.5*(logp - old)^2 (TRL) to the rollout policy exceeds these; 0 = off.
    early_stop_ratio: float = 0.0
    target_kl: float = 0.0
    ptx_coef: float = 0.0  # weight of the supervised NLL on data.ptx_path rows
    moe_aux_coef: float = 0.0  # weight of the MoE router's load-balancing loss (MoE models only)


@dataclass
class CriticConfig:
    enabled: bool = False  # a value model for PPO with GAE (algo.advantage: gae)
    path: str = ""  # HF checkpoint for the critic's backbone; empty = the policy's
    lr: float = 1e-4
    value_clip: float = 0.2  # clip of V around the rollout-time value; 0 = unclipped
    value_norm: str = "none"  # none | exp | ma: the critic predicts normalised returns (AReaL)
    value_norm_beta: float = 0.99995  # decay of the `exp` running statistics
    freeze_actor_steps: int = 0  # the first N steps update only the critic (warm-up)


@dataclass
class TrainConfig:
    total_steps: int = 50  # RL steps (one rollout batch each)
    ppo_epochs: int = 1  # passes over each rollout batch
    lr: float = 1e-4
    lr_schedule: str = "constant"  # constant | cosine (decays to 10% of lr over all optimizer steps)
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # global grad-norm clip; 0 disables
    micro_batch_tokens: int = 4096  # token budget of one forward micro-batch
    zero_stage: int = 2  # DeepSpeed ZeRO stage: 0, 2 or 3
    # CPU offload (DeepSpeed): none | optimizer (Adam states + fp32 master weights in CPU memory,
    # stage >= 1) | all (parameters too, stage 3). Trades step time for GPU memory.
    offload: str = "none"
    seed: int = 0
    # Keep an EMA copy of the policy (ema <- beta ema + (1 - beta) policy) for evaluation and
    # export to final_ema/; 0 = off.
    ema_beta: float = 0.0


@dataclass
class RecipeSpec:
    recipe: str = ""  # built-in or plugin name, "pkg.mod:fn" or "path/to/file.py:fn"
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)
    name: str = ""  # component name in metrics; empty = the recipe's function name
    timeout_s: float = 60.0  # a call still running after this fails (the loop goes on)
    fallback: float | None = None  # score of every completion of a failed call; None = not applicable


@dataclass
class RewardConfig:
    # Mix used for rows whose data_source has no entry in `by_data_source`.
    default: list[RecipeSpec] = field(default_factory=lambda: [RecipeSpec(recipe="exact_match")])
    by_data_source: dict[str, list[RecipeSpec]] = field(default_factory=dict)
    # The recipe whose score counts as "correct" in eval/accuracy.
    accuracy_recipe: str = "exact_match"


@dataclass
class EvalConfig:
    every_steps: int = 10  # evaluate at step 0, every N steps and at the end; 0 = never
    max_prompts: int = 200  # held-out prompts used (first N rows)


@dataclass
class OutputConfig:
    dir: str = "runs/default"  # metrics.jsonl, final/ HF checkpoint, trajectories/, report.html


@dataclass
class TrajectoryConfig:
    # Save every N-th step's scored responses (and the last step's) to output.dir/trajectories/
    # and write report.html at the end; 0 = off.
    save_every: int = 0


@dataclass
class CheckpointConfig:
    # Save every N steps (and always on SIGTERM/SIGINT) to output.dir/checkpoints; 0 = only on a signal.
    save_steps: int = 0
    keep_last: int = 2  # finished checkpoints kept (older ones are deleted after a new one lands)
    resume: str = "auto"  # auto: the run dir's newest checkpoint, if any | never | a checkpoint path


# Not "off": YAML reads an unquoted off as the boolean false.
WANDB_MODES = ("disabled", "offline", "online")


@dataclass
class LoggingConfig:
    wandb: str = "disabled"  # disabled | offline (no account, files under output.dir/wandb) | online
    wandb_project: str = "vlrft"
    tensorboard: bool = False  # event files under output.dir/tensorboard


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    trajectory: TrajectoryConfig = field(default_factory=TrajectoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def _build(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a plain dict, rejecting unknown keys by name."""
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{where or 'root'}' must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(f"unknown config key '{key}'; valid keys here: {', '.join(names)}")
    kwargs = {k: _convert(hints[k], v, f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # only `X | None` is used
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return None if value is None else _convert(inner, value, where)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{where}' must be a list")
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(hint) or (str, Any)
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{where}' must be a mapping")
        return {k: _convert(item, v, f"{where}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # PyYAML reads "1e-3" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    wrong_scalar = hint in (int, float, str, bool) and not isinstance(value, hint)
    if wrong_scalar or (hint in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"config key '{where}' must be {hint.__name__}, got {value!r}")
    return value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a raw config dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.key=value")
        dotted, text = item.split("=", 1)
        node = raw
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{dotted}': '{part}' is not a section")
        node[parts[-1]] = yaml.safe_load(text)
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Load a YAML config, apply dotted overrides, validate, and resolve relative paths."""
    raw: dict = {}
    base = Path.cwd()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        raw = yaml.safe_load(path.read_text()) or {}
        base = path.resolve().parent
    raw = apply_overrides(raw, list(overrides))
    cfg = _build(Config, raw, "")
    _resolve_paths(cfg, base)
    validate(cfg)
    return cfg


def _resolve_paths(cfg: Config, base: Path) -> None:
    """Paths in a config file are relative to that file, so examples run from anywhere."""
    def resolve(p: str) -> str:
        return str((base / p).resolve()) if p and not Path(p).is_absolute() else p

    cfg.model.path = resolve(cfg.model.path)
    cfg.model.ref_path = resolve(cfg.model.ref_path)
    cfg.data.train_path = resolve(cfg.data.train_path)
    cfg.data.eval_path = resolve(cfg.data.eval_path)
    cfg.data.ptx_path = resolve(cfg.data.ptx_path)
    cfg.critic.path = resolve(cfg.critic.path)
    cfg.output.dir = resolve(cfg.output.dir)
    if cfg.checkpoint.resume not in ("auto", "never"):
        cfg.checkpoint.resume = resolve(cfg.checkpoint.resume)


def _validate_model(model: ModelConfig, zero_stage: int) -> None:
    from vlrft.models.attention import precision_config_problem

    problem = precision_config_problem(model.attention, model.compute_dtype, zero_stage)
    if problem:
        raise ConfigError(problem)


def validate(cfg: Config) -> None:
    """Cross-field checks that a single field's type cannot express."""
    from vlrft.algo import ADVANTAGES, POLICY_LOSSES
    from vlrft.engines import ENGINES

    if not cfg.model.path:
        raise ConfigError("config key 'model.path' is required (an HF checkpoint directory)")
    if not cfg.data.train_path:
        raise ConfigError("config key 'data.train_path' is required (a JSONL file)")
    ADVANTAGES.check(cfg.algo.advantage, "algo.advantage")
    POLICY_LOSSES.check(cfg.algo.policy_loss, "algo.policy_loss")
    _validate_algo(cfg)
    _validate_model(cfg.model, cfg.train.zero_stage)
    ENGINES.check(cfg.rollout.engine, "rollout.engine")
    if cfg.rollout.engine_tp_size < 1:
        raise ConfigError(f"config key 'rollout.engine_tp_size' must be >= 1, got {cfg.rollout.engine_tp_size}")
    if cfg.rollout.engine != "vllm" and cfg.rollout.engine_tp_size != 1:
        raise ConfigError("config key 'rollout.engine_tp_size' applies to rollout.engine 'vllm' only")
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
    if cfg.trajectory.save_every < 0:
        raise ConfigError(f"config key 'trajectory.save_every' must be >= 0 (0 = off), got {cfg.trajectory.save_every}")
    if not 0 < cfg.rollout.vllm_memory_fraction <= 1:
        raise ConfigError(f"config key 'rollout.vllm_memory_fraction' must be in (0, 1], got {cfg.rollout.vllm_memory_fraction}")
    if cfg.train.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"config key 'train.lr_schedule' is '{cfg.train.lr_schedule}'; valid: {', '.join(LR_SCHEDULES)}")
    if cfg.train.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"config key 'train.zero_stage' must be 0, 1, 2 or 3, got {cfg.train.zero_stage}")
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
        "train.micro_batch_tokens": cfg.train.micro_batch_tokens,
        "data.max_prompt_tokens": cfg.data.max_prompt_tokens,
        "data.ptx_rows_per_step": cfg.data.ptx_rows_per_step,
        "rollout.max_sampling_rounds": cfg.rollout.max_sampling_rounds,
        "algo.kl.horizon": cfg.algo.kl.horizon,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {value}")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"config key 'rollout.top_p' must be in (0, 1], got {cfg.rollout.top_p}")
    if cfg.rollout.temperature <= 0:
        raise ConfigError("config key 'rollout.temperature' must be > 0 (evaluation is greedy on its own)")
    if cfg.data.min_pixels > cfg.data.max_pixels:
        raise ConfigError("config key 'data.min_pixels' must be <= 'data.max_pixels'")
    if cfg.data.on_bad_sample not in ON_BAD_SAMPLE:
        raise ConfigError(f"config key 'data.on_bad_sample' is '{cfg.data.on_bad_sample}'; valid: {', '.join(ON_BAD_SAMPLE)}")
    _validate_rewards(cfg.reward)


def _validate_rewards(reward: RewardConfig) -> None:
    from vlrft.rewards.loading import resolve_recipe  # imports the recipes: unknown names fail here

    for source, mix in {"default": reward.default, **reward.by_data_source}.items():
        if not mix:
            raise ConfigError(f"reward mix '{source}' is empty; give at least one recipe")
        names = set()
        for spec in mix:
            if not spec.recipe:
                raise ConfigError(f"a recipe in reward mix '{source}' has no 'recipe' name")
            resolve_recipe(spec.recipe)
            if spec.timeout_s <= 0:
                raise ConfigError(f"reward recipe '{spec.recipe}' in mix '{source}': timeout_s must be > 0")
            name = component_name(spec)
            if name in names:
                raise ConfigError(f"reward mix '{source}' uses component name '{name}' twice; give each a distinct 'name'")
            names.add(name)
    resolve_recipe(reward.accuracy_recipe)


def component_name(spec: RecipeSpec) -> str:
    """A recipe's name in metrics: its `name`, else the function part of its recipe string."""
    return spec.name or (spec.recipe.rpartition(":")[2] if ":" in spec.recipe else spec.recipe)


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
    for key in ("reward_clip", "zero_reward_patience", "advantage_clip", "early_stop_ratio", "target_kl",
                "ptx_coef", "moe_aux_coef"):
        need(getattr(algo, key) >= 0, f"config key 'algo.{key}' must be >= 0, got {getattr(algo, key)}")
    need(algo.dual_clip_c == 0 or algo.dual_clip_c > 1,
         f"config key 'algo.dual_clip_c' must be 0 (off) or > 1, got {algo.dual_clip_c}")
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


def kl_estimator_name(kl: KLConfig) -> str:
    """The estimator actually used: `auto` is k1 in the reward and k3 in the loss (ALGORITHMS.md)."""
    if kl.estimator != "auto":
        return kl.estimator
    return "k1" if kl.placement == "reward" else "k3"


def check_world_size(cfg: Config, world_size: int, ranks_per_node: int | None = None) -> None:
    """Checks that need the launch's shape (at start, before models load)."""
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


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)

