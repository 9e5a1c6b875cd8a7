"""Runs that go wrong without raising: a collapse (the accuracy falls within a few steps, with the
entropy, the response length or a format reward changing at the same time, or for two steps in
a row) and a plateau (the accuracy does not move for many steps). Both read the step's metrics (the same on every rank:
they are all-reduced), and warn with one line naming the metrics, the step and the likely cause.

The decisions are pure functions of the metric history (`collapse_of`, `plateau_of`); the
`HealthWatch` keeps the history and warns once per streak.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlrft.errors import VlrftError

ACCURACY = "rollout/accuracy"  # the accuracy recipe's mean over the step's responses
ENTROPY = "rollout/entropy"
LENGTH = "rollout/response_length"
NO_SIGNAL = "traj/zero_variance_group_frac"  # groups whose responses all got the same reward
MIN_FALL = 0.1  # an accuracy fall smaller than this (absolute) is noise, whatever its share
CONVERGED = 0.95  # a run this accurate is done, not stuck


class CollapseError(VlrftError, RuntimeError):
    """guards.on_collapse stop: the run collapsed; the message is the warning's line."""


@dataclass(frozen=True)
class Collapse:
    started: int  # the first step after the peak
    cause: str  # entropy blow-up | entropy collapse | length collapse | length blow-up | format collapse | accuracy collapse
    line: str  # what was seen, metric by metric


@dataclass(frozen=True)
class Plateau:
    since: int  # the step of the last improvement
    signal: bool  # whether most groups still had rewards that differed (a signal the policy did not follow)
    line: str


def _causes(peak: dict, now: dict, accuracy_key: str, drop: float) -> list[tuple[str, str]]:
    """(cause, what changed) for every change between the peak step and now that explains a fall."""
    found = []
    for key, up, down in ((ENTROPY, "entropy blow-up", "entropy collapse"), (LENGTH, "length blow-up", "length collapse")):
        if key in peak and key in now and peak[key] > 0:
            ratio = now[key] / peak[key]
            if ratio >= 2.0 or ratio <= 0.5:
                found.append((up if ratio >= 2.0 else down, f"{key} {peak[key]:.3g} -> {now[key]:.3g}"))
    for key in sorted(peak):  # a reward component other than the accuracy's that fell with it
        if key.startswith("reward/") and key.endswith("/mean") and key in now and accuracy_key not in key:
            if peak[key] > 0 and peak[key] - now[key] >= drop * peak[key]:
                found.append(("format collapse", f"{key} {peak[key]:.3g} -> {now[key]:.3g}"))
    return found


def collapse_of(history: list[dict], drop: float, window: int, accuracy_recipe: str = "") -> Collapse | None:
    """A collapse at the last step of `history` (one metrics dict per step, each with "step"):
    the accuracy fell from its peak of the last `window` steps by at least `drop` of that peak
    (and by MIN_FALL), while the entropy or the response length doubled or halved, or another
    reward component fell by `drop` of its own peak; or, with none of these, the step before
    had fallen as far too (an "accuracy collapse": the policy became sure of other answers, a
    fall that one noisy step does not make). None otherwise."""
    recent = [m for m in history[-(window + 1):] if ACCURACY in m]
    if drop <= 0 or len(recent) < 2:
        return None
    now = recent[-1]
    peak = max(recent[:-1], key=lambda m: m[ACCURACY])
    fall = peak[ACCURACY] - now[ACCURACY]
    if fall < max(drop * peak[ACCURACY], MIN_FALL):
        return None
    causes = _causes(peak, now, f"reward/{accuracy_recipe}/" if accuracy_recipe else ACCURACY, drop)
    if not causes:
        previous = recent[-2]
        if previous is peak or peak[ACCURACY] - previous[ACCURACY] < max(drop * peak[ACCURACY], MIN_FALL):
            return None
        causes = [("accuracy collapse", f"{previous[ACCURACY]:.3g} at step {previous['step']} already; "
                                        "no entropy, length or format change")]
    seen = "; ".join([f"{ACCURACY} {peak[ACCURACY]:.3g} -> {now[ACCURACY]:.3g}"] + [what for _, what in causes])
    return Collapse(started=peak["step"] + 1, cause=causes[0][0], line=seen)


