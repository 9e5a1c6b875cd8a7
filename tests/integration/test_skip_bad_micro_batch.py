"""Acceptance: a micro-batch that would crash the forward on one rank is skipped on both ranks
(decision all-reduced), the step completes without a hang, and the skip is counted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_torchrun_training import free_port

pytestmark = pytest.mark.integration


def test_bad_micro_batch_is_skipped_on_both_ranks(tiny_vl, colour_data, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(Path(__file__).parents[2])}
    worker = Path(__file__).with_name("skip_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(worker), tiny_vl, str(colour_data / "train.jsonl"), str(tmp_path / "out.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Rank 1 names the culprit; index 0 is skipped on both ranks; index 1 still trains.
    assert "skipping a micro-batch: sample 'color_shapes-train-00002' has 3 image tokens but its images give 4" in proc.stdout
    metrics = json.loads((tmp_path / "out.json").read_text())
    assert metrics["train/skipped_micro_batches"] == 1
    assert metrics["train/epochs_run"] == 1 and metrics["moved"]
