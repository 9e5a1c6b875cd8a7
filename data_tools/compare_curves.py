"""Print two runs' held-out accuracy side by side, by step, and the first step at which each
reaches a level (examples/distill/run.sh: on-policy distillation beside GRPO).

    python -m data_tools.compare_curves DISTILL/metrics.jsonl GRPO/metrics.jsonl [--level 0.95]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NAMES = ("distillation", "GRPO")


def held_out_curve(metrics_path: Path) -> dict[int, float]:
    """{step: eval/accuracy} of a run's metrics.jsonl (the evaluation lines only)."""
    curve = {}
    for number, line in enumerate(metrics_path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise SystemExit(f"compare_curves: {metrics_path} line {number} is not JSON") from None
        if isinstance(record, dict) and "eval/accuracy" in record:
            curve[int(record["step"])] = float(record["eval/accuracy"])
    if not curve:
        raise SystemExit(f"compare_curves: {metrics_path} has no eval/accuracy line (was data.eval_path set?)")
    return curve


def first_step_at(curve: dict[int, float], level: float) -> int | None:
    # Accuracies are logged as float32: 190 of 200 right is 0.949999988, which is 0.95.
    return next((step for step in sorted(curve) if curve[step] >= level - 1e-6), None)


def comparison(curves: dict[str, dict[int, float]], level: float) -> list[str]:
    """The lines to print: one row per evaluated step (a dash where a run has none), then the
    first step at `level` of each run and, when both reach it, the ratio."""
    names = list(curves)
    lines = ["held-out accuracy by step", "step  " + "  ".join(f"{name:>12}" for name in names)]
    for step in sorted(set().union(*curves.values())):
        cells = (f"{curves[name][step]:12.2f}" if step in curves[name] else f"{'-':>12}" for name in names)
        lines.append(f"{step:4d}  " + "  ".join(cells))
    reached = {name: first_step_at(curve, level) for name, curve in curves.items()}
    for name, step in reached.items():
        last = max(curves[name])
        lines.append(f"{name}: held-out >= {level} at step {step}" if step is not None
                     else f"{name}: held-out < {level} through step {last}")
    first, second = (reached[name] for name in names)
    if first is not None and second is not None:
        lines.append(f"{names[0]} took {first / second:.2f}x the steps of {names[1]}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("distill_metrics", type=Path)
    parser.add_argument("grpo_metrics", type=Path)
    parser.add_argument("--level", type=float, default=0.95)
    args = parser.parse_args(argv)
    for path in (args.distill_metrics, args.grpo_metrics):
        if not path.is_file():
            raise SystemExit(f"compare_curves: {path} does not exist (did that run train?)")
    curves = {NAMES[0]: held_out_curve(args.distill_metrics), NAMES[1]: held_out_curve(args.grpo_metrics)}
    print("\n".join(comparison(curves, args.level)))


if __name__ == "__main__":
    sys.exit(main())
