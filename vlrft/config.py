"""Config tree: dataclasses, YAML loading, dotted CLI overrides, strict validation.

Every field here is read somewhere in the loop; an unknown key is an error naming the valid
keys, so a typo can never silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


LR_SCHEDULES = ("constant", "cosine")


class ConfigError(ValueError):
    """A user-caused configuration problem; the message is one line naming the culprit."""


@dataclass
class ModelConfig:
    path: str = ""  # HF checkpoint directory of the policy (loaded with from_pretrained)
    ref_path: str = ""  # reference model checkpoint; empty = same as `path`


@dataclass
class DataConfig:
    train_path: str = ""  # JSONL in the canonical row schema
    eval_path: str = ""  # held-out JSONL; empty = no evaluation
    min_pixels: int = 56 * 56  # images are resized into [min_pixels, max_pixels]
    max_pixels: int = 112 * 112
    max_prompt_tokens: int = 1024  # longer prompts are rejected naming the row


@dataclass
class RolloutConfig:
    engine: str = "hf"  # rollout engine name (hf)
    rollout_prompts: int = 16  # prompts per step, global over all ranks
    n_samples_per_prompt: int = 8  # responses per prompt (the GRPO group size)
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class KLConfig:
    coef: float = 0.0  # beta; 0 disables the KL term (and the reference model)
    estimator: str = "k3"  # k1 | k2 | k3 | abs


@dataclass
class AlgoConfig:
    advantage: str = "grpo"  # advantage estimator: grpo | rloo
    scale_by_std: bool = True  # grpo only; false = Dr.GRPO (r - group mean)
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
    # Stop with an error after this many consecutive steps whose rewards were all exactly 0.
    zero_reward_patience: int = 0  # 0 = never
    entropy_coef: float = 0.0  # entropy bonus: loss -= coef * agg(H)
    # Keep only the top fraction of tokens by entropy in the policy-gradient term (0 = off).
    high_entropy_token_ratio: float = 0.0


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
    seed: int = 0


@dataclass
class RecipeSpec:
    recipe: str = ""  # registry name, "pkg.mod:fn" or "path/to/file.py:fn"
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)


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
    dir: str = "runs/default"  # metrics.jsonl, final/ HF checkpoint


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


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
    cfg.output.dir = resolve(cfg.output.dir)


def validate(cfg: Config) -> None:
    """Cross-field checks that a single field's type cannot express."""
    from vlrft.algo import ADVANTAGES, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, GROUP_ESTIMATORS
    from vlrft.engines import ENGINES

    if not cfg.model.path:
        raise ConfigError("config key 'model.path' is required (an HF checkpoint directory)")
    if not cfg.data.train_path:
        raise ConfigError("config key 'data.train_path' is required (a JSONL file)")
    ADVANTAGES.check(cfg.algo.advantage, "algo.advantage")
    POLICY_LOSSES.check(cfg.algo.policy_loss, "algo.policy_loss")
    KL_ESTIMATORS.check(cfg.algo.kl.estimator, "algo.kl.estimator")
    ENGINES.check(cfg.rollout.engine, "rollout.engine")
    if cfg.algo.loss_agg_mode not in LOSS_AGG_MODES:
        raise ConfigError(
            f"config key 'algo.loss_agg_mode' is '{cfg.algo.loss_agg_mode}'; valid: {', '.join(LOSS_AGG_MODES)}"
        )
    if cfg.algo.advantage in GROUP_ESTIMATORS and cfg.rollout.n_samples_per_prompt < 2:
        raise ConfigError(
            f"algo.advantage '{cfg.algo.advantage}' compares responses within a group: "
            "rollout.n_samples_per_prompt must be >= 2"
        )
    if not 0 <= cfg.algo.high_entropy_token_ratio <= 1:
        raise ConfigError(
            f"config key 'algo.high_entropy_token_ratio' must be in [0, 1], got {cfg.algo.high_entropy_token_ratio}"
        )
    if cfg.algo.reward_clip < 0 or cfg.algo.zero_reward_patience < 0:
        raise ConfigError("config keys 'algo.reward_clip' and 'algo.zero_reward_patience' must be >= 0")
    if cfg.algo.dual_clip_c != 0 and cfg.algo.dual_clip_c <= 1:
        raise ConfigError(f"config key 'algo.dual_clip_c' must be 0 (off) or > 1, got {cfg.algo.dual_clip_c}")
    if not cfg.algo.scale_by_std and cfg.algo.advantage != "grpo":
        raise ConfigError(f"config key 'algo.scale_by_std: false' applies to grpo only, not '{cfg.algo.advantage}'")
    if cfg.train.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"config key 'train.lr_schedule' is '{cfg.train.lr_schedule}'; valid: {', '.join(LR_SCHEDULES)}")
    if cfg.train.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"config key 'train.zero_stage' must be 0, 1, 2 or 3, got {cfg.train.zero_stage}")
    positive = {
        "rollout.rollout_prompts": cfg.rollout.rollout_prompts,
        "rollout.max_new_tokens": cfg.rollout.max_new_tokens,
        "train.total_steps": cfg.train.total_steps,
        "train.ppo_epochs": cfg.train.ppo_epochs,
        "train.micro_batch_tokens": cfg.train.micro_batch_tokens,
        "data.max_prompt_tokens": cfg.data.max_prompt_tokens,
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
    for source, mix in {"default": cfg.reward.default, **cfg.reward.by_data_source}.items():
        if not mix:
            raise ConfigError(f"reward mix '{source}' is empty; give at least one recipe")
        for spec in mix:
            if not spec.recipe:
                raise ConfigError(f"a recipe in reward mix '{source}' has no 'recipe' name")


def check_world_size(cfg: Config, world_size: int) -> None:
    if cfg.rollout.rollout_prompts % world_size:
        raise ConfigError(
            f"rollout.rollout_prompts ({cfg.rollout.rollout_prompts}) must be divisible by the world size ({world_size})"
        )


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)

