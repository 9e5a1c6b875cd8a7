"""Config -> the loop's parts: reward shaper, advantage options, KL controller, maker settings,
training backends."""

from __future__ import annotations

import sys

import torch

from vlrft.algo.estimate import AdvantageOptions
from vlrft.algo.kl import FULL_KL, AdaptiveKLController, FixedKLController
from vlrft.algo.shaping import transform_rewards, zero_truncated
from vlrft.config import Config, kl_estimator_name, optimizer_steps_of_run, rollout_correction_mode
from vlrft.distributed import device, global_rank
from vlrft.engines import SamplingParams
from vlrft.models.compiled_layers import compile_layers, compile_wanted, eager_under_checkpointing
from vlrft.models.fused_head import resolve_fused_head
from vlrft.models.loader import load_model
from vlrft.errors import ConfigError
from vlrft.experience.distillation import DistillSettings
from vlrft.experience.maker import CorrectionSettings, KLSettings, MakerSettings
from vlrft.algo.losses import LossSettings
from vlrft.trainer.update import UpdateSettings
from vlrft.multiturn.environment import EnvironmentFailure, shows_images
from vlrft.multiturn.host import EnvironmentHost
from vlrft.multiturn.rollout import MultiTurn
from vlrft.multiturn.template import observation_template


