"""The distillation example's config trains on 2 ranks with a teacher made by
data_tools.supervised_probe --save: two steps of pure distillation (no reward) that log the
teacher's metrics, a reverse KL above 0 (the teacher is not the student), and move the student."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_tools.supervised_probe import probe
from tests.ports import free_port
from vlrft.models.loader import load_model

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "distill" / "config.yaml"


def test_the_example_config_distils_a_probe_teacher_into_the_student(warm_vl, colour_data, tmp_path):
    teacher = tmp_path / "teacher"
    torch.manual_seed(0)
    probe(warm_vl, str(colour_data), steps=3, batch_size=8, lr=3e-3, eval_every=3, save=str(teacher))
    run = tmp_path / "run"
    overrides = [f"model.path={warm_vl}", f"teacher.path={teacher}", f"data.train_path={colour_data / 'train.jsonl'}",
                 f"data.eval_path={colour_data / 'test.jsonl'}", f"output.dir={run}", "train.total_steps=2",
                 "rollout.rollout_prompts=4", "rollout.n_samples_per_prompt=4", "eval.every_steps=0",
                 "trajectory.save_every=0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "vlrft.cli", "train", str(CONFIG), *overrides]
    done = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "distill/reverse_kl" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["distill/reverse_kl"]) and r["distill/reverse_kl"] > 0.01
        assert 0.0 < r["distill/teacher_argmax_match"] <= 1.0 and r["distill/teacher_seconds"] > 0
        assert r["rollout/reward_mean"] == 0.0  # no reward recipe: only the teacher teaches
    before, after = load_model(warm_vl), load_model(str(run / "final"))
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), after.parameters()))
