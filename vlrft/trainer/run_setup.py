"""The trainer's setup steps other than the models (trainer/models_setup.py), in the order
SPMDTrainer runs them: join the run (process), data, engine, rewards and the experience maker,
guards, policy EMA, logging. Each returns what it built; the trainer holds it."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from vlrft.algo.kl import FixedKLController
from vlrft.algo.value import ReturnStats
from vlrft.config import Config, RecipeSpec, component_name, to_dict
from vlrft.config_checks import check_world_size
from vlrft.data.columns import columns_from
from vlrft.data.encoding import PromptEncoder
from vlrft.data.media import media_from
from vlrft.data.ptx import PtxStream
from vlrft.data.sampler import PromptSampler
from vlrft.distributed import init_distributed, local_world_size, rank, world_size
from vlrft.engines import ENGINES
from vlrft.experience.maker import FastExperienceMaker
from vlrft.isolation.sandbox import configure as sandbox_settings
from vlrft.metrics import ConsoleSink, JsonlSink, MetricsLogger
from vlrft.metrics.external_sinks import configured_sinks
from vlrft.models.hub import resolve_model_paths
from vlrft.models.loader import banned_token_ids, stop_token_ids
from vlrft.rewards.mix import RewardMix
from vlrft.trainer.bad_input import BadInput
from vlrft.trainer.build import kl_controller, maker_settings, multi_turn, reward_shaper
from vlrft.trainer.checkpoint import rng_state, set_rng_state
from vlrft.trainer.guards import RunGuards
from vlrft.trainer.models_setup import Models
from vlrft.trainer.run_lock import claim_run_dir
from vlrft.trainer.run_start import start_run
from vlrft.trainer.weights_delivery import WEIGHTS_SOURCE, RolloutRanks, WeightsRoutes, take_async_role
from vlrft.trajectory.saver import TrajectorySaver


@dataclass
class Process:
    """This rank's place in the run. Asynchronous training: the rank generates or trains, and
    its rank and world are those of its role (trainer/async_roles.py)."""

    rank: int
    world_size: int
    role: str  # "both" (a synchronous run), else the async role: "rollout" or "trainer"
    weights: WeightsRoutes | None  # an async run's routes of the weights (None: synchronous)
    resume_from: Path | None  # the checkpoint the run continues from (None: it starts over)
    start_step: int  # that checkpoint's step (0: none)


def setup_process(cfg: Config) -> Process:
    """Join the run: the process group, the sandbox's settings (before any worker process
    starts), the world size checked, hub ids made local directories, this rank's seed, the run
    directory claimed and the resume decided, and for async training this rank's role."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per rank per checkpoint load is noise
    me, world = init_distributed()
    unisolated = sandbox_settings(cfg.sandbox.unsafe_no_isolation)
    if unisolated and me == 0:
        print(unisolated, file=sys.stderr, flush=True)
    check_world_size(cfg, world, local_world_size())
    resolve_model_paths(cfg)  # hub ids -> local snapshot directories
    torch.manual_seed(cfg.train.seed + me)  # ranks sample different responses
    out_dir = Path(cfg.output.dir)
    claim_run_dir(out_dir, me)  # before anything in it is read, written or discarded
    resume_from, start_step = start_run(cfg, out_dir, me, world)
    role, weights = "both", None
    if cfg.train.mode == "async":
        role, weights = take_async_role(cfg.rollout.ranks, cfg.train.partial_rollouts)
        me, world = rank(), world_size()
        torch.manual_seed(cfg.train.seed + me)  # a role's rank k samples as a sync run's rank k
    return Process(me, world, role, weights, resume_from, start_step)


@dataclass
class RunData:
    """The run's prompts as this rank sees them."""

    encoder: PromptEncoder
    stop_ids: list[int]
    bad_input: BadInput  # the rows skipped (data.on_bad_sample) and the placeholder prompt
    train_rows: list[dict]  # every training row (the sampler picks this rank's)
    train_sources: list[str]  # their data_source values, sorted
    eval_sources: list[str]  # the held-out rows' data_source values, sorted
    eval_prompts: list  # this rank's held-out prompts, encoded (none on a rank that does not generate)
    ptx: PtxStream | None  # the pretraining rows mixed into the update (data.ptx_path; ranks that train)
    sampler: PromptSampler  # which training rows each step takes


