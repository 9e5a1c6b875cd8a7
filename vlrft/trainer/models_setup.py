"""The models a rank holds, built in named steps: the policy under its training backend, the
critic, the reference and the distillation teacher.

The steps run in this order, which matters: the policy is loaded, gets its LoRA adapters and
its LM head; the critic is loaded; both get gradient checkpointing, a frozen vision tower and
compiled layers (checkpointing before compiling, compiling before DeepSpeed wraps them); then
the training backends wrap them, the reference is loaded (or is the LoRA policy's own base),
then the distillation teacher (checked against the student before anything loads); with
sequence parallelism every model is told its shard of each micro-batch; and every vision tower
is told which modalities the data holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig

from vlrft.config import Config
from vlrft.distributed import sequence_groups
from vlrft.errors import ConfigError
from vlrft.experience.checks import ImageTokenCheck
from vlrft.models.attention import resolve_attention
from vlrft.models.loader import enable_gradient_checkpointing, freeze_vision_tower, load_model, vision_tower
from vlrft.models.lora import BaseModelView, add_lora, optimizer_groups
from vlrft.models.remote_teacher import RemoteTeacher, connect
from vlrft.models.sequence_parallel import heads_problem, set_run_shard, shard_model
from vlrft.models.teacher import check_teacher, load_teacher
from vlrft.models.ulysses import SequenceShard
from vlrft.models.value_model import ValueModel, load_value_model
from vlrft.multiturn.environment import shows_images
from vlrft.trainer.build import choose_fused_head, compile_for_training, load_reference, training_backend
from vlrft.trainer.vision_modalities import agree_modalities, data_modalities

if TYPE_CHECKING:
    from vlrft.backends.deepspeed_backend import DeepSpeedBackend
    from vlrft.trainer.run_setup import RunData


@dataclass
class Models:
    """What a rank holds of the run's models. An async run's rollout ranks hold none of them
    (their engine holds the policy): only `image_check`."""

    policy: DeepSpeedBackend | None = None  # the trained policy under its training backend
    critic: DeepSpeedBackend | None = None  # the value model under its own backend (critic.enabled)
    reference: torch.nn.Module | BaseModelView | None = None  # frozen, for the KL (algo.kl.coef > 0)
    teacher: torch.nn.Module | RemoteTeacher | None = None  # frozen, for on-policy distillation (teacher.path; teacher.url)
    # adapted linear -> alpha / rank (model.lora); empty: full fine-tuning
    lora_scalings: dict[str, float] = field(default_factory=dict)
    frozen_vision_parameters: int = 0  # how many vision-tower parameters model.freeze_vision froze
    image_check: ImageTokenCheck | None = None  # image-token counts vs patches; None for a text policy


def setup_models(cfg: Config, rank: int, trains: bool, data: RunData) -> Models:
    """The models of this rank, in the order of the module docstring. `trains`: whether this
    rank trains (every rank of a synchronous run); `data` is the run's, for the modalities."""
    announce = rank == 0
    if cfg.teacher.path:  # before any model loads: the teacher must read the student's ids and images
        check_teacher(cfg.model.path, cfg.teacher.path)
    precision = model_precision(cfg, announce)
    if not trains:  # the engine holds an async rollout rank's only copy of the policy
        return Models(image_check=ImageTokenCheck.for_model(AutoConfig.from_pretrained(cfg.model.path)))
    remote_teacher = connect(cfg) if cfg.teacher.url else None  # before any model loads: its server answers
    policy = load_policy(cfg, precision)
    lora_scalings = add_adapters(cfg, policy)
    choose_head(cfg, policy, announce)
    critic = load_critic(cfg, precision)
    enable_checkpointing(cfg, policy, critic)
    frozen = freeze_vision(cfg, policy, critic, announce)
    compile_models(cfg, policy, critic, announce)
    report_trainable(policy, lora_scalings, announce)
    image_check = ImageTokenCheck.for_model(policy.config)  # None for text models
    policy_backend, critic_backend = wrap_in_backends(cfg, policy, critic, lora_scalings)
    models = Models(
        policy=policy_backend,
        critic=critic_backend,
        reference=build_reference(cfg, precision, policy_backend, lora_scalings),
        teacher=remote_teacher or build_teacher(cfg, precision[0]),
        lora_scalings=lora_scalings,
        frozen_vision_parameters=frozen,
        image_check=image_check,
    )
    share_sequences(cfg, models, policy, critic)
    ptx_modalities = data.ptx.modalities if data.ptx else set()
    modalities = data_modalities(data.train_rows, ptx_modalities, shows_images(cfg.rollout.environment))
    declare_modalities(models, modalities, announce)
    return models


