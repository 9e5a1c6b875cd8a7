"""SPMDTrainer: the loop every rank runs, top to bottom.

sample -> generate -> reward -> (filter) -> logprobs/values -> advantages -> critic and policy
update -> sync -> log/evaluate -> save
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from vlrft.algo.shaping import ZeroRewardWatch
from vlrft.algo.value import ReturnStats
from vlrft.config import Config, to_dict
from vlrft.errors import ConfigError
from vlrft.config_checks import check_world_size
from vlrft.data.columns import columns_from
from vlrft.data.encoding import PromptEncoder
from vlrft.data.media import media_from
from vlrft.isolation.sandbox import configure as sandbox_settings
from vlrft.data.ptx import PtxStream
from vlrft.data.sampler import PromptSampler
from vlrft.engines import ENGINES
from vlrft.experience.checks import ImageTokenCheck
from vlrft.experience.maker import FastExperienceMaker
from vlrft.experience.replay_buffer import ReplayBuffer
from vlrft.metrics import ConsoleSink, JsonlSink, MetricsLogger
from vlrft.metrics.external_sinks import configured_sinks
from vlrft.models.attention import resolve_attention
from vlrft.models.hub import resolve_model_paths
from vlrft.models.loader import (
    banned_token_ids,
    enable_gradient_checkpointing,
    freeze_vision_tower,
    load_model,
    stop_token_ids,
    vision_tower,
)
from vlrft.models.lora import BaseModelView, add_lora, dropout_active, export_lora, merged_weights, optimizer_groups
from vlrft.models.value_model import load_value_model
from vlrft.multiturn.environment import shows_images
from vlrft.rewards.mix import RewardError, RewardMix
from vlrft.trainer.bad_input import BadInput
from vlrft.trainer.build import (
    kl_controller,
    load_reference,
    maker_settings,
    multi_turn,
    reward_shaper,
    training_backend,
    update_settings,
)
from vlrft import progress
from vlrft.trainer import checkpoint_io
from vlrft.trainer.run_start import start_run
from vlrft.trainer.checkpoint_io import TrainingStopped
from vlrft.trainer.checkpoint import checkpoint_due, rng_state, set_rng_state
from vlrft.trainer.run_lock import claim_run_dir
from vlrft.trainer.vision_modalities import agree_modalities, data_modalities
from vlrft.trainer.critic_update import critic_update
from vlrft.distributed import (
    all_reduce_sum,
    barrier,
    init_distributed,
    local_world_size,
    rank,
    world_size,
)
from vlrft.trainer.async_roles import evaluation_due, resume_rollout_rank, run_role
from vlrft.trainer.weights_delivery import WEIGHTS_SOURCE, RolloutRanks, take_async_role
from vlrft.trainer.dynamic_sampling import sample_groups
from vlrft.trainer.evaluate import evaluate
from vlrft.trainer.guards import RunGuards
from vlrft.trainer.rank_balance import balance_across_ranks
from vlrft.trainer.rollout_metrics import mark_correct, rollout_metrics
from vlrft.trainer.trajectory_metrics import trajectory_metrics
from vlrft.trainer.step_api import response_logprobs, train_on_responses
from vlrft.trainer.update import policy_update
from vlrft.trajectory.saver import TrajectorySaver
from vlrft.types import Experience


class SPMDTrainer:
    """One trainer for text and vision-language policies: modality is data, not a subclass."""

    def __init__(self, cfg: Config):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per rank per checkpoint load is noise
        self.cfg = cfg
        self.rank, self.world_size = init_distributed()
        unisolated = sandbox_settings(cfg.sandbox.unsafe_no_isolation)  # before any worker process starts
        if unisolated and self.rank == 0:
            print(unisolated, file=sys.stderr, flush=True)
        check_world_size(cfg, self.world_size, local_world_size())
        resolve_model_paths(cfg)  # hub ids -> local snapshot directories
        torch.manual_seed(cfg.train.seed + self.rank)  # ranks sample different responses
        self.out_dir = Path(cfg.output.dir)
        self.global_step = 0
        claim_run_dir(self.out_dir, self.rank)  # before anything in it is read, written or discarded
        resume_from, start_step = start_run(cfg, self.out_dir, self.rank, self.world_size)
        # Asynchronous training: this rank generates or trains, and from here on its rank and
        # world are those of its role (trainer/async_roles.py).
        self.role, self.weights = "both", None  # an async run's routes of the weights (weights_delivery.WeightsRoutes)
        self.weights_version = 0  # an async rollout rank's engine: the policy version it holds
        self.started_ahead = []  # an async rollout rank's next batches, started early (async_roles.StartedBatch)
        if cfg.train.mode == "async":
            self.role, self.weights = take_async_role(cfg.rollout.ranks, cfg.train.partial_rollouts)
            self.rank, self.world_size = rank(), world_size()
            torch.manual_seed(cfg.train.seed + self.rank)  # a role's rank k samples as a sync run's rank k
        generates, trains = self.role != "trainer", self.role != "rollout"
        # One rank writes the run's files: the first rank that trains.
        self.writes_output = self.rank == 0 and trains

        self.encoder = PromptEncoder.for_config(cfg)
        tokenizer = self.encoder.tokenizer
        self.stop_ids = stop_ids = stop_token_ids(tokenizer)
        self.bad_input = BadInput(cfg.data.on_bad_sample, self.rank, self.world_size, columns_from(cfg.data),
                                  media_from(cfg.data))
        self.train_rows = self.bad_input.load(cfg.data.train_path)
        eval_rows = self.bad_input.load(cfg.data.eval_path)[: cfg.eval.max_prompts] if cfg.data.eval_path else []
        self.eval_sources = sorted({row["data_source"] for row in eval_rows})
        mine = [(r, i) for i, r in enumerate(eval_rows) if i % self.world_size == self.rank and generates]
        self.eval_prompts = self.bad_input.encode_at_start(self.encoder, mine)
        self.ptx = None
        if cfg.data.ptx_path and trains:
            self.ptx = PtxStream(
                cfg.data.ptx_path, self.encoder, cfg.data.ptx_rows_per_step, self.rank, self.world_size, stop_ids[0],
                self.bad_input,
            )

        attention = resolve_attention(cfg.model.attention, cfg.model.compute_dtype)
        precision = (attention, cfg.model.compute_dtype)
        if self.rank == 0:
            print(f"vlrft: attention {attention}, decoder compute {cfg.model.compute_dtype} (model.attention, model.compute_dtype)")
        self.lora_scalings: dict[str, float] = {}  # adapted linear -> alpha / rank; empty = full fine-tuning
        self.frozen_vision_parameters = 0
        self.backend = self.critic = self.reference = None
        if trains:
            self._build_models(precision)
        else:  # the engine holds the rollout ranks' only copy of the policy
            self.image_check = ImageTokenCheck.for_model(AutoConfig.from_pretrained(cfg.model.path))
        # Last of the models: vLLM starts only if its share of the GPU is still free. It reseeds
        # every generator as it starts (seed + TP group): this rank keeps its own streams.
        streams = rng_state()
        self.engine = ENGINES.get(cfg.rollout.engine)(cfg, tokenizer, stop_ids, banned_token_ids(tokenizer)) if generates else None
        if self.role == "trainer":  # its "engine" is the rollout ranks, reached by broadcast
            self.engine = RolloutRanks(self.weights, WEIGHTS_SOURCE, self.rank == 0, self._evaluated_weights,
                                       self.policy_weights)
        set_rng_state(streams)
        self.kl_controller = kl_controller(cfg)
        self.return_stats = None
        if cfg.critic.value_norm != "none":
            self.return_stats = ReturnStats(cfg.critic.value_norm, cfg.critic.value_norm_beta)
        self.rewards = RewardMix(cfg.reward)
        self.train_sources = sorted({row["data_source"] for row in self.train_rows})
        self.maker = FastExperienceMaker(
            engine=self.engine,
            policy=lambda: self.backend.model,  # (rollout ranks never call these)
            reference=self.reference,
            rewards=self.rewards,
            shape_rewards=reward_shaper(cfg),
            # Environments run where trajectories are generated: not on an async run's trainers.
            settings=maker_settings(cfg, self.kl_controller, self.image_check,
                                    multi_turn(cfg, self.encoder, stop_ids) if generates else None),
            critic=(lambda: self.critic.model) if self.critic is not None else None,
            return_stats=self.return_stats,
        )
        self.update_settings = update_settings(cfg)
        # The weight-sync probe needs the engine beside the policy: off on the roles of async training.
        checked_engine = self.engine if self.role == "both" else None
        self.guards = RunGuards(cfg.guards, checked_engine, cfg.rollout.engine, self.rewards.component_names(), self.rank)
        # Policy EMA for evaluation and export: full tensors on CPU, by HF parameter name (on
        # the ranks that train; an async run's trainers send it to the rollout ranks to evaluate).
        self.policy_ema = None
        if cfg.train.ema_beta > 0 and trains:
            self.policy_ema = {n: t.detach().float().cpu().clone() for n, t in self.policy_weights()}
        self.buffer = ReplayBuffer(cfg.train.micro_batch_tokens, seed=cfg.train.seed + self.rank, share_prompts=cfg.train.share_prompts)
        self.sampler = PromptSampler(
            len(self.train_rows), cfg.rollout.rollout_prompts, self.rank, self.world_size, cfg.train.seed
        )
        sinks = []
        if self.writes_output:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
            sinks = [ConsoleSink(cfg.train.total_steps, start_step), JsonlSink(self.out_dir / "metrics.jsonl")]
            sinks += configured_sinks(cfg.logging, self.out_dir, to_dict(cfg), start_step)
        self.logger = MetricsLogger(sinks)
        self.saver = TrajectorySaver(self.out_dir, self.rank, tokenizer, cfg.trajectory.save_every)
        self.eval_history: list[tuple[int, float]] = []
        self.zero_reward_watch = ZeroRewardWatch(cfg.algo.zero_reward_patience)
        # A preemption (SIGTERM) or Ctrl-C ends the current step, saves a checkpoint, then stops
        # (async: the trainers decide, after the step a signal reached any rank in).
        self.stop_signal: int | None = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._request_stop)
        if resume_from is not None:
            self.load_checkpoint(resume_from)

    def _build_models(self, precision: tuple[str, str]) -> None:
        """The policy under DeepSpeed, its critic and reference (every rank that trains)."""
        cfg = self.cfg
        policy = load_model(cfg.model.path, *precision)
        if cfg.algo.moe_aux_coef > 0 and not hasattr(policy.config.get_text_config(), "output_router_logits"):
            raise ConfigError(
                f"config key 'algo.moe_aux_coef' needs a mixture-of-experts model; {cfg.model.path} has no router"
            )
        if cfg.model.lora.rank > 0:
            lora = cfg.model.lora
            try:
                self.lora_scalings = add_lora(policy, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        critic = load_value_model(cfg.critic.path or cfg.model.path, *precision) if cfg.critic.enabled else None
        if cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(policy)
            if critic is not None:
                enable_gradient_checkpointing(critic.backbone)
        if cfg.model.freeze_vision:
            if vision_tower(policy) is None:
                raise ConfigError(f"config key 'model.freeze_vision': {cfg.model.path} has no vision tower")
            self.frozen_vision_parameters = freeze_vision_tower(policy)
            if critic is not None:
                freeze_vision_tower(critic.backbone)
            if self.rank == 0:
                print(f"vlrft: froze {self.frozen_vision_parameters} vision-tower parameters (model.freeze_vision)")
        if self.rank == 0 and self.lora_scalings:
            trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
            total = sum(p.numel() for p in policy.parameters())
            print(f"vlrft: LoRA on {len(self.lora_scalings)} layers: {trainable} of {total} parameters train (model.lora)")
        self.image_check = ImageTokenCheck.for_model(policy.config)  # None for text models
        groups = optimizer_groups(policy, cfg.train.lr, cfg.model.lora.lr_ratio) if self.lora_scalings else None
        self.backend = training_backend(cfg, policy, cfg.train.lr, groups)
        self.critic = training_backend(cfg, critic, cfg.critic.lr) if critic is not None else None
        if cfg.algo.kl.coef > 0:
            # A LoRA policy's reference is its own base weights (adapters off): no second copy.
            self.reference = BaseModelView(self.backend.module) if self.lora_scalings else load_reference(cfg, precision)
        ptx_modalities = self.ptx.modalities if self.ptx else set()
        self.declare_vision_modalities(data_modalities(self.train_rows, ptx_modalities, shows_images(cfg.rollout.environment)))

    def declare_vision_modalities(self, modalities: set[str]) -> None:
        """A vision-language policy's tower runs for the modalities some rank's data holds, on
        every model that calls it (trainer/vision_modalities.py). A collective of the ranks that train."""
        if self.image_check is not None:  # (None: a text policy)
            backbones = [self.backend.module.model, self.critic.module.backbone if self.critic is not None else None,
                         getattr(self.reference, "model", None)]
            agree_modalities([b for b in backbones if b is not None], modalities, self.rank == 0)

    def train(self) -> list[tuple[int, float]]:
        cfg = self.cfg
        if self.role != "both":
            return run_role(self)
        if self.global_step == 0:  # a resumed run evaluated its start already
            self._maybe_evaluate(0)
        while self.global_step < cfg.train.total_steps:
            metrics = self.train_step()
            step = self.global_step
            self.logger.log(step, metrics)
            if cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or step == cfg.train.total_steps):
                self._maybe_evaluate(step)
            stop = float(all_reduce_sum(torch.tensor([float(self.stop_signal is not None)]))) > 0
            if stop or checkpoint_due(step, cfg.checkpoint.save_steps, cfg.train.total_steps):
                saved = self.save_checkpoint()
            if stop:
                self.logger.close()
                raise TrainingStopped(step, saved, self.stop_signal or signal.SIGTERM)
        self.export_final()
        return self.eval_history

    def export_final(self) -> None:
        """The trained policy (and its EMA, critic, tokenizer, processor) as HF checkpoints under
        output.dir/final*; closes the metric sinks (every rank that trains)."""
        progress.enter("saving the final model")
        self._export_policy(self.out_dir / "final")
        exported = [self.out_dir / "final"]
        if self.policy_ema is not None:
            if self.rank == 0:
                self.backend.module.save_pretrained(self.out_dir / "final_ema", state_dict=self.policy_ema)
            exported.append(self.out_dir / "final_ema")
        if self.critic is not None:
            self.critic.save_state_dict(self.out_dir / "final_critic" / "value_model.pt")
        if self.rank == 0:
            for out in exported:
                self.encoder.tokenizer.save_pretrained(out)
                if self.encoder.image_processor is not None:
                    self.encoder.image_processor.save_pretrained(out)
        self.logger.close()

    def train_step(self) -> dict[str, float]:
        """One RL step: sample, generate and score, update, sync the engine. Returns metrics."""
        start = self.begin_step()
        kept, generated, metrics = self.collect_experiences()
        return self.learn(kept, generated, metrics, start)

    def step(self, prompts: list[dict], responses: list[list], scores: list[list[float]]) -> dict[str, float]:
        """One RL step on responses generated and scored elsewhere (trainer/step_api.py)."""
        return train_on_responses(self, prompts, responses, scores)

    def response_logprobs(self, prompts: list[dict], responses: list[list]) -> list[list[float]]:
        """Each response's summed logprob under the current policy (trainer/step_api.py)."""
        return response_logprobs(self, prompts, responses)

    # The phases of a step, public so the loop, the step API and other schedules compose them:
    # begin_step, collect_experiences (generate and score), then learn = make_experiences
    # (experience pass, rank balance, replay buffer), update (critic and policy) and sync (the
    # engine gets the new weights).

    def begin_step(self) -> float:
        """Count a new step and open its budget for reward and environment calls. Returns its start time."""
        self.global_step += 1
        self.guards.start_step()
        return time.perf_counter()

    def learn(self, kept: list[Experience], generated: list[Experience], metrics: dict, start: float) -> dict[str, float]:
        """The step after scoring: experience pass, balance, update, engine sync. `kept` are this
        rank's scored experiences to learn from, `generated` all it scored (dynamic sampling
        drops some), `metrics` the step's so far. Returns the step's metrics."""
        experiences = self.make_experiences(kept, generated, metrics)
        made = time.perf_counter()
        actor_updated = self.update(experiences, metrics)
        updated = time.perf_counter()
        metrics |= trajectory_metrics(experiences) | self.guards.after_step(generated)
        if self.saver.due(self.global_step, self.cfg.train.total_steps):
            progress.enter(f"step {self.global_step}: saving trajectories")
            self.saver.save(self.global_step, experiences, [e.correct for e in experiences])
        synced = time.perf_counter()
        self.sync(actor_updated, metrics)
        metrics["perf/update_seconds"] = updated - made
        metrics["perf/sync_seconds"] = time.perf_counter() - synced
        if self.reference is not None:
            metrics["train/kl_coef"] = self.kl_controller.coef
            self.kl_controller.update(metrics["rollout/kl"], int(metrics["rollout/sequences"]))
        metrics["perf/experience_seconds"] = made - start
        metrics["perf/step_seconds"] = time.perf_counter() - start
        return metrics

    def make_experiences(self, kept: list[Experience], generated: list[Experience], metrics: dict) -> list[Experience]:
        """The experience pass (logprobs, values, advantages) over `kept`, balanced across the
        ranks and put in the replay buffer. Adds the rollout metrics to `metrics`; returns this
        rank's share."""
        progress.enter(f"step {self.global_step}: experience pass (logprobs, values, advantages)")
        # A rank whose prompts were all skipped runs a placeholder so it joins every collective.
        placeholder = self.bad_input.placeholder(self.encoder, self.train_rows)
        self.engine.sleep()  # generation is done: the experience pass and update get its memory
        experiences, made_metrics = self.maker.finish(kept, placeholder)
        mark_correct(generated, self.rewards)
        metrics |= rollout_metrics(generated, self.rewards, self.train_sources) | made_metrics
        experiences, balance_metrics = balance_across_ranks(experiences, self.cfg.train.share_prompts)
        metrics |= balance_metrics
        self.buffer.clear()
        self.buffer.add(experiences or [placeholder])
        self._check_rewards_not_all_zero(generated)
        return experiences

    def update(self, experiences: list[Experience], metrics: dict) -> bool:
        """The critic's and the policy's updates over the replay buffer (the policy's from step
        `critic.freeze_actor_steps` + 1). Adds their metrics; returns whether the policy changed."""
        progress.enter(f"step {self.global_step}: update")
        cfg = self.cfg
        if self.critic is not None:
            metrics |= critic_update(self.critic, self.buffer, self.update_settings, self.image_check)
        actor_updates = self.global_step > cfg.critic.freeze_actor_steps
        if actor_updates:
            metrics["train/lr"] = self.backend.lr  # the lr this step's update uses
            ptx = self.ptx.next_examples() if self.ptx is not None else []
            placeholder = self.bad_input.placeholder(self.encoder, self.train_rows)
            self.guards.before_update(self.backend.model, experiences or [placeholder])
            with dropout_active(self.backend.module, cfg.model.lora.dropout > 0):
                metrics |= policy_update(
                    self.backend, self.buffer, self.update_settings, self.kl_controller.coef, self.reference, ptx,
                    self.image_check, old_from_update=not self.maker.settings.policy_pass,
                )
        if not self.maker.settings.policy_pass:  # the update's forward filled the old logprobs
            metrics |= self.maker.policy_metrics(experiences)[0]
        return actor_updates

    def sync(self, actor_updated: bool, metrics: dict) -> None:
        """Wake the engine and, when the policy changed, send it the new weights. An async
        trainer sends a version every step, the rollout ranks wait for it: while the actor is
        frozen (`critic.freeze_actor_steps`), a version without tensors (the weights they hold)."""
        progress.enter(f"step {self.global_step}: weight sync")
        self.engine.wake()
        if actor_updated:
            self._sync_weights()
            metrics |= self.guards.after_sync(self.backend.model, self.global_step)
        elif self.role == "trainer":
            self.engine.update_weights(iter(()))

    def collect_experiences(self) -> tuple[list[Experience], list[Experience], dict[str, float]]:
        """This step's prompts, generated and scored: (kept, all generated, metrics)."""
        progress.enter(f"step {self.global_step}: generating and scoring")
        cache_counts = getattr(self.engine, "prefix_cache_counts", None)  # vLLM's prefix cache (every rank's engine)
        cache_before = torch.tensor(cache_counts()) if cache_counts else None
        start = time.perf_counter()
        kept, generated, metrics = sample_groups(self)
        metrics["perf/generate_seconds"] = time.perf_counter() - start  # generation and rewards
        if cache_counts:
            hits, queries = all_reduce_sum(torch.tensor(cache_counts()) - cache_before).tolist()
            metrics["rollout/prefix_cache_hit_rate"] = hits / max(queries, 1.0)
        if self.global_step == 1:  # once per run (a resumed run's metrics.jsonl has it already)
            metrics["data/skipped_rows"] = float(self.bad_input.skipped_rows)
        return kept, generated, metrics

    def _sync_weights(self) -> None:
        """Send the updated weights to the engine, updating the reference and policy EMAs on
        the way (one gather of each parameter under ZeRO-3)."""
        eta, beta = self.cfg.algo.kl.ref_ema_eta, self.cfg.train.ema_beta
        ref_params = dict(self.reference.named_parameters()) if self.reference is not None and eta > 0 else None

        def params():
            for name, tensor in self.policy_weights():
                if ref_params is not None:
                    ref_params[name].data.lerp_(tensor.to(ref_params[name].dtype), eta)
                if self.policy_ema is not None:
                    self.policy_ema[name].lerp_(tensor.float().cpu(), 1.0 - beta)
                yield name, tensor

        self.engine.update_weights(params())

    def policy_weights(self):
        """(HF name, full tensor) of the policy as the engine and exports see it: a LoRA
        policy's adapters merged into its base weights (collective under ZeRO-3)."""
        named = self.backend.named_full_parameters()
        return merged_weights(named, self.lora_scalings) if self.lora_scalings else named

    def _export_policy(self, out_dir: Path) -> None:
        """An HF checkpoint of the policy; a LoRA policy's is merged, with its adapter in
        peft's format beside it (out_dir/adapter)."""
        if not self.lora_scalings:
            self.backend.save_hf(out_dir)
            return
        export_lora(self.backend.named_full_parameters(), self.lora_scalings, self.backend.module, out_dir,
                    self.cfg.model.lora, self.cfg.model.path, write=self.rank == 0)
        barrier()

    def _request_stop(self, signum, frame) -> None:
        self.stop_signal = signum
        # A second signal must still be able to end a rank that is stuck.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    def save_checkpoint(self) -> Path:
        """Write this step's checkpoint (collective; what it holds: trainer/checkpoint_io.py)."""
        return checkpoint_io.save_checkpoint(self)

    def load_checkpoint(self, path: Path) -> None:
        """Continue exactly where the checkpoint left off (every rank)."""
        if self.role == "rollout":
            resume_rollout_rank(self, path)
        else:
            checkpoint_io.load_checkpoint(self, path)

    def _maybe_evaluate(self, step: int) -> None:
        if not self.eval_sources or not self.cfg.eval.every_steps:
            return
        if self.policy_ema is not None:  # evaluate the EMA policy, then restore the live one
            self.engine.update_weights(self.policy_ema.items())
        metrics = self.evaluate_engine()
        if self.policy_ema is not None:
            self.engine.update_weights(self.policy_weights())
        self.eval_history.append((step, metrics["eval/accuracy"]))
        self.logger.log(step, metrics)

    def _evaluated_weights(self, version: int):
        """An async trainer: what the rollout ranks evaluate at weights `version` instead of the
        policy, if they evaluate it (the policy EMA), else None."""
        due = evaluation_due(version, self.cfg.eval.every_steps, self.cfg.train.total_steps, self.eval_sources)
        return self.policy_ema.items() if self.policy_ema is not None and due else None

    def evaluate_engine(self) -> dict[str, float]:
        """Held-out accuracy of the weights the engine serves (every rank that generates)."""
        progress.enter(f"step {self.global_step}: evaluation")
        return evaluate(self.engine, self.eval_prompts, self.rewards, self.maker.settings, self.eval_sources)

    def _check_rewards_not_all_zero(self, experiences: list[Experience]) -> None:
        # A dense-only mix scores through dense_reward: any non-zero token reward counts.
        nonzero, count = all_reduce_sum(
            torch.tensor([float(sum(e.reward != 0 or any(e.dense_reward or []) for e in experiences)), len(experiences)])
        ).tolist()
        if count == 0:  # every prompt of the step was skipped (bad input): nothing was scored
            return
        stop = self.zero_reward_watch.update(all_zero=nonzero == 0)
        problem = (
            f"every reward was exactly 0 for {self.zero_reward_watch.streak} consecutive steps: "
            f"check the reward recipes ({', '.join(self.rewards.component_names())}); usually a broken verifier"
        )
        if stop:
            raise RewardError(problem)
        if self.zero_reward_watch.warn_now() and self.rank == 0:
            print(f"vlrft: warning: {problem} (algo.zero_reward_patience makes this an error)", flush=True)
