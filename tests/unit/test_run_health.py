"""Collapse and plateau guards (trainer/run_health.py) on metric streams: a synthetic collapse
trips at the right step with the right cause, each cause is named, a plateau is named with or
without a signal, and the colour demo's real stream (GRPO, seed 0, 100 steps) trips nothing."""

import json
from pathlib import Path

import pytest

from vlrft.trainer.run_health import CollapseError, HealthWatch, collapse_of, plateau_of

# rollout/* of `bash examples/color_shapes/run.sh` (2 CPU ranks, seed 0) on 2026-11-28, steps 1-100.
DEMO_ACC = [0.266, 0.258, 0.242, 0.277, 0.262, 0.217, 0.229, 0.227, 0.26, 0.236, 0.242, 0.271, 0.26, 0.262, 0.229, 
    0.207, 0.268, 0.223, 0.252, 0.264, 0.238, 0.277, 0.223, 0.305, 0.375, 0.359, 0.357, 0.365, 0.391, 0.525, 0.631, 0.59, 
    0.645, 0.629, 0.678, 0.705, 0.709, 0.684, 0.635, 0.701, 0.748, 0.771, 0.787, 0.801, 0.828, 0.855, 0.875, 0.836, 
    0.881, 0.891, 0.869, 0.887, 0.891, 0.926, 0.916, 0.93, 0.924, 0.947, 0.947, 0.947, 0.939, 0.971, 0.961, 0.961, 0.971, 
    0.957, 0.953, 0.953, 0.977, 0.969, 0.959, 0.957, 0.965, 0.969, 0.977, 0.969, 0.98, 0.967, 0.979, 0.973, 0.973, 0.973, 
    0.967, 0.982, 0.977, 0.973, 0.975, 0.977, 0.969, 0.982, 0.973, 0.98, 0.973, 0.979, 0.982, 0.975, 0.971, 0.969, 0.977, 
    0.979]
DEMO_ENT = [0.356, 0.35, 0.344, 0.33, 0.338, 0.353, 0.375, 0.401, 0.377, 0.373, 0.365, 0.357, 0.353, 0.352, 0.349, 
    0.349, 0.349, 0.346, 0.343, 0.341, 0.339, 0.339, 0.369, 0.332, 0.356, 0.347, 0.464, 0.732, 0.443, 0.374, 0.329, 
    0.478, 0.262, 0.318, 0.697, 0.331, 0.301, 0.25, 0.244, 0.268, 0.255, 0.301, 0.345, 0.482, 0.307, 0.194, 0.159, 0.166, 
    0.148, 0.143, 0.155, 0.149, 0.19, 0.149, 0.179, 0.194, 0.123, 0.128, 0.09, 0.1, 0.078, 0.078, 0.074, 0.07, 0.067, 
    0.068, 0.066, 0.063, 0.061, 0.061, 0.058, 0.061, 0.062, 0.058, 0.059, 0.056, 0.054, 0.051, 0.051, 0.05, 0.052, 0.048, 
    0.051, 0.049, 0.049, 0.047, 0.048, 0.052, 0.047, 0.047, 0.047, 0.044, 0.046, 0.046, 0.045, 0.045, 0.043, 0.046, 
    0.045, 0.044]
DEMO_LEN = [4.0, 4.0, 4.01, 4.01, 4.01, 4.0, 4.02, 4.06, 4.06, 4.04, 4.02, 4.0, 4.0, 4.01, 4.0, 4.01, 4.01, 4.0, 4.0, 
    4.0, 4.0, 4.0, 3.83, 4.01, 4.0, 4.0, 4.07, 4.18, 4.05, 4.04, 4.02, 4.07, 4.01, 4.02, 4.13, 4.04, 4.05, 4.01, 4.0, 
    4.02, 4.02, 4.04, 4.06, 4.14, 4.05, 4.02, 4.01, 4.03, 4.02, 4.01, 4.02, 4.02, 4.03, 4.0, 4.04, 4.05, 4.02, 4.02, 4.0, 
    4.02, 4.02, 4.02, 4.0, 4.0, 4.0, 4.0, 4.01, 3.99, 4.01, 4.0, 4.0, 4.01, 4.0, 4.0, 4.0, 4.0, 4.0, 3.99, 4.0, 4.0, 4.0, 
    4.01, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 3.99, 4.0, 4.0, 4.0, 4.0, 3.99, 4.0, 4.0]
