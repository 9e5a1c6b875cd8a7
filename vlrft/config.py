"""Config tree: dataclasses, YAML loading, dotted CLI overrides, strict validation.

Every field here is read somewhere in the loop; an unknown key is an error naming the valid
keys, so a typo can never silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vlrft.config_paths import origin, resolve_paths
from vlrft.config_safety import GuardsConfig, SandboxConfig  # noqa: F401 (sections of Config, importable from here)
from vlrft.errors import ConfigError  # noqa: F401  (also importable from here)


LR_SCHEDULES = ("constant", "cosine")
OFFLOAD_CHOICES = ("none", "optimizer", "all")
ON_BAD_SAMPLE = ("error", "skip")


# peft's name matching: a linear whose module name ends with one of these gets an adapter.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    # Adapter rank; 0 = full fine-tuning. > 0 trains only LoRA adapters on target_modules (the
    # reference is the base model with adapters off; the engine gets merged weights).
    rank: int = 0
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter input, in the update's forwards only
    # LoRA+: the B matrices learn at train.lr x lr_ratio, the A matrices at train.lr. With B
    # starting at zero, plain LoRA (1) moves the product B·A slowly at first; the LoRA+ paper
    # suggests 16.
    lr_ratio: float = 1.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))


@dataclass
class ModelConfig:
    path: str = ""  # policy: an HF checkpoint directory, or a hub model id (owner/name; models/hub.py)
    ref_path: str = ""  # reference model checkpoint; empty = same as `path`
    freeze_vision: bool = False  # train without updating the vision tower (policy and critic)
    # How packed samples are kept apart in attention: auto | sdpa (block-diagonal mask) |
    # flash_attention_2 (varlen kernel; CUDA + flash-attn + bfloat16) | torch_varlen (PyTorch's
    # built-in varlen FlashAttention; CUDA + torch >= 2.11 + bfloat16). See models/attention.py.
    attention: str = "auto"
    # Decoder compute precision for policy, reference and critic forwards: float32 | bfloat16
    # (autocast over fp32 master weights; LM head, logprobs and value head stay fp32).
    compute_dtype: str = "float32"
    # Recompute each decoder layer's activations in backward instead of keeping them (policy and
    # critic): activation memory of one layer instead of all, for ~30% more update compute.
    gradient_checkpointing: bool = False
    # torch.compile each decoder layer and vision block in place (models/compiled_layers.py):
    # auto (on with CUDA, except under ZeRO-3) | on | off.
    compile: str = field(default="auto", metadata={"on_off": True})
    # The LM head's logprobs and entropy (models/fused_head.py): liger (Liger-Kernel's fused linear
    # head; CUDA, bf16) | chunked (1,024 tokens at a time; everywhere) | auto (liger where its kernel runs).
    fused_head: str = "auto"
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    train_path: str = ""  # JSONL, parquet, or a saved HF data set directory
    eval_path: str = ""  # held-out data set (same forms); empty = no evaluation
    # How rows without "messages" are read (data/columns.py): the prompt (a string or a list of
    # chat messages), the answer (dots reach nested fields), the images (paths or bytes).
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    image_key: str = "images"
    system_prompt: str = ""  # a system message for mapped rows whose prompt has none
    prompt_template: str = "{prompt}"  # a string prompt in context, e.g. "{prompt} Answer in \\boxed{}."
    # Images are resized into [min_pixels, max_pixels] (Qwen-VL: 28 x 28 pixels per visual token).
    min_pixels: int = 56 * 56
    max_pixels: int = 1280 * 28 * 28
    # Video parts (docs/datasets.md, "Video prompts"): at most max_frames frames, evenly spaced over the
    # clip, each resized into [min_pixels, video_max_pixels].
    max_frames: int = 32
    video_max_pixels: int = 128 * 28 * 28
    # A video file's width x height x source frames, read from its header before any frame is
    # decoded; larger files are bad input (2**33: about 2.3 minutes of 1080p at 30 frames a second).
    video_max_decoded_pixels: int = 2**33
    # Seconds one video file may take to decode (a worker process, killed then): the bound that
    # holds when a file's header lies about its frames.
    video_decode_timeout_s: float = 60.0
    max_prompt_tokens: int = 1024  # longer prompts are rejected naming the row
    # Supervised rows (canonical schema; `answer` is the target response) mixed into the actor
    # update with algo.ptx_coef; empty = no PTX term.
    ptx_path: str = ""
    ptx_rows_per_step: int = 8  # PTX rows per optimizer step, per rank
    # A bad row (load time) or prompt (encoding: unreadable image, too long): `error` stops the
    # run naming it; `skip` drops it with a one-line note and counts it (docs/bad_input.md).
    on_bad_sample: str = "error"
    # Media paths in rows must resolve (symlinks followed) inside the data set's directory or one
    # of these (relative to where written: vlrft/config_paths.py); anything else is bad input (docs/datasets.md).
    media_roots: list[str] = field(default_factory=list)
    allow_external_media: bool = False  # lifts that containment, for data one trusts


@dataclass
class RolloutConfig:
    engine: str = "hf"  # rollout engine: hf (HF generate, CPU default) | vllm (colocated vLLM)
    engine_tp_size: int = 1  # vllm: consecutive ranks per tensor-parallel engine; divides the world size
    # hf: dynamic (growing KV cache, stopped responses leave the batch) | static (fixed shapes,
    # StaticCache, the step compiled into CUDA graphs on CUDA) | auto (static on CUDA, else dynamic)
    hf_decode: str = "auto"
    # vllm: fraction of accelerator memory (CPU backend: of RAM) the engine may take for weights
    # and KV cache; its name on the vLLM side is gpu_memory_utilization.
    vllm_memory_fraction: float = 0.5
    rollout_prompts: int = 16  # prompts per step, global over all ranks
    # train.mode async: the last `ranks` ranks run engines and generate; the others train
    # (docs/async.md). 0 with mode sync: every rank does both, one phase after the other.
    ranks: int = 0
    n_samples_per_prompt: int = 8  # responses per prompt (the GRPO group size)
    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    # Best-of-n: generate this many responses per prompt and keep the n_samples_per_prompt
    # highest-reward ones (AReaL). 0 = generate exactly n_samples_per_prompt.
    generation_size: int = 0
    # DAPO dynamic sampling: drop groups whose rewards are all equal, and sample more prompts
    # until rollout_prompts groups are kept or max_sampling_rounds rounds were generated.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    # Multi-turn rollouts (docs/environments.md): an environment answers each turn; "" = one turn.
    # A built-in name (tools), an installed plugin, or "module:Class" / "file.py:Class".
    environment: str = ""
    environment_args: dict = field(default_factory=dict)  # keyword arguments of the environment
    max_turns: int = 4  # turns the policy generates per trajectory at most
    max_trajectory_tokens: int = 2048  # response tokens per trajectory: actions and observations
    environment_timeout_s: float = 30.0  # per reset/step call; a slower call is a counted failure
    # Environment calls per rank that run at the same time (each trajectory's environment has a
    # worker process of its own; an environment that waits, waits once per turn per this many).
    environment_workers: int = 4

    def max_response_tokens(self) -> int:
        """The longest response a rollout can have (loss normaliser, engine context)."""
        return self.max_trajectory_tokens if self.environment else self.max_new_tokens


@dataclass
class KLConfig:
    coef: float = 0.0  # beta (initial value when adaptive); 0 disables KL and the reference model
    estimator: str = "auto"  # k1 | k2 | k3 | abs | full; auto = k1 in the reward, k3 in the loss
    placement: str = "loss"  # loss: beta * agg(kl) added to the loss; reward: r_t -= beta * kl_t
    target: float = 0.0  # adaptive controller's target KL per sequence; 0 = fixed beta
    horizon: int = 10000  # adaptive controller's horizon (in sequences)
    ref_ema_eta: float = 0.0  # after each update: ref <- (1 - eta) ref + eta policy; 0 = frozen ref


@dataclass
class DistillConfig:
    # On-policy distillation (teacher.path set): per token d = log pi_student - log pi_teacher of
    # the sampled token. advantage: -coef * d added to each token's advantage; loss: coef * d^2 / 2
    # added to each token's loss; jsd: coef * the generalised JSD between the teacher's and the
    # student's distributions over the teacher's top_k tokens, added to each token's loss
    # (algo/distill.py).
    mode: str = "advantage"
    coef: float = 1.0
    top_k: int = 20  # jsd: the teacher's most likely tokens kept at each position (2..256)
    beta: float = 0.5  # jsd: 0 = forward KL(teacher || student), 1 = reverse KL, between: JSD


@dataclass
class AlgoConfig:
    advantage: str = "grpo"  # grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae
    scale_by_std: bool = True  # grpo only; false = Dr.GRPO (r - group mean)
    gamma: float = 1.0  # discount (reinforce_pp, gae)
    lam: float = 0.95  # GAE lambda
    whiten_advantages: bool = True  # gae only: whiten advantages over the global batch
    advantage_clip: float = 0.0  # clamp advantages to +-clip after estimation; 0 = off
    policy_loss: str = "ppo"  # policy loss: ppo | gspo | cispo | sapo | gmpo
    # Clip range [1 - low, 1 + high] of ppo/gspo/cispo; gmpo clips the log ratio to [-low, high].
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # > clip_eps_low = DAPO's clip-higher
    dual_clip_c: float = 0.0  # ppo/gspo: dual-clip bound for A < 0 (0 = off, else > 1)
    sapo_tau_pos: float = 1.0  # sapo: soft-gate temperature where the advantage is positive
    sapo_tau_neg: float = 1.05  # sapo: ... where it is negative (larger: fades faster)
    # Correct for the engine sampling from other numerics than the trainer's old policy, with
    # r = pi_old / pi_engine per sampled token: none | tis (weight min(r, cap)) | mis (drop
    # responses whose geometric-mean r leaves [low, high]) | icepop (drop tokens whose r does) |
    # auto: tis when async training samples from older weights (train.max_staleness > 0 or
    # partial rollouts), else none.
    rollout_correction: str = "auto"
    rollout_correction_cap: float = 2.0  # tis
    rollout_correction_low: float = 0.5  # mis, icepop
    rollout_correction_high: float = 2.0  # mis, icepop
    loss_agg_mode: str = "token-mean"
    kl: KLConfig = field(default_factory=KLConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
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
    # KL-Cov entropy control (algo/cov_control.py): the top fraction of tokens by the covariance
    # of advantage and logprob get kl_cov_coef * |logp - old| in their loss (0 = off).
    kl_cov_ratio: float = 0.0
    kl_cov_coef: float = 1.0
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
    # Optimizer steps per pass: the (shuffled) rollout batch is split into this many mini-batches,
    # each normalised on its own over all ranks (verl's ppo_mini_batch_size, TRL's
    # steps_per_generation, expressed as a count).
    mini_batches: int = 1
    lr: float = 1e-6  # full fine-tuning of a 1.5B-7B policy; LoRA adapters take ~1e-5-1e-4
    lr_schedule: str = "constant"  # constant | cosine (decays to 10% of lr over all optimizer steps)
    warmup_steps: int = 0  # optimizer steps of linear lr warm-up from 0, then the schedule
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # global grad-norm clip; 0 disables
    micro_batch_tokens: int = 4096  # token budget of one forward micro-batch
    # The responses of one prompt share a single copy of the prompt (and its images) in each
    # micro-batch: the same logprobs and gradients for a fraction of the work (docs/scaling.md).
    share_prompts: bool = True
    # Sequence parallelism: groups of this many consecutive ranks share each micro-batch, each
    # rank holding 1/N of its tokens through the decoder (Ulysses; docs/scaling.md). The token
    # budget above counts a rank's shard. 1 = off.
    sequence_parallel: int = 1
    zero_stage: int = 2  # DeepSpeed ZeRO stage: 0, 2 or 3
    # CPU offload (DeepSpeed): none | optimizer (Adam states + fp32 master weights in CPU memory,
    # stage >= 1) | all (parameters too, stage 3). Trades step time for GPU memory.
    offload: str = "none"
    seed: int = 0
    # sync: every rank generates, then every rank trains. async: rollout.ranks ranks keep
    # generating while the others train, on weights at most max_staleness updates old (docs/async.md).
    mode: str = "sync"
    max_staleness: int = 1
    # async, one rollout rank, HF engine: a response in flight when the trainer sends new
    # weights goes on under them (each token keeps the logprob of the weights that sampled it).
    partial_rollouts: bool = False
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
    # Save every N steps (and always on SIGTERM/SIGINT) to output.dir/checkpoints; 0 = only on a
    # signal. On by default: a lost machine, not only a polite preemption, must cost at most N steps.
    save_steps: int = 50
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
class TeacherConfig:
    # On-policy distillation's teacher (docs/distillation.md): an HF checkpoint directory or a hub
    # id; "" = no teacher. It scores every token the policy samples, with the same prompt and images.
    path: str = ""
    compute_dtype: str = ""  # float32 | bfloat16; "" = model.compute_dtype (held in bf16 under bf16, as the reference)
    # Or a `vlrft teacher-server` at this URL (http://host:port) scores them: no rank holds the
    # teacher (docs/distillation.md, "Remote teacher"). One of path and url.
    url: str = ""
    token_file: str = ""  # the server's bearer token: the file's first line; "" = $VLRFT_TEACHER_TOKEN (or none)
    timeout_s: float = 300.0  # one request to the server
    retries: int = 2  # retries of a request that may pass (unreachable, timed out, 429/502/503/504)
    deadline_s: float = 900.0  # all of one step's requests, retries included

    def enabled(self) -> bool:
        """Whether the run distils from a teacher (local or remote)."""
        return bool(self.path or self.url)


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
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)


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
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {k: _convert(hints[k], _on_off(fields[k], v), f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def _on_off(spec: dataclasses.Field, value: Any) -> Any:
    """YAML reads an unquoted on / off as a boolean: for keys spelled on | off, it is the word."""
    if spec.metadata.get("on_off") and isinstance(value, bool):
        return "on" if value else "off"
    return value


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
    """Load a YAML config, apply dotted overrides, validate, and make relative paths absolute:
    a path is relative to where it was written, the config file's directory or, on the command
    line, the current directory (vlrft/config_paths.py)."""
    raw: dict = {}
    config_dir = None
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        raw = yaml.safe_load(path.read_text()) or {}
        config_dir = path.resolve().parent
    raw = apply_overrides(raw, list(overrides))
    cfg = _build(Config, raw, "")
    resolve_paths(cfg, origin(config_dir, [item.split("=", 1)[0] for item in overrides]))
    from vlrft.config_checks import validate  # the checks import this module for its dataclasses

    validate(cfg)
    return cfg


def component_name(spec: RecipeSpec) -> str:
    """A recipe's name in metrics: its `name`, else the function part of its recipe string."""
    return spec.name or (spec.recipe.rpartition(":")[2] if ":" in spec.recipe else spec.recipe)


