"""Held-out accuracy of runs that differ only in their seed, as a markdown table: one row per
run, a column per evaluated step, the first step at which each reaches a level, and how many
reach it (docs/examples.md prints these tables).

    for s in 0 1 2 3 4; do bash examples/color_shapes/run.sh train.seed=$s output.dir=runs/seeds/sync-$s; done
    python -m data_tools.seed_table runs/seeds/sync-* [--every 10] [--level 0.95]

Each argument is a run directory (its metrics.jsonl); its row is labelled by the directory's name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_tools.compare_curves import first_step_at, held_out_curve


def seed_table(curves: dict[str, dict[int, float]], every: int, level: float) -> list[str]:
    """The table's lines, then one line: how many runs reach `level` (and by which step)."""
    steps = sorted({step for curve in curves.values() for step in curve if step % every == 0})
    lines = ["| run | " + " | ".join(str(step) for step in steps) + f" | first ≥ {level:g} |",
             "|---|" + "---|" * (len(steps) + 1)]
    reached = {}
    for name, curve in curves.items():
        reached[name] = first_step_at(curve, level)
        cells = [f"{curve[step]:.2f}" if step in curve else "-" for step in steps]
        first = f"step {reached[name]}" if reached[name] is not None else f"not in {max(curve)} steps"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {first} |")
    hits = [step for step in reached.values() if step is not None]
    lines.append(f"{len(hits)} of {len(curves)} runs reach {level:g}" + (f", the last at step {max(hits)}" if hits else ""))
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run directories (each holding metrics.jsonl)")
    parser.add_argument("--every", type=int, default=10, help="a column every this many steps")
    parser.add_argument("--level", type=float, default=0.95)
    args = parser.parse_args(argv)
    if args.every < 1:
        raise SystemExit(f"seed_table: --every must be at least 1, got {args.every}")
    for run in args.runs:
        if not (run / "metrics.jsonl").is_file():
            raise SystemExit(f"seed_table: {run} has no metrics.jsonl (did that run train?)")
    curves = {run.name: held_out_curve(run / "metrics.jsonl") for run in args.runs}
    print("\n".join(seed_table(curves, args.every, args.level)))


if __name__ == "__main__":
    sys.exit(main())