DEMO_FMT = [0.998, 0.998, 0.994, 0.996, 0.998, 0.996, 0.992, 0.977, 0.977, 0.99, 0.994, 1.0, 1.0, 0.994, 0.998, 
    0.998, 0.998, 0.998, 1.0, 1.0, 0.998, 0.996, 0.824, 0.996, 0.99, 0.998, 0.973, 0.953, 0.986, 0.977, 0.963, 0.971, 
    0.99, 0.979, 0.924, 0.984, 0.973, 0.99, 0.986, 0.977, 0.984, 0.986, 0.986, 0.963, 0.98, 0.996, 0.992, 0.99, 0.99, 
    0.988, 0.986, 0.992, 0.98, 0.984, 0.994, 0.982, 0.994, 0.994, 0.994, 0.996, 0.994, 0.994, 0.998, 0.99, 0.996, 0.994, 
    0.994, 0.994, 0.992, 0.998, 0.994, 0.994, 0.998, 0.998, 1.0, 0.996, 0.998, 0.992, 1.0, 0.996, 0.998, 0.992, 0.998, 
    0.998, 1.0, 0.996, 0.998, 1.0, 0.998, 0.996, 0.998, 1.0, 0.996, 0.996, 1.0, 0.996, 0.998, 0.996, 0.996, 0.998]
DEMO_NOSIG = [0.094, 0.141, 0.219, 0.109, 0.141, 0.188, 0.219, 0.172, 0.125, 0.141, 0.156, 0.141, 0.031, 0.125, 
    0.219, 0.188, 0.125, 0.172, 0.109, 0.125, 0.156, 0.109, 0.109, 0.078, 0.031, 0.031, 0.031, 0.047, 0.016, 0.078, 
    0.062, 0.078, 0.062, 0.156, 0.172, 0.125, 0.188, 0.109, 0.141, 0.188, 0.266, 0.25, 0.297, 0.203, 0.328, 0.422, 0.438, 
    0.25, 0.391, 0.484, 0.375, 0.391, 0.422, 0.578, 0.578, 0.609, 0.547, 0.609, 0.641, 0.656, 0.547, 0.75, 0.781, 0.688, 
    0.766, 0.719, 0.672, 0.672, 0.781, 0.75, 0.719, 0.656, 0.75, 0.781, 0.828, 0.797, 0.844, 0.75, 0.844, 0.797, 0.797, 
    0.75, 0.781, 0.859, 0.812, 0.797, 0.812, 0.812, 0.781, 0.844, 0.797, 0.844, 0.797, 0.828, 0.859, 0.797, 0.828, 0.766, 
    0.828, 0.828]


def stream(accuracy, entropy=None, length=None, fmt=None, no_signal=None):
    out = []
    for i, acc in enumerate(accuracy):
        m = {"step": i + 1, "rollout/accuracy": acc, "rollout/entropy": (entropy or [0.4] * len(accuracy))[i],
             "rollout/response_length": (length or [4.0] * len(accuracy))[i],
             "reward/answer_format/mean": (fmt or [0.98] * len(accuracy))[i],
             "reward/exact_match/mean": acc}
        if no_signal is not None:
            m["traj/zero_variance_group_frac"] = no_signal[i]
        out.append(m)
    return out


def first_collapse(metrics, **settings):
    watch = HealthWatch(settings.get("drop", 0.3), settings.get("window", 5), 0, 0.05, "exact_match")
    for m in metrics:
        lines, collapse = watch.update(m["step"], m)
        if collapse is not None:
            return m["step"], collapse, lines
    return None