def optimizer_steps_of_run(cfg: Config) -> int:
    """Policy optimizer steps the whole run takes (what the lr schedule counts)."""
    return cfg.train.total_steps * cfg.train.ppo_epochs * cfg.train.mini_batches


def rollout_correction_mode(cfg: Config) -> str:
    """algo.rollout_correction with `auto` resolved: behaviour (PPO's clip around the policy
    that sampled; tis under top-p) where async training samples from older weights than it
    trains, else none.
    (On the colour demo at staleness 1, tis let the delayed updates overshoot: docs/async.md.)"""
    mode = cfg.algo.rollout_correction
    if mode != "auto":
        return mode
    off_policy = cfg.train.mode == "async" and (cfg.train.max_staleness > 0 or cfg.train.partial_rollouts)
    if not off_policy:
        return "none"
    # Under top-p the engine's logprobs are of the nucleus alone: a ratio against them sits
    # below 1 even on-policy, so weigh by it (tis) instead.
    return "behaviour" if cfg.rollout.top_p == 1.0 else "tis"


def kl_estimator_name(kl: KLConfig) -> str:
    """The estimator actually used: `auto` is k1 in the reward and k3 in the loss (docs/algorithms.md)."""
    if kl.estimator != "auto":
        return kl.estimator
    return "k1" if kl.placement == "reward" else "k3"


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)

