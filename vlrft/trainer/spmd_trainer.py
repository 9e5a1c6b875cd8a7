"""SPMDTrainer: the loop every rank runs, top to bottom.

sample -> generate -> reward -> logprobs -> advantages -> update -> sync -> log/evaluate -> save
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch

from vlrft.algo import ADVANTAGES
from vlrft.algo.shaping import ZeroRewardWatch, transform_rewards, zero_truncated
from vlrft.config import Config, check_world_size, to_dict
from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.data.sampler import PromptSampler
from vlrft.engines import ENGINES, SamplingParams
from vlrft.experience.maker import FastExperienceMaker
from vlrft.experience.replay_buffer import ReplayBuffer
from vlrft.metrics import ConsoleSink, JsonlSink, MetricsLogger
from vlrft.models.loader import banned_token_ids, load_model, stop_token_ids
from vlrft.rewards.mix import RewardError, RewardMix, component_name
from vlrft.trainer.distributed import all_reduce_sum, init_distributed
from vlrft.trainer.evaluate import evaluate
from vlrft.trainer.update import policy_update
from vlrft.types import Experience


def reward_shaper(cfg: Config):
    """(rewards [N], truncated [N]) -> the rewards the advantage estimator sees."""
    algo = cfg.algo

    def shape(rewards: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        if algo.zero_reward_truncated:
            rewards = zero_truncated(rewards, truncated)
        return transform_rewards(rewards, algo.reward_bias, algo.reward_scale, algo.reward_clip)

    return shape


def advantage_estimator(cfg: Config):
    """The configured estimator with its options bound: (rewards [N], group_ids [N]) -> [N]."""
    estimator = ADVANTAGES.get(cfg.algo.advantage)
    if cfg.algo.advantage == "grpo":
        return functools.partial(estimator, scale_by_std=cfg.algo.scale_by_std)
    return estimator


class SPMDTrainer:
    """One trainer for text and vision-language policies: modality is data, not a subclass."""

    def __init__(self, cfg: Config):
        from transformers.utils import logging as hf_logging

        from vlrft.backends.deepspeed_backend import DeepSpeedBackend  # heavy import, only here

        hf_logging.disable_progress_bar()  # one bar per rank per checkpoint load is noise
        self.cfg = cfg
        self.rank, self.world_size = init_distributed()
        check_world_size(cfg, self.world_size)
        torch.manual_seed(cfg.train.seed + self.rank)  # ranks sample different responses
        self.out_dir = Path(cfg.output.dir)

        self.encoder = PromptEncoder(cfg.model.path, cfg.data.min_pixels, cfg.data.max_pixels, cfg.data.max_prompt_tokens)
        tokenizer = self.encoder.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_token_ids(tokenizer)[0]
        self.train_rows = load_rows(cfg.data.train_path)
        eval_rows = load_rows(cfg.data.eval_path)[: cfg.eval.max_prompts] if cfg.data.eval_path else []
        self.eval_sources = sorted({row["data_source"] for row in eval_rows})
        self.eval_prompts = [self.encoder.encode(r, i) for i, r in enumerate(eval_rows) if i % self.world_size == self.rank]

        self.backend = DeepSpeedBackend(
            load_model(cfg.model.path),
            lr=cfg.train.lr,
            weight_decay=cfg.train.weight_decay,
            grad_clip=cfg.train.grad_clip,
            zero_stage=cfg.train.zero_stage,
            lr_schedule=cfg.train.lr_schedule,
            total_optimizer_steps=cfg.train.total_steps * cfg.train.ppo_epochs,
        )
        self.engine = ENGINES.get(cfg.rollout.engine)(
            model_path=cfg.model.path,
            tokenizer=tokenizer,
            stop_ids=stop_token_ids(tokenizer),
            banned_ids=banned_token_ids(tokenizer),
        )
        reference = None
        if cfg.algo.kl.coef > 0:
            reference = load_model(cfg.model.ref_path or cfg.model.path).eval().requires_grad_(False)
        self.rewards = RewardMix(cfg.reward)
        self.component_names = sorted(
            {component_name(s) for mix in [cfg.reward.default, *cfg.reward.by_data_source.values()] for s in mix}
        )
        sampling = SamplingParams(
            n=cfg.rollout.n_samples_per_prompt,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
        )
        self.maker = FastExperienceMaker(
            engine=self.engine,
            policy=lambda: self.backend.model,
            reference=reference,
            rewards=self.rewards,
            advantage_fn=advantage_estimator(cfg),
            shape_rewards=reward_shaper(cfg),
            sampling=sampling,
            micro_batch_tokens=cfg.train.micro_batch_tokens,
            pad_id=self.pad_id,
        )
        self.buffer = ReplayBuffer(cfg.train.micro_batch_tokens, self.pad_id, seed=cfg.train.seed + self.rank)
        self.sampler = PromptSampler(
            len(self.train_rows), cfg.rollout.rollout_prompts, self.rank, self.world_size, cfg.train.seed
        )
        sinks = []
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
            sinks = [ConsoleSink(cfg.train.total_steps), JsonlSink(self.out_dir / "metrics.jsonl")]
        self.logger = MetricsLogger(sinks)
        self.eval_history: list[tuple[int, float]] = []
        self.zero_reward_watch = ZeroRewardWatch(cfg.algo.zero_reward_patience)

    def train(self) -> list[tuple[int, float]]:
        cfg = self.cfg
        self._maybe_evaluate(0)
        for step in range(1, cfg.train.total_steps + 1):
            self.logger.log(step, self.train_step())
            if cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or step == cfg.train.total_steps):
                self._maybe_evaluate(step)
        self.backend.save_hf(self.out_dir / "final")
        if self.rank == 0:
            self.encoder.tokenizer.save_pretrained(self.out_dir / "final")
            if self.encoder.image_processor is not None:
                self.encoder.image_processor.save_pretrained(self.out_dir / "final")
        self.logger.close()
        return self.eval_history

    def train_step(self) -> dict[str, float]:
        """One RL step: sample, generate and score, update, sync the engine. Returns metrics."""
        start = time.perf_counter()
        prompts = [self.encoder.encode(self.train_rows[row], pos) for pos, row in self.sampler.next_indices()]
        experiences = self.maker.make(prompts)
        made = time.perf_counter()
        self.buffer.clear()
        self.buffer.add(experiences)
        metrics = self._rollout_metrics(experiences)
        self._check_rewards_not_all_zero(experiences)
        metrics["train/lr"] = self.backend.lr  # the lr this step's update uses
        metrics |= policy_update(self.backend, self.buffer, self.cfg, self.world_size)
        self.engine.update_weights(self.backend.named_full_parameters())
        metrics["perf/experience_seconds"] = made - start
        metrics["perf/step_seconds"] = time.perf_counter() - start
        return metrics

    def _maybe_evaluate(self, step: int) -> None:
        if not self.eval_sources or not self.cfg.eval.every_steps:
            return
        metrics = evaluate(self.engine, self.eval_prompts, self.rewards, self.cfg.rollout.max_new_tokens, self.eval_sources)
        self.eval_history.append((step, metrics["eval/accuracy"]))
        self.logger.log(step, metrics)

    def _check_rewards_not_all_zero(self, experiences: list[Experience]) -> None:
        nonzero = all_reduce_sum(torch.tensor([float(sum(e.reward != 0 for e in experiences))]))
        if self.zero_reward_watch.update(all_zero=float(nonzero) == 0):
            raise RewardError(
                f"every reward was exactly 0 for {self.zero_reward_watch.streak} consecutive steps: "
                f"check the reward recipes ({', '.join(self.component_names)}); usually a broken verifier"
            )

    def _rollout_metrics(self, experiences: list[Experience]) -> dict[str, float]:
        """Means over all ranks of rewards (total and per component), lengths, truncation."""
        names = self.component_names
        local = torch.zeros(4 + 2 * len(names))
        for e in experiences:
            local[:4] += torch.tensor([1.0, e.reward, len(e.rollout.response_ids), float(e.rollout.truncated)])
            for j, name in enumerate(names):
                if name in e.reward_components:
                    local[4 + 2 * j] += e.reward_components[name]
                    local[5 + 2 * j] += 1.0
        total = all_reduce_sum(local)
        n = max(float(total[0]), 1.0)
        metrics = {
            "rollout/reward_mean": float(total[1]) / n,
            "rollout/response_length": float(total[2]) / n,
            "rollout/truncated_frac": float(total[3]) / n,
        }
        for j, name in enumerate(names):
            if total[5 + 2 * j] > 0:
                metrics[f"reward/{name}"] = float(total[4 + 2 * j] / total[5 + 2 * j])
        return metrics