def test_an_entropy_blow_up_is_named_at_the_step_it_shows():
    # The DAPO case: accuracy 0.40, then the entropy jumps (0.36 -> 1.76) as the task reward falls
    # to nothing; the format reward holds (0.98).
    accuracy = [0.30, 0.35, 0.40, 0.40, 0.38, 0.20, 0.02, 0.0, 0.0]
    entropy = [0.36, 0.36, 0.35, 0.36, 0.50, 0.90, 1.76, 1.80, 1.70]
    step, collapse, lines = first_collapse(stream(accuracy, entropy))
    # step 5: 0.38, a fall of 0.02 (noise); step 6: 0.20, a fall of 0.2 (>= 0.3 x 0.40 and >= 0.1)
    # from the peak at step 3 (0.40, the first of the two), with the entropy 0.35 -> 0.90 (2.6x)
    assert (step, collapse.started, collapse.cause) == (6, 4, "entropy blow-up")
    assert lines == [f"vlrft: warning: collapse (entropy blow-up) from step 4: {collapse.line} (guards.collapse_drop, "
                     "guards.collapse_window; docs/guards.md, \"Collapse and plateau\")"]
    assert collapse.line == "rollout/accuracy 0.4 -> 0.2; rollout/entropy 0.35 -> 0.9"


@pytest.mark.parametrize("change, cause", [
    ({"entropy": [0.4, 0.4, 0.4, 0.15]}, "entropy collapse"),
    ({"length": [40.0, 40.0, 40.0, 12.0]}, "length collapse"),
    ({"length": [40.0, 40.0, 40.0, 95.0]}, "length blow-up"),
    ({"fmt": [0.98, 0.98, 0.98, 0.40]}, "format collapse"),
])
def test_each_cause(change, cause):
    assert first_collapse(stream([0.6, 0.7, 0.6, 0.3], **change))[1].cause == cause


def test_a_fall_without_a_cause_or_too_small_is_noise():
    assert first_collapse(stream([0.6, 0.7, 0.6, 0.3, 0.6])) is None  # one step, nothing else changed
    assert first_collapse(stream([0.3, 0.35, 0.28], entropy=[0.4, 0.4, 1.2])) is None  # 0.07: under MIN_FALL
    assert collapse_of(stream([0.6, 0.7, 0.3], entropy=[0.4, 0.4, 1.2]), 0.0, 5) is None  # collapse_drop 0: off


def test_a_fall_that_lasts_without_a_cause_is_an_accuracy_collapse():
    """examples/bigger, seed 0 (2026-11-28): 0.965 at step 38, 0.467 at step 45, 0.5 for 40
    steps, the entropy low throughout (0.04-0.05: sure of the other colour), length and format
    unchanged. Named at its second fallen step; never a plateau (the run had reached 0.95)."""
    accuracy = [0.5] * 30 + [0.94, 0.957, 0.965, 0.902, 0.959, 0.934, 0.939, 0.947, 0.965, 0.957, 0.891, 0.941, 0.906,
                             0.912, 0.801, 0.467, 0.607, 0.482] + [0.5] * 60
    entropy = [0.3] * 30 + [0.05, 0.043, 0.045, 0.037] * 4 + [0.051, 0.042] + [0.045] * 60
    step, collapse, lines = first_collapse(stream(accuracy, entropy))
    assert (step, collapse.cause, collapse.started) == (47, "accuracy collapse", 43)  # the window's peak: 0.941, step 42
    assert collapse.line == ("rollout/accuracy 0.941 -> 0.607; 0.467 at step 46 already; no entropy, length or "
                             "format change")
    watch = HealthWatch(0.3, 5, 40, 0.05, "exact_match")
    lines = [line for m in stream(accuracy, entropy) for line in watch.update(m["step"], m)[0]]
    assert len(lines) == 1 and "accuracy collapse" in lines[0]  # and no plateau after it


