"""Acceptance: the Python step API (SPMDTrainer.step), through its documented example, on 2
ranks: responses and scores supplied from outside move the policy toward the high-scored ones."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_torchrun_training import free_port

pytestmark = pytest.mark.integration
EXAMPLE = Path(__file__).parents[2] / "examples" / "step_api" / "train.py"


def test_step_api_example_raises_the_logprob_of_high_scored_responses(tiny_text, addition_data, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(EXAMPLE), "--model", tiny_text, "--data", str(addition_data / "train.jsonl"), "--out", str(tmp_path),
           "--steps", "4"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 4: reward 0.250" in proc.stdout  # one right answer of four in every group
    for rank in (0, 1):
        change = json.loads((tmp_path / f"logprob_change_rank{rank}.json").read_text())
        assert len(change["right"]) == len(change["wrong"]) == 4  # prompts per rank
        assert all(right > 0 for right in change["right"]), change
        # Above the wrong answers, which share the format tokens (and are right answers elsewhere).
        assert sum(change["right"]) > sum(change["wrong"]) + 4 * 1.0, change


def test_step_api_errors_name_the_prompt(tiny_text, addition_data, tmp_path, world_of_one):
    from vlrft.config import load_config
    from vlrft.data.dataset import DataError
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    trainer = SPMDTrainer(load_config(None, [
        f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}", f"output.dir={tmp_path}",
    ]))
    row = {"prompt": "What is 1 + 2?", "answer": "3"}  # mapped columns, as in a parquet file
    with pytest.raises(ValueError, match="prompt 1 has 2 responses and 1 scores"):
        trainer.step([row, row], [["a"], ["b", "c"]], [[1.0], [0.0]])
    with pytest.raises(DataError, match="prompt:1 .*missing required field 'answer'"):
        trainer.step([row, {"messages": [{"role": "user", "content": "hi"}]}], [["a"], ["b"]], [[1.0], [0.0]])
    metrics = trainer.step([row], [["<answer>3</answer>", "<answer>4</answer>", [5, 6, 7]]], [[1.0, 0.0, 0.5]])
    assert metrics["rollout/reward_mean"] == pytest.approx(0.5) and metrics["rollout/truncated_frac"] == pytest.approx(1 / 3)
    assert metrics["rollout/accuracy"] == pytest.approx(1 / 3)  # exact_match against the row's answer
    assert trainer.global_step == 1