def plateau_of(history: list[dict], patience: int, tolerance: float) -> Plateau | None:
    """A plateau at the last step of `history`: no step of the last `patience` beat the best
    accuracy before them by more than `tolerance`, and no step reached CONVERGED (a run that
    reached it is done, not stuck: it wavers, or it collapses, which collapse_of names). `signal`
    says whether most groups still had rewards that differed (NO_SIGNAL under one half on
    average over those steps). None otherwise."""
    steps = [m for m in history if ACCURACY in m]
    if patience <= 0 or len(steps) <= patience:
        return None
    before, last = steps[:-patience], steps[-patience:]
    best = max(m[ACCURACY] for m in before)
    if max(m[ACCURACY] for m in last) > best + tolerance or max(m[ACCURACY] for m in steps) >= CONVERGED:
        return None
    since = max(before, key=lambda m: m[ACCURACY])["step"]
    no_signal = [m[NO_SIGNAL] for m in last if NO_SIGNAL in m]
    signal = not no_signal or sum(no_signal) / len(no_signal) < 0.5
    line = (f"{ACCURACY} has stayed within {tolerance:g} of {best:.3g} (its best, at step {since}) for {patience} steps; "
            + (f"{NO_SIGNAL} averaged {sum(no_signal) / len(no_signal):.2f}" if no_signal else "no group statistics"))
    return Plateau(since=since, signal=signal, line=line)


PLATEAU_LEVERS = {
    True: ("the groups' rewards differ but the policy does not follow them: a larger train.lr, more "
           "train.ppo_epochs, a smaller algo.kl.coef, or entropy control (algo.entropy_coef)"),
    False: ("no signal: nearly every group's responses got the same reward, so every advantage is 0: a higher "
            "rollout.temperature, more rollout.n_samples_per_prompt, easier prompts, or a partial-credit reward"),
}


class HealthWatch:
    """The metric history of the run and its collapse and plateau streaks (guards.collapse_*,
    guards.plateau_*): `update` returns the lines to print this step (once per streak)."""

    def __init__(self, drop: float, window: int, patience: int, tolerance: float, accuracy_recipe: str):
        self.drop, self.window, self.patience, self.tolerance = drop, window, patience, tolerance
        self.accuracy_recipe = accuracy_recipe
        self.history: list[dict] = []
        self.collapsing = self.plateaued = False

    def reset(self) -> None:
        """Forget the history (a rollback restored an earlier policy: trainer/rollback.py)."""
        self.history.clear()
        self.collapsing = self.plateaued = False

    def update(self, step: int, metrics: dict) -> tuple[list[str], Collapse | None]:
        """Record a step's metrics; (warning lines, the collapse when one starts this step)."""
        self.history.append({"step": step} | {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        del self.history[: -max(self.window + 1, self.patience + 1, 2) * 4]  # bounded: enough for both looks back
        lines, started = [], None
        collapse = collapse_of(self.history, self.drop, self.window, self.accuracy_recipe)
        if collapse is not None and not self.collapsing:
            started = collapse
            lines.append(f"vlrft: warning: collapse ({collapse.cause}) from step {collapse.started}: {collapse.line} "
                         "(guards.collapse_drop, guards.collapse_window; docs/guards.md, \"Collapse and plateau\")")
        self.collapsing = collapse is not None
        plateau = plateau_of(self.history, self.patience, self.tolerance)
        if plateau is not None and not self.plateaued:
            kind = "plateau with a signal" if plateau.signal else "plateau without a signal"
            lines.append(f"vlrft: warning: {kind} since step {plateau.since}: {plateau.line}. "
                         f"{PLATEAU_LEVERS[plateau.signal]} (guards.plateau_patience)")
        self.plateaued = plateau is not None
        return lines, started
