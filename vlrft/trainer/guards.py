"""The run's guards (docs/guards.md): what the trainer checks every step so that a failure that
would not raise stops the run, or warns, with one line naming the culprit.

- weight sync: the engine serves what the trainer trained (trainer/sync_check.py)
- reward and environment stalls: a step's calls fit a wall-clock budget (isolation/budget.py)
- stuck reward components and memory growth (trainer/watches.py)

(A rank that fails or dies stops every rank: vlrft/rank_watch.py. Rewards that are all zero:
`algo.zero_reward_patience`.)"""

from __future__ import annotations

import torch

from vlrft.config import GuardsConfig
from vlrft.console import say
from vlrft.distributed import all_gather_1d, all_gather_objects
from vlrft.isolation.budget import CALL_KINDS, STEP_BUDGET
from vlrft.trainer.run_health import Collapse, CollapseError, HealthWatch
from vlrft.engines.weight_digest import DigestCheck
from vlrft.trainer.sync_check import SyncCheck, gap_limit
from vlrft.models.compiled_layers import compiled_frames
from vlrft.trainer.watches import (
    CompileWatch,
    ComponentWatch,
    MemoryWatch,
    MIB,
    component_ranges,
    memory_metrics,
    merge_ranges,
    stuck_components,
)
from vlrft.types import Experience


class RunGuards:
    """`engine`: the one beside this rank's policy, None on an async trainer (it has none);
    `probes`: whether the logprob probe can run there (the policy and the engine on one rank)."""

    def __init__(self, cfg: GuardsConfig, engine, engine_name: str, component_names: list[str], rank: int,
                 accuracy_component: str = "", probes: bool = True, dtype: str = "float32"):
        self.cfg, self.rank = cfg, rank
        self.health = HealthWatch(cfg.collapse_drop, cfg.collapse_window, cfg.plateau_patience, cfg.plateau_tolerance,
                                  accuracy_component)
        self.component_names = component_names
        self.sync = SyncCheck(engine if probes else None, engine_name,
                              gap_limit(cfg.sync_max_logprob_gap, engine_name, dtype))
        # Every weight update of the engine goes through it (sync, resume, rollback, async delivery).
        self.digests = DigestCheck(engine, engine_name, cfg.sync_digest)
        self.components = ComponentWatch(cfg.component_patience)
        self.memory = {"perf/host_rss_gib": MemoryWatch(cfg.memory_window),
                       "perf/cuda_allocated_gib": MemoryWatch(cfg.memory_window)}
        self.compiles = CompileWatch(compiled_frames())
        self.rollback_due: Collapse | None = None  # guards.on_collapse rollback: the trainer rolls back

    def start_step(self) -> None:
        STEP_BUDGET.start(self.cfg.step_reward_budget_s)

    def before_update(self, model: torch.nn.Module, experiences: list[Experience]) -> None:
        self.sync.before_update(model, experiences)

    def after_sync(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        metrics = {"perf/sync_digest_seconds": self.digests.seconds} if self.digests.enabled else {}
        return metrics | self.sync.after_sync(model, step)

    def after_step(self, generated: list[Experience]) -> dict[str, float]:
        """Slowest calls, stuck components and memory of the step (a collective); warns."""
        slowest = all_gather_1d(torch.tensor([STEP_BUDGET.slowest[kind] for kind in CALL_KINDS]))
        slowest = slowest.view(-1, len(CALL_KINDS)).max(dim=0).values.tolist()
        metrics = {f"perf/slowest_{kind}_call_seconds": seconds for kind, seconds in zip(CALL_KINDS, slowest)}
        metrics |= self._components(generated)
        return metrics | self._memory() | self._compiles()

    def after_learning(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Collapse and plateau (trainer/run_health.py) from the step's metrics, the same on every
        rank that trains: rank 0 warns; with guards.on_collapse stop every such rank raises, with
        rollback `rollback_due` holds the collapse for the trainer (trainer/rollback.py).
        Returns `guards/collapse` and `guards/plateau` (1 at the step a warning fires; the report
        marks them on its curves)."""
        lines, collapse = self.health.update(step, metrics)
        if collapse is not None and self.cfg.on_collapse == "stop":
            raise CollapseError(lines[0].removeprefix("vlrft: warning: ") + "; stopped (guards.on_collapse: stop)")
        self.rollback_due = collapse if self.cfg.on_collapse == "rollback" else None
        for line in lines:
            if self.rank == 0:
                say(line)
        return {"guards/collapse": float(collapse is not None),
                "guards/plateau": float(any(": warning: plateau" in line for line in lines))}

    def _compiles(self) -> dict[str, float]:
        """Frames torch.compile compiled on this rank during the step (model.compile, the HF
        engine's static decode); nothing while it never compiled anything."""
        frames = compiled_frames()
        if frames == 0:
            return {}
        new, streak = self.compiles.update(frames)
        if streak:
            say(f"vlrft: warning: rank {self.rank}: torch.compile compiled again at each of the last "
                f"{self.compiles.patience} steps ({new} frames this step): something the compiled code depends on "
                "changes every step; TORCH_LOGS=recompiles names it (model.compile)")
        return {"perf/compiles": float(new)}

    def _components(self, generated: list[Experience]) -> dict[str, float]:
        local = component_ranges([e.reward_components for e in generated], self.component_names)
        stuck = stuck_components(merge_ranges(all_gather_objects(local)))
        for name in self.components.update(stuck):
            if self.rank == 0:
                paying = ", ".join(n for n in self.component_names if n not in stuck)
                say(f"vlrft: warning: reward component '{name}' gave every sample the same score (0 or less) for "
                    f"{self.cfg.component_patience} steps while {paying} paid out: a broken verifier, or a task "
                    "too hard for the policy yet (guards.component_patience)")
        return {"reward/stuck_components": float(len(stuck))}

    def _memory(self) -> dict[str, float]:
        mine = memory_metrics()
        for key, value in mine.items():
            watch = self.memory.get(key)
            slope = watch.update(value * 2**30) if watch is not None else None
            if slope is not None:
                say(f"vlrft: warning: rank {self.rank}: {key.split('/')[1]} grew at every one of the last "
                    f"{self.cfg.memory_window} steps, by {slope / MIB:.1f} MiB per step (now {value:.2f} GiB): "
                    "something is kept from step to step (guards.memory_window)")
        values = all_gather_1d(torch.tensor(list(mine.values()), dtype=torch.float64)).view(-1, len(mine))
        return dict(zip(mine, values.max(dim=0).values.tolist()))  # the largest rank's