def test_one_warning_per_streak_and_stop_raises():
    watch = HealthWatch(0.3, 5, 0, 0.05, "exact_match")
    metrics = stream([0.6, 0.7, 0.3, 0.3, 0.7, 0.7, 0.2], entropy=[0.4, 0.4, 1.0, 1.0, 0.4, 0.4, 1.0])
    warned = [m["step"] for m in metrics if watch.update(m["step"], m)[0]]
    assert warned == [3, 7]  # not 4: the same fall; 7: a new one after the recovery

    from vlrft.config import GuardsConfig
    from vlrft.trainer.guards import RunGuards

    warn = RunGuards(GuardsConfig(), None, "hf", [], 0, "exact_match")
    marks = [warn.after_learning(m["step"], m) for m in metrics]
    assert [mark["guards/collapse"] for mark in marks] == [0, 0, 1, 0, 0, 0, 1]
    assert not any(mark["guards/plateau"] for mark in marks)
    guards = RunGuards(GuardsConfig(on_collapse="stop"), None, "hf", [], 0, "exact_match")
    with pytest.raises(CollapseError, match=r"^collapse \(entropy blow-up\) from step 3: .*stopped \(guards.on_collapse: stop\)$"):
        for m in metrics:
            guards.after_learning(m["step"], m)


def test_plateaus_with_and_without_a_signal():
    flat = [0.2, 0.4] + [0.42, 0.38] * 20  # best 0.4 at step 2, then nothing above 0.45 for 40 steps
    with_signal = plateau_of(stream(flat, no_signal=[0.2] * len(flat)), 40, 0.05)
    assert (with_signal.since, with_signal.signal) == (2, True)
    without = plateau_of(stream(flat, no_signal=[0.9] * len(flat)), 40, 0.05)
    assert not without.signal and "traj/zero_variance_group_frac averaged 0.90" in without.line
    assert plateau_of(stream(flat[:41]), 40, 0.05) is None  # not 40 steps after the best yet
    assert plateau_of(stream(flat + [0.5]), 40, 0.05) is None  # a new best by more than the tolerance
    assert plateau_of(stream([0.96] * 50), 40, 0.05) is None  # converged, not stuck
    assert plateau_of(stream([0.5, 0.99] + [0.97, 0.94] * 25), 40, 0.05) is None  # (wavering under 0.95 after it)
    watch = HealthWatch(0.3, 5, 40, 0.05, "exact_match")
    lines = [line for m in stream(flat, no_signal=[0.9] * len(flat)) for line in watch.update(m["step"], m)[0]]
    assert len(lines) == 1 and lines[0].startswith("vlrft: warning: plateau without a signal since step 2:")
    assert "rollout.temperature" in lines[0]


def test_the_demo_run_trips_nothing():
    metrics = stream(DEMO_ACC, DEMO_ENT, DEMO_LEN, DEMO_FMT, DEMO_NOSIG)
    watch = HealthWatch(0.3, 5, 40, 0.05, "exact_match")
    assert [line for m in metrics for line in watch.update(m["step"], m)[0]] == []
    assert DEMO_ACC[-1] > 0.95 and min(DEMO_ACC[:20]) < 0.3  # it learned, after a flat start of 24 steps


def test_todays_demo_recipe_on_eight_runs_trips_nothing():
    """The demo's recipe since 2026-11-28 (two passes, KL-Cov) on seeds 0-4 and, with staleness
    1, seeds 0-2 (docs/examples.md, "Across seeds"): healthy runs, one of which converges and
    then wavers around 0.95 (staleness1-1: 0.99 at step 58, 0.947 at step 100)."""
    runs = json.loads((Path(__file__).resolve().parents[1] / "data" / "demo_streams.json").read_text())["runs"]
    assert len(runs) == 8
    for name, columns in runs.items():
        metrics = [{"step": i + 1} | {key: values[i] for key, values in columns.items()} for i in range(100)]
        watch = HealthWatch(0.3, 5, 40, 0.05, "exact_match")
        assert [line for m in metrics for line in watch.update(m["step"], m)[0]] == [], name
        assert max(columns["rollout/accuracy"]) > 0.95, name
