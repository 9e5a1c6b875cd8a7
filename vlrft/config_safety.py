"""The config sections that keep a run safe and honest: the guards (failures that would not
raise) and the sandbox for model-written code. Sections of vlrft.config.Config, kept here so
that module stays a readable size; import them from vlrft.config like the others."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GuardsConfig:
    # Failures that would otherwise go unnoticed stop the run (or warn) with one line naming the
    # culprit (docs/guards.md). 0 turns a guard off.
    # After each weight sync the engine reports a digest of every tensor it serves; one that is
    # not the trainer's, bit for bit in the engine's dtype, stops the run naming it.
    sync_digest: bool = True
    # And the engine and the trainer score the same probe response; a mean per-token logprob gap
    # above this stops the run. None: the limit measured for the engine and precision
    # (trainer/sync_check.py, docs/guards.md).
    sync_max_logprob_gap: float | None = None
    # Wall-clock budget of one step's reward and environment calls, per rank: a call still
    # running when it is spent stops the run, naming the recipe and the sample.
    step_reward_budget_s: float = 600.0
    # A reward component that gave every sample 0 (or the same penalty) for this many steps in a
    # row, while another component paid out, is reported by name.
    component_patience: int = 10
    # Steps over which host (and CUDA) memory that only grows is reported, with its slope.
    memory_window: int = 20
    # A rank that has not been heard from for this long is taken as dead: every rank stops.
    peer_timeout_s: float = 60.0
    # When no rank has moved to a new phase of its loop (generation, the update, a wait for
    # weights, ...) for this long, the job is taken as hung: every rank stops, saying where each
    # was. Needs the watch of peer_timeout_s (several ranks).
    stall_timeout_s: float = 1800.0
    # Collapse (trainer/run_health.py): rollout/accuracy fell by this share of its peak of the
    # last collapse_window steps, with the entropy or length doubling/halving or another reward
    # component falling as well: warn, stop (on_collapse) with one line naming the cause, or
    # rollback: restore the policy of the newest checkpoint before the fall and go on with the
    # learning rate times rollback_lr_factor (trainer/rollback.py).
    collapse_drop: float = 0.3
    collapse_window: int = 5
    on_collapse: str = "warn"  # warn | stop | rollback
    rollback_lr_factor: float = 0.5
    # Plateau: no new best rollout/accuracy (by more than plateau_tolerance) for this many steps
    # below 0.95, named with or without a signal (groups whose rewards differ).
    plateau_patience: int = 40
    plateau_tolerance: float = 0.05


@dataclass
class SandboxConfig:
    # Model-written code (the code_unit_tests recipe, the python tool) runs in a bubblewrap
    # sandbox; where there is none the run refuses to start. true runs it anyway, guarded only
    # inside the interpreter, which a determined program can get past (docs/reward_recipes.md).
    unsafe_no_isolation: bool = False