def setup_data(cfg: Config, me: int, world: int, generates: bool, trains: bool) -> RunData:
    """Tokenizer and processor, the training and held-out rows, PTX rows, the prompt sampler."""
    encoder = PromptEncoder.for_config(cfg)
    stop_ids = stop_token_ids(encoder.tokenizer)
    bad_input = BadInput(cfg.data.on_bad_sample, me, world, columns_from(cfg.data), media_from(cfg.data))
    train_rows = bad_input.load(cfg.data.train_path)
    eval_rows = bad_input.load(cfg.data.eval_path)[: cfg.eval.max_prompts] if cfg.data.eval_path else []
    mine = [(r, i) for i, r in enumerate(eval_rows) if i % world == me and generates]
    eval_prompts = bad_input.encode_at_start(encoder, mine)
    ptx = None
    if cfg.data.ptx_path and trains:
        ptx = PtxStream(cfg.data.ptx_path, encoder, cfg.data.ptx_rows_per_step, me, world, stop_ids[0], bad_input)
    return RunData(
        encoder=encoder,
        stop_ids=stop_ids,
        bad_input=bad_input,
        train_rows=train_rows,
        train_sources=sorted({row["data_source"] for row in train_rows}),
        eval_sources=sorted({row["data_source"] for row in eval_rows}),
        eval_prompts=eval_prompts,
        ptx=ptx,
        sampler=PromptSampler(len(train_rows), cfg.rollout.rollout_prompts, me, world, cfg.train.seed),
    )


def setup_engine(cfg: Config, process: Process, data: RunData, evaluated_weights: Callable, policy_weights: Callable):
    """The rollout engine (a rank that generates), or an async trainer's stand-in for it: the
    rollout ranks, reached by broadcast (`evaluated_weights`, `policy_weights`: the trainer's
    methods RolloutRanks sends from). Last of the models: vLLM starts only if its share of the
    GPU is still free. It reseeds every generator as it starts (seed + TP group): this rank
    keeps its own streams."""
    streams = rng_state()
    if process.role == "trainer":
        engine = RolloutRanks(process.weights, WEIGHTS_SOURCE, process.rank == 0, evaluated_weights, policy_weights)
    else:
        tokenizer = data.encoder.tokenizer
        engine = ENGINES.get(cfg.rollout.engine)(cfg, tokenizer, data.stop_ids, banned_token_ids(tokenizer))
    set_rng_state(streams)
    return engine


def setup_rewards(cfg: Config) -> tuple[FixedKLController, ReturnStats | None, RewardMix]:
    """(KL controller, return statistics for value normalisation or None, the reward mix)."""
    return_stats = None
    if cfg.critic.value_norm != "none":
        return_stats = ReturnStats(cfg.critic.value_norm, cfg.critic.value_norm_beta)
    return kl_controller(cfg), return_stats, RewardMix(cfg.reward)


def setup_maker(cfg: Config, engine, models: Models, rewards: RewardMix, controller: FixedKLController,
                return_stats: ReturnStats | None, data: RunData, generates: bool) -> FastExperienceMaker:
    """The experience maker: generation, rewards, the experience pass. Environments run where
    trajectories are generated: not on an async run's trainers."""
    environments = multi_turn(cfg, data.encoder, data.stop_ids) if generates else None
    return FastExperienceMaker(
        engine=engine,
        policy=lambda: models.policy.model,  # (rollout ranks never call these)
        reference=models.reference,
        rewards=rewards,
        shape_rewards=reward_shaper(cfg),
        settings=maker_settings(cfg, controller, models.image_check, environments),
        critic=(lambda: models.critic.model) if models.critic is not None else None,
        return_stats=return_stats,
        teacher=models.teacher,
    )


def setup_guards(cfg: Config, engine, process: Process, rewards: RewardMix) -> RunGuards:
    """The run's watches (guards.*). The weight-sync probe needs the engine beside the policy:
    off on the roles of async training; the digests are checked where an engine loads weights."""
    accuracy = component_name(RecipeSpec(recipe=cfg.reward.accuracy_recipe))
    return RunGuards(cfg.guards, engine, cfg.rollout.engine, rewards.component_names(), process.rank, accuracy,
                     probes=process.role == "both", dtype=cfg.model.compute_dtype)


def setup_policy_ema(cfg: Config, trains: bool, policy_weights: Callable) -> dict[str, torch.Tensor] | None:
    """The policy EMA for evaluation and export (train.ema_beta > 0): full tensors on CPU, by HF
    parameter name, on the ranks that train (an async run's trainers send it to the rollout
    ranks to evaluate). A collective under ZeRO-3."""
    if cfg.train.ema_beta > 0 and trains:
        return {n: t.detach().float().cpu().clone() for n, t in policy_weights()}
    return None


def setup_logging(cfg: Config, out_dir: Path, writes_output: bool, start_step: int, me: int,
                  tokenizer) -> tuple[MetricsLogger, TrajectorySaver]:
    """The metric sinks (console, metrics.jsonl, logging.*) and config.json, on the rank that
    writes the run's files; every rank's trajectory saver."""
    sinks = []
    if writes_output:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        sinks = [ConsoleSink(cfg.train.total_steps, start_step), JsonlSink(out_dir / "metrics.jsonl")]
        sinks += configured_sinks(cfg.logging, out_dir, to_dict(cfg), start_step)
    return MetricsLogger(sinks), TrajectorySaver(out_dir, me, tokenizer, cfg.trajectory.save_every)
