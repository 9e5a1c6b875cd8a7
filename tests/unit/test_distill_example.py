"""The on-policy distillation example (examples/distill/): its configs name their student,
teacher and data relative to the file and are pure distillation, and its comparison prints both
runs' held-out curves and the first step each reaches the level."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from data_tools import compare_curves
from vlrft.config import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "distill"


@pytest.mark.parametrize("name, kind, task", [("config.yaml", "vl", "colors"), ("addition.yaml", "text", "addition")])
def test_the_example_configs_distil_the_demos_student(name, kind, task):
    cfg = load_config(EXAMPLE / name)
    assert cfg.teacher.path == str(ROOT / "artifacts" / f"teacher-{task}")  # relative to the file, as model.path
    assert cfg.model.path == str(ROOT / "artifacts" / f"tiny-{kind}")
    assert cfg.data.train_path == str(ROOT / "artifacts" / task / "train.jsonl")
    assert cfg.reward.default == [] and cfg.reward.accuracy_recipe == "exact_match"  # the teacher alone teaches
    assert cfg.algo.distill.mode == "advantage" and cfg.eval.every_steps == 5


def write_metrics(path: Path, curve: dict[int, float]) -> Path:
    lines = [json.dumps({"step": 1, "train/loss": 0.5})]  # a step line: no accuracy
    lines += [json.dumps({"step": step, "eval/accuracy": acc}) for step, acc in curve.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_comparison_prints_both_curves_and_when_each_reaches_the_level(tmp_path):
    distill = write_metrics(tmp_path / "d.jsonl", {0: 0.25, 5: 0.6, 10: 0.949999988079071, 15: 1.0})  # float32 0.95
    grpo = write_metrics(tmp_path / "g.jsonl", {0: 0.25, 10: 0.5, 20: 0.97})
    done = subprocess.run([sys.executable, "-m", "data_tools.compare_curves", str(distill), str(grpo)],
                          capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.splitlines() == [
        "held-out accuracy by step",
        "step  distillation          GRPO",
        "   0          0.25          0.25",
        "   5          0.60             -",
        "  10          0.95          0.50",
        "  15          1.00             -",
        "  20             -          0.97",
        "distillation: held-out >= 0.95 at step 10",
        "GRPO: held-out >= 0.95 at step 20",
        "distillation took 0.50x the steps of GRPO",
    ]
    lines = compare_curves.comparison({"a": {0: 0.2, 5: 0.9}, "b": {0: 0.2, 5: 0.99}}, 0.95)
    assert lines[-2:] == ["a: held-out < 0.95 through step 5", "b: held-out >= 0.95 at step 5"]


def test_the_comparison_names_a_run_without_a_curve(tmp_path):
    empty = write_metrics(tmp_path / "empty.jsonl", {})
    run = [sys.executable, "-m", "data_tools.compare_curves"]
    done = subprocess.run(run + [str(empty), str(empty)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.strip() == f"compare_curves: {empty} has no eval/accuracy line (was data.eval_path set?)"
    done = subprocess.run(run + [str(tmp_path / "missing.jsonl"), str(empty)], capture_output=True, text=True, cwd=ROOT)
    assert done.stderr.strip() == f"compare_curves: {tmp_path / 'missing.jsonl'} does not exist (did that run train?)"
    (tmp_path / "torn.jsonl").write_text('{"step": 0, "eval/accuracy": 0.25}\n{"step": 5, "eval/acc')
    done = subprocess.run(run + [str(tmp_path / "torn.jsonl"), str(empty)], capture_output=True, text=True, cwd=ROOT)
    assert done.stderr.strip() == f"compare_curves: {tmp_path / 'torn.jsonl'} line 2 is not JSON"


def test_the_seed_table_prints_a_row_per_run_and_how_many_reach_the_level(tmp_path):
    for name, curve in {"seed-0": {0: 0.25, 10: 0.8, 20: 0.96, 25: 0.97}, "seed-1": {0: 0.25, 10: 0.5, 20: 0.75}}.items():
        (tmp_path / name).mkdir()
        write_metrics(tmp_path / name / "metrics.jsonl", curve)
    done = subprocess.run([sys.executable, "-m", "data_tools.seed_table", str(tmp_path / "seed-0"), str(tmp_path / "seed-1")],
                          capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.splitlines() == [
        "| run | 0 | 10 | 20 | first ≥ 0.95 |",
        "|---|---|---|---|---|",
        "| seed-0 | 0.25 | 0.80 | 0.96 | step 20 |",
        "| seed-1 | 0.25 | 0.50 | 0.75 | not in 20 steps |",
        "1 of 2 runs reach 0.95, the last at step 20",
    ]
    missing = subprocess.run([sys.executable, "-m", "data_tools.seed_table", str(tmp_path / "nothing")],
                             capture_output=True, text=True, cwd=ROOT)
    assert missing.returncode == 1 and missing.stderr.strip() == f"seed_table: {tmp_path / 'nothing'} has no metrics.jsonl (did that run train?)"
