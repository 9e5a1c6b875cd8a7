"""What one sandboxed program costs: wall-clock milliseconds per `run_python` (a one-line program)
and per `run_tests` (two sandboxes: program and harness), against two references measured in
the same run, alternating so that a noisy machine weighs on each alike:
- the floor: starting the same interpreter bare (`python -I -c pass` through subprocess), which
  no sandbox can undercut;
- optionally another vlrft checkout (`--baseline DIR`, e.g. `git worktree add /tmp/before
  <commit>`), to show what a change to the sandbox costs.

    python bench/sandbox_cost.py --baseline /tmp/before --rounds 5 --runs 20

Prints the median of each and the ratios. Nothing here is asserted: docs/benchmarks.md keeps
the numbers with their command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

# Runs inside a child process whose PYTHONPATH picks the checkout: prints {"python": [ms...], ...}.
TIMER = """
import json, sys, time
from vlrft.isolation.sandbox import run_python, run_tests
runs = int(sys.argv[1])
assert run_python("print(1)").stdout == "1\\n"  # the first call probes bubblewrap
out = {"python": [], "tests": []}
for _ in range(runs):
    start = time.perf_counter()
    result = run_python("print(1)")
    out["python"].append((time.perf_counter() - start) * 1000)
    assert result.passed, result
    start = time.perf_counter()
    verdict = run_tests("def add(a, b):\\n    return a + b\\n", "assert add(2, 3) == 5\\n")
    out["tests"].append((time.perf_counter() - start) * 1000)
    assert verdict.passed, verdict
print(json.dumps(out))
"""


def time_checkout(tree: Path, runs: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", TIMER, str(runs)], env=env, cwd=tree, capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"timing {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_floor(runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-c", "pass"], check=True)
        out.append((time.perf_counter() - start) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another vlrft checkout to time the same way")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=20, help="calls of each kind per round")
    args = parser.parse_args()
    trees = {"this checkout": HERE, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    samples: dict[str, dict[str, list[float]]] = {name: {"python": [], "tests": []} for name in trees}
    floor: list[float] = []
    for _ in range(args.rounds):
        for name, tree in trees.items():
            for kind, values in time_checkout(tree, args.runs).items():
                samples[name][kind] += values
        floor += time_floor(args.runs)
    bare = statistics.median(floor)
    print(f"machine: {os.cpu_count()} cores; {args.rounds} rounds x {args.runs} calls each; medians in ms")
    print(f"{'':16} {'run_python':>11} {'run_tests':>10} {'run_python / bare start':>24}")
    for name in trees:
        py, tests = (statistics.median(samples[name][kind]) for kind in ("python", "tests"))
        print(f"{name:16} {py:11.1f} {tests:10.1f} {py / bare:24.2f}")
    print(f"{'bare start':16} {bare:11.1f}")
    if args.baseline:
        ratio = {kind: statistics.median(samples["this checkout"][kind]) / statistics.median(samples["baseline"][kind])
                 for kind in ("python", "tests")}
        print(f"this checkout / baseline: run_python {ratio['python']:.2f}x, run_tests {ratio['tests']:.2f}x")


if __name__ == "__main__":
    main()
