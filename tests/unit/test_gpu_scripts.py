"""tests/gpu/run_all.sh, the one command a GPU machine runs: it refuses a mistyped part before
running anything, and its `tests` part runs the GPU tests (which skip on CPU, saying why)."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

RUN_ALL = Path(__file__).resolve().parents[2] / "tests" / "gpu" / "run_all.sh"


def run_all(*parts, tmp_path):
    env = {**os.environ, "LOG_DIR": str(tmp_path / "logs"), "WHEELS": str(tmp_path / "no-wheels")}
    return subprocess.run(["bash", str(RUN_ALL), *parts], capture_output=True, text=True, env=env, timeout=600)


def test_a_mistyped_part_stops_before_anything_runs(tmp_path):
    done = run_all("tests", "demo:fp16:2", tmp_path=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "run_all: unknown part 'demo:fp16:2' (tests, demo[:DTYPE[:ZERO[:SEED]]], bench[:SHAPE], shared[:LAYERS])"
    assert not (tmp_path / "logs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the GPU tests run themselves, at full length")
def test_the_tests_part_runs_the_gpu_tests_and_logs_them(tmp_path):
    done = run_all("tests", tmp_path=tmp_path)
    log = (tmp_path / "logs" / "tests.log").read_text()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "test_colour_demo_trains_on_one_gpu_with_nccl" in log and "no CUDA GPU is visible" in log
    assert "run_all: tests took" in done.stdout