def model_precision(cfg: Config, announce: bool) -> tuple[str, str]:
    """(attention implementation, decoder compute dtype) every model of the run is loaded with."""
    attention = resolve_attention(cfg.model.attention, cfg.model.compute_dtype, cfg.train.sequence_parallel > 1)
    if announce:
        print(f"vlrft: attention {attention}, decoder compute {cfg.model.compute_dtype} (model.attention, model.compute_dtype)")
    return attention, cfg.model.compute_dtype


def load_policy(cfg: Config, precision: tuple[str, str]) -> torch.nn.Module:
    """The policy's HF model; `algo.moe_aux_coef` needs one with a router."""
    policy = load_model(cfg.model.path, *precision)
    if cfg.algo.moe_aux_coef > 0 and not hasattr(policy.config.get_text_config(), "output_router_logits"):
        raise ConfigError(
            f"config key 'algo.moe_aux_coef' needs a mixture-of-experts model; {cfg.model.path} has no router"
        )
    return policy


def add_adapters(cfg: Config, policy: torch.nn.Module) -> dict[str, float]:
    """`model.lora`: adapters added to the policy in place. Returns adapted linear -> alpha /
    rank (empty: full fine-tuning)."""
    lora = cfg.model.lora
    if lora.rank <= 0:
        return {}
    try:
        return add_lora(policy, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def choose_head(cfg: Config, policy: torch.nn.Module, announce: bool) -> None:
    """`model.fused_head` resolved and set on the policy."""
    if choose_fused_head(cfg, policy) == "liger" and announce:
        print("vlrft: LM head: Liger-Kernel's fused linear logprob/entropy (model.fused_head)")


def load_critic(cfg: Config, precision: tuple[str, str]) -> ValueModel | None:
    """The value model (`critic.path`, else the policy's checkpoint); None without a critic."""
    return load_value_model(cfg.critic.path or cfg.model.path, *precision) if cfg.critic.enabled else None


def enable_checkpointing(cfg: Config, policy: torch.nn.Module, critic: ValueModel | None) -> None:
    """`model.gradient_checkpointing` on the policy and the critic's backbone."""
    if cfg.model.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
        if critic is not None:
            enable_gradient_checkpointing(critic.backbone)


def freeze_vision(cfg: Config, policy: torch.nn.Module, critic: ValueModel | None, announce: bool) -> int:
    """`model.freeze_vision`: the policy's (and critic's) vision tower stops training. Returns how
    many of the policy's parameters were frozen (0: none)."""
    if not cfg.model.freeze_vision:
        return 0
    if vision_tower(policy) is None:
        raise ConfigError(f"config key 'model.freeze_vision': {cfg.model.path} has no vision tower")
    frozen = freeze_vision_tower(policy)
    if critic is not None:
        freeze_vision_tower(critic.backbone)
    if announce:
        print(f"vlrft: froze {frozen} vision-tower parameters (model.freeze_vision)")
    return frozen


def compile_models(cfg: Config, policy: torch.nn.Module, critic: ValueModel | None, announce: bool) -> None:
    """`model.compile` on the policy and the critic's backbone (after checkpointing, before
    DeepSpeed wraps them)."""
    compiled = compile_for_training(cfg, policy, critic.backbone if critic is not None else None)
    if announce and compiled:
        print(f"vlrft: compiling {compiled} decoder layers and vision blocks on first use (model.compile)")


def report_trainable(policy: torch.nn.Module, lora_scalings: dict[str, float], announce: bool) -> None:
    """A LoRA policy: one line of how many of its parameters train."""
    if announce and lora_scalings:
        trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        total = sum(p.numel() for p in policy.parameters())
        print(f"vlrft: LoRA on {len(lora_scalings)} layers: {trainable} of {total} parameters train (model.lora)")


def wrap_in_backends(cfg: Config, policy: torch.nn.Module, critic: ValueModel | None,
                     lora_scalings: dict[str, float]) -> tuple[DeepSpeedBackend, DeepSpeedBackend | None]:
    """The policy and the critic under their training backends (DeepSpeed), each with its
    optimizer: (policy backend, critic backend or None). A LoRA policy's adapters get their own
    learning rate (model.lora.lr_ratio)."""
    groups = optimizer_groups(policy, cfg.train.lr, cfg.model.lora.lr_ratio) if lora_scalings else None
    policy_backend = training_backend(cfg, policy, cfg.train.lr, groups)
    critic_backend = training_backend(cfg, critic, cfg.critic.lr) if critic is not None else None
    return policy_backend, critic_backend


def build_reference(cfg: Config, precision: tuple[str, str], policy_backend: DeepSpeedBackend,
                    lora_scalings: dict[str, float]) -> torch.nn.Module | BaseModelView | None:
    """The frozen reference for the KL (None when algo.kl.coef is 0). A LoRA policy's reference
    is its own base weights (adapters off): no second copy."""
    if cfg.algo.kl.coef > 0:
        return BaseModelView(policy_backend.module) if lora_scalings else load_reference(cfg, precision)
    return None


def build_teacher(cfg: Config, attention: str) -> torch.nn.Module | None:
    """The frozen distillation teacher (None without teacher.path), in teacher.compute_dtype
    (default: the policy's), its layers compiled as the policy's are (model.compile)."""
    if not cfg.teacher.path:
        return None
    teacher = load_teacher(cfg.teacher.path, attention, cfg.teacher.compute_dtype or cfg.model.compute_dtype)
    compile_for_training(cfg, teacher)
    return teacher


def share_sequences(cfg: Config, models: Models, policy: torch.nn.Module, critic: ValueModel | None) -> None:
    """`train.sequence_parallel` N > 1: groups of N consecutive ranks share each micro-batch, and
    every model that runs micro-batches here runs its shard of their tokens (a collective of
    all ranks: each creates every group)."""
    size = cfg.train.sequence_parallel
    set_run_shard(None)  # (a trainer built before in this process may have set one)
    if size == 1:
        return
    teacher = models.teacher if isinstance(models.teacher, torch.nn.Module) else None
    reference = None if isinstance(models.reference, BaseModelView) else models.reference  # (the policy's own weights)
    named = {"model.path": policy, "critic.path": critic, "model.ref_path": reference, "teacher.path": teacher}
    sharded = [model for model in named.values() if model is not None]
    for key, model in named.items():
        problem = heads_problem(getattr(model, "backbone", model).config.get_text_config(), size) if model is not None else ""
        if problem:
            raise ConfigError(f"{problem} ({key}'s model)")
    group, index = sequence_groups(size)
    shard = SequenceShard(group, index, size)
    set_run_shard(shard)
    for model in sharded:
        shard_model(model, shard)


def declare_modalities(models: Models, modalities: set[str], announce: bool) -> None:
    """A vision-language policy's tower runs for the modalities some rank's data holds, on
    every model that calls it (trainer/vision_modalities.py). A collective of the ranks that train."""
    if models.image_check is None:  # a text policy
        return
    backbones = [models.policy.module.model, models.critic.module.backbone if models.critic is not None else None,
                 getattr(models.reference, "model", None), getattr(models.teacher, "model", None)]
    agree_modalities([b for b in backbones if b is not None], modalities, announce)
