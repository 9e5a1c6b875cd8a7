"""A rerun says what it does (docs/checkpoints.md): the demo's launcher run again on a finished
run directory with a smaller train.total_steps prints one line and exits 0 without training; a
longer run with shared prompts switched off resumes from the end and names the changed key;
checkpoint.resume=never starts over and says what it removed."""

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DEMO = Path(__file__).resolve().parents[2] / "examples" / "color_shapes" / "run.sh"
SMALL = ["rollout.rollout_prompts=4", "rollout.n_samples_per_prompt=4", "eval.every_steps=0", "trajectory.save_every=0"]


def demo(run_dir: Path, *overrides: str) -> str:
    done = subprocess.run(["bash", str(DEMO), f"output.dir={run_dir}", *SMALL, *overrides], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "NPROC": "2"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


def logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_rerun_of_the_demo_says_what_it_does(tmp_path):
    run = tmp_path / "run"
    demo(run, "train.total_steps=3")
    assert logged_steps(run) == [1, 2, 3]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000003"]  # the last step's, though save_steps is 50
    metrics = (run / "metrics.jsonl").read_bytes()

    out = demo(run, "train.total_steps=2")
    finished = [line for line in out.splitlines() if "already finished" in line]
    assert finished == [f"vlrft: {run} already finished at step 3 (train.total_steps=2, checkpoint step_000003): "
                        "nothing to train; another output.dir or checkpoint.resume=never starts over"]  # once, not per rank
    assert "resumed from" not in out and "held-out accuracy" not in out
    assert (run / "metrics.jsonl").read_bytes() == metrics  # nothing trained, nothing discarded

    out = demo(run, "train.total_steps=4", "train.share_prompts=false")
    warning = [line for line in out.splitlines() if "config keys changed" in line]
    assert len(warning) == 1 and "train.share_prompts (True -> False)" in warning[0] and "train.total_steps (3 -> 4)" in warning[0]
    assert "at step 3" in out and logged_steps(run) == [1, 2, 3, 4]

    out = demo(run, "train.total_steps=1", "checkpoint.resume=never")
    assert f"vlrft: starting over in {run}: removed the previous run's 2 checkpoints (the last at step_000004), 4 metric lines" in out
    assert logged_steps(run) == [1] and [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]