def reward_shaper(cfg: Config):
    """(rewards [N], truncated [N]) -> the rewards the advantage estimator sees."""
    algo = cfg.algo

    def shape(rewards: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        rewards = transform_rewards(rewards, algo.reward_bias, algo.reward_scale, algo.reward_clip)
        # After the transform, so a truncated response ends at exactly 0 whatever the bias.
        return zero_truncated(rewards, truncated) if algo.zero_reward_truncated else rewards

    return shape


def advantage_options(cfg: Config) -> AdvantageOptions:
    algo = cfg.algo
    return AdvantageOptions(
        name=algo.advantage,
        scale_by_std=algo.scale_by_std,
        gamma=algo.gamma,
        lam=algo.lam,
        whiten_gae=algo.whiten_advantages,
        clip=algo.advantage_clip,
    )


def kl_controller(cfg: Config) -> FixedKLController:
    kl = cfg.algo.kl
    if kl.target > 0:
        return AdaptiveKLController(kl.coef, kl.target, kl.horizon)
    return FixedKLController(kl.coef)


def old_logprobs_from_update(cfg: Config) -> bool:
    """Whether the update's forward can supply the old logprobs, skipping the experience pass's
    policy forward: when the batch feeds exactly one optimizer step the old policy is the one
    being updated (ratio exactly 1). Not when anything before the update needs the policy's
    logprobs: the KL in the reward, the exact-vocabulary KL (it needs the policy's logits),
    actor-frozen critic warm-up steps (no update fills them), or a distillation teacher (its
    per-token term needs the student's logprob beside the teacher's). Nor with LoRA dropout:
    the update's forward is then not the rollout policy's function."""
    algo = cfg.algo
    needs_policy_kl = algo.kl.coef > 0 and (algo.kl.placement == "reward" or kl_estimator_name(algo.kl) == FULL_KL)
    return (
        cfg.train.ppo_epochs == 1
        and cfg.train.mini_batches == 1
        and cfg.critic.freeze_actor_steps == 0
        and not needs_policy_kl
        and cfg.model.lora.dropout == 0
        and not cfg.teacher.enabled()
    )


def multi_turn(cfg: Config, encoder, stop_ids: list[int]) -> MultiTurn | None:
    """Multi-turn rollout settings (None: one turn). One environment is built here, in the
    rank's environment worker, so a bad `rollout.environment_args` fails at start-up, in one line."""
    rollout = cfg.rollout
    if not rollout.environment:
        return None
    environments = EnvironmentHost(rollout.environment, rollout.environment_args, rollout.environment_timeout_s,
                                   rollout.environment_workers)
    try:
        role = environments.probe()
    except EnvironmentFailure as failure:
        raise ConfigError(f"environment '{rollout.environment}' could not be built from rollout.environment_args: {failure}") from None
    template = observation_template(encoder.tokenizer, stop_ids, role, cfg.model.path)
    return MultiTurn(environments, template, rollout.max_turns, rollout.max_trajectory_tokens, encoder,
                     shows_images=shows_images(rollout.environment))


def maker_settings(cfg: Config, controller: FixedKLController, image_check=None, multi_turn: MultiTurn | None = None) -> MakerSettings:
    rollout = cfg.rollout
    return MakerSettings(
        sampling=SamplingParams(
            n=rollout.generation_size or rollout.n_samples_per_prompt,
            max_new_tokens=rollout.max_new_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
        ),
        keep_per_prompt=rollout.n_samples_per_prompt,
        micro_batch_tokens=cfg.train.micro_batch_tokens,
        share_prompts=cfg.train.share_prompts,
        advantages=advantage_options(cfg),
        kl=KLSettings(estimator=kl_estimator_name(cfg.algo.kl), placement=cfg.algo.kl.placement, coef=lambda: controller.coef),
        mask_truncated=cfg.algo.mask_truncated,
        image_check=image_check,
        correction=correction_settings(cfg),
        policy_pass=not old_logprobs_from_update(cfg),
        multi_turn=multi_turn,
        distill=distill_settings(cfg),
    )


def distill_settings(cfg: Config) -> DistillSettings | None:
    """The experience pass's share of distillation (algo.distill.*); None without a teacher."""
    if not cfg.teacher.enabled():
        return None
    distill = cfg.algo.distill
    return DistillSettings(distill.mode, distill.coef, distill.top_k if distill.mode == "jsd" else 0)


def correction_settings(cfg: Config) -> CorrectionSettings:
    """The rollout-correction weights' settings (algo.rollout_correction*)."""
    algo = cfg.algo
    return CorrectionSettings(rollout_correction_mode(cfg), algo.rollout_correction_cap, algo.rollout_correction_low,
                              algo.rollout_correction_high)


def update_settings(cfg: Config) -> UpdateSettings:
    """What the policy and critic updates read of the config."""
    algo, train = cfg.algo, cfg.train
    return UpdateSettings(
        epochs=train.ppo_epochs,
        mini_batches=train.mini_batches,
        micro_batch_tokens=train.micro_batch_tokens,
        temperature=cfg.rollout.temperature,
        max_response_tokens=cfg.rollout.max_response_tokens(),
        policy_loss=algo.policy_loss,
        loss=LossSettings(algo.clip_eps_low, algo.clip_eps_high, algo.dual_clip_c, algo.sapo_tau_pos, algo.sapo_tau_neg),
        loss_agg_mode=algo.loss_agg_mode,
        kl_in_loss=algo.kl.placement == "loss",
        kl_estimator=kl_estimator_name(algo.kl),
        entropy_coef=algo.entropy_coef,
        high_entropy_token_ratio=algo.high_entropy_token_ratio,
        moe_aux_coef=algo.moe_aux_coef,
        ptx_coef=algo.ptx_coef,
        early_stop_ratio=algo.early_stop_ratio,
        target_kl=algo.target_kl,
        correction=correction_settings(cfg),
        value_clip=cfg.critic.value_clip,
        distill_loss_coef=cfg.algo.distill.coef if cfg.teacher.enabled() and cfg.algo.distill.mode == "loss" else 0.0,
        distill_jsd_coef=cfg.algo.distill.coef if cfg.teacher.enabled() and cfg.algo.distill.mode == "jsd" else 0.0,
        distill_jsd_beta=cfg.algo.distill.beta,
        kl_cov_ratio=cfg.algo.kl_cov_ratio,
        kl_cov_coef=cfg.algo.kl_cov_coef,
    )


def load_reference(cfg: Config, precision: tuple[str, str]) -> torch.nn.Module:
    """The frozen reference policy on this rank's device. With bf16 compute it is held in bf16
    (it has no optimizer and needs no fp32 master copy: half the memory, same matmul inputs as
    autocast gives); a moving reference (algo.kl.ref_ema_eta) keeps fp32, where small EMA steps
    do not round away."""
    weights = "bfloat16" if precision[1] == "bfloat16" and cfg.algo.kl.ref_ema_eta == 0 else "float32"
    model = load_model(cfg.model.ref_path or cfg.model.path, *precision, weights_dtype=weights)
    choose_fused_head(cfg, model)  # the policy's head
    compile_for_training(cfg, model)
    return model.eval().requires_grad_(False).to(device())


def choose_fused_head(cfg: Config, model: torch.nn.Module) -> str:
    """`model.fused_head` resolved for `model` (policy or reference) and set on it, where
    policy_forward reads it. Returns the head chosen. Distillation's jsd mode reads the student's
    logprob of each of the teacher's top-k tokens, which only the chunked head gives."""
    requested = "chunked" if cfg.teacher.enabled() and cfg.algo.distill.mode == "jsd" else cfg.model.fused_head
    model.fused_head = resolve_fused_head(requested, cfg.model.compute_dtype, model.lm_head)
    return model.fused_head


def compile_for_training(cfg: Config, *models: torch.nn.Module | None) -> int:
    """`model.compile`: each model's decoder layers and vision blocks compiled in place (None:
    no such model). After gradient checkpointing, before DeepSpeed wraps them. Returns how many
    layers were compiled."""
    models = [model for model in models if model is not None]
    # (With sequence parallelism `auto` stays eager: the exchange inside a compiled layer is unmeasured.)
    if not compile_wanted(cfg.model.compile, cfg.train.zero_stage) or cfg.train.sequence_parallel > 1 or not models:
        return 0
    why_eager = eager_under_checkpointing(models[0])
    if why_eager and global_rank() == 0:
        print(f"vlrft: warning: {why_eager}", file=sys.stderr)
    return sum(compile_layers(model) for model in models)


def training_backend(cfg: Config, model: torch.nn.Module, lr: float, param_groups: list[dict] | None = None):
    """DeepSpeed around `model` (policy or critic) with the run's optimizer settings."""
    from vlrft.backends.deepspeed_backend import DeepSpeedBackend, uses_bf16_weights  # heavy import, only here

    return DeepSpeedBackend(
        model,
        lr=lr,
        weight_decay=cfg.train.weight_decay,
        grad_clip=cfg.train.grad_clip,
        zero_stage=cfg.train.zero_stage,
        lr_schedule=cfg.train.lr_schedule,
        total_optimizer_steps=optimizer_steps_of_run(cfg),
        warmup_steps=cfg.train.warmup_steps,
        offload=cfg.train.offload,
        bf16_weights=uses_bf16_weights(cfg.model.compute_dtype, cfg.train.zero_stage),
        param_groups=param_groups,
    )
