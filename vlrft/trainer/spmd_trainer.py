"""SPMDTrainer: the loop every rank runs, top to bottom.

sample -> generate -> reward -> (filter) -> logprobs/values -> advantages -> critic and policy
update -> sync -> log/evaluate -> save
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import torch

from vlrft.algo.shaping import ZeroRewardWatch
from vlrft.config import Config
from vlrft.console import say
from vlrft.experience.replay_buffer import ReplayBuffer
from vlrft.models.lora import dropout_active, export_lora, merged_weights
from vlrft.rewards.mix import RewardError
from vlrft.trainer.build import update_settings
from vlrft import progress
from vlrft.trainer import checkpoint_io
from vlrft.trainer.checkpoint_io import TrainingStopped
from vlrft.trainer.checkpoint import checkpoint_due
from vlrft.trainer.critic_update import critic_update
from vlrft.distributed import all_reduce_sum, barrier
from vlrft.trainer.async_roles import evaluation_due, resume_rollout_rank, run_role
from vlrft.trainer.dynamic_sampling import sample_groups
from vlrft.trainer.evaluate import evaluate
from vlrft.trainer.models_setup import declare_modalities, setup_models
from vlrft.trainer.rank_balance import balance_across_ranks
from vlrft.trainer.rollback import Rollbacks, roll_back
from vlrft.trainer.rollout_metrics import mark_correct, rollout_metrics
from vlrft.trainer.run_setup import (
    setup_data,
    setup_engine,
    setup_guards,
    setup_logging,
    setup_maker,
    setup_policy_ema,
    setup_process,
    setup_rewards,
)
from vlrft.trainer.trajectory_metrics import trajectory_metrics
from vlrft.trainer.step_api import response_logprobs, train_on_responses
from vlrft.trainer.update import policy_update
from vlrft.types import Experience


class SPMDTrainer:
    """One trainer for text and vision-language policies: modality is data, not a subclass."""

    def __init__(self, cfg: Config):
        """The setup steps (trainer/run_setup.py, trainer/models_setup.py). Their order matters:
        the data before the models (the vision modalities), the models before the engine (vLLM
        takes the GPU memory left), a resumed checkpoint last."""
        self.cfg = cfg
        process = setup_process(cfg)
        self.rank, self.world_size, self.role = process.rank, process.world_size, process.role
        self.weights = process.weights  # an async run's routes of the weights (weights_delivery.WeightsRoutes)
        self.weights_version = 0  # an async rollout rank's engine: the policy version it holds
        self.started_ahead = []  # an async rollout rank's next batches, started early (async_roles.StartedBatch)
        self.out_dir, self.global_step = Path(cfg.output.dir), 0
        generates, trains = self.role != "trainer", self.role != "rollout"
        self.writes_output = self.rank == 0 and trains  # one rank writes the run's files: the first that trains

        data = setup_data(cfg, self.rank, self.world_size, generates, trains)
        self.encoder, self.stop_ids, self.bad_input, self.ptx = data.encoder, data.stop_ids, data.bad_input, data.ptx
        self.train_rows, self.train_sources, self.sampler = data.train_rows, data.train_sources, data.sampler
        self.eval_sources, self.eval_prompts = data.eval_sources, data.eval_prompts
        self.models = setup_models(cfg, self.rank, trains, data)
        self.engine = setup_engine(cfg, process, data, self._evaluated_weights, self.policy_weights)
        self.kl_controller, self.return_stats, self.rewards = setup_rewards(cfg)
        self.maker = setup_maker(cfg, self.engine, self.models, self.rewards, self.kl_controller, self.return_stats,
                                 data, generates)
        self.update_settings = update_settings(cfg)
        self.guards = setup_guards(cfg, self.engine, process, self.rewards)
        self.policy_ema = setup_policy_ema(cfg, trains, self.policy_weights)
        self.buffer = ReplayBuffer(cfg.train.micro_batch_tokens, seed=cfg.train.seed + self.rank,
                                   share_prompts=cfg.train.share_prompts)
        self.logger, self.saver = setup_logging(cfg, self.out_dir, self.writes_output, process.start_step, self.rank,
                                                self.encoder.tokenizer)
        self.eval_history: list[tuple[int, float]] = []
        self.zero_reward_watch = ZeroRewardWatch(cfg.algo.zero_reward_patience)
        self.rollbacks = Rollbacks()  # guards.on_collapse: rollback (checkpointed)
        # A preemption (SIGTERM) or Ctrl-C ends the current step, saves a checkpoint, then stops
        # (async: the trainers decide, after the step a signal reached any rank in).
        self.stop_signal: int | None = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._request_stop)
        if process.resume_from is not None:
            self.load_checkpoint(process.resume_from)

    # The models the trainer holds (trainer/models_setup.py: Models), by the names the loop,
    # checkpoints and the step API use; read-only, the holder owns them. None where this rank
    # holds no such model (an async run's rollout ranks hold none).
    backend = property(lambda self: self.models.policy)  # the policy under its training backend
    critic = property(lambda self: self.models.critic)  # the value model under its own backend
    reference = property(lambda self: self.models.reference)  # the frozen policy of the KL
    lora_scalings = property(lambda self: self.models.lora_scalings)  # empty: full fine-tuning
    frozen_vision_parameters = property(lambda self: self.models.frozen_vision_parameters)
    image_check = property(lambda self: self.models.image_check)  # None for a text policy

    def declare_vision_modalities(self, modalities: set[str]) -> None:
        """A vision-language policy's tower runs for the modalities some rank's data holds, on
        every model that calls it (trainer/vision_modalities.py). A collective of the ranks that train."""
        declare_modalities(self.models, modalities, self.rank == 0)

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
        metrics |= self.guards.after_learning(self.global_step, metrics)  # collapse and plateau
        if self.guards.rollback_due is not None:
            metrics |= roll_back(self, self.guards.rollback_due)
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

        self.guards.digests.update(params(), f"after step {self.global_step}")

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
            self.guards.digests.update(self.policy_ema.items(), f"of the policy EMA at step {step}")
        metrics = self.evaluate_engine()
        if self.policy_ema is not None:
            self.guards.digests.update(self.policy_weights(), f"after evaluating the policy EMA at step {step}")
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
        if not self.rewards.component_names():  # pure distillation: no recipe, every reward is 0
            return
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
            say(f"vlrft: warning: {problem} (algo.zero_reward_patience makes this an error)")
