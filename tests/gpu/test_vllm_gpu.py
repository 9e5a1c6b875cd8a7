"""The colocated vLLM engine on a CUDA GPU: bf16, sleep during the update, weights woken before
the KV cache, per-request seeds, and the trained weights served after every sync (the same
worker as tests/vllm/, one rank). Skips without a CUDA GPU or without vllm."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU is visible"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'vlrft[vllm]')"),
]

WORKER = Path(__file__).resolve().parents[1] / "vllm" / "vllm_sync_worker.py"


def test_vllm_engine_on_gpu_sleeps_wakes_and_serves_the_trained_weights(tiny_text, addition_data, tmp_path):
    from tests.integration.test_torchrun_training import free_port

    (tmp_path / "recipe.py").write_text("def distinct_chars(completions, samples):\n"
                                        "    return [len(set(c)) / 10 for c in completions]\n")
    overrides = [
        f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}", "model.compute_dtype=bfloat16",
        "rollout.engine=vllm", "rollout.vllm_memory_fraction=0.3", "rollout.rollout_prompts=4",
        "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=6", "train.total_steps=3", "train.lr=0.01",
        "algo.rollout_correction=tis", "reward.default=[{recipe: 'recipe.py:distinct_chars'}]",
        f"output.dir={tmp_path / 'run'}",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
           str(WORKER), str(tmp_path / "result.json"), *overrides]
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    (result,) = json.loads((tmp_path / "result.json").read_text())
    assert result["engine_dtype"] == "torch.bfloat16"
    assert result["diff_to_trained"] <= 2e-2 < result["diff_to_initial"]  # bf16 rounding vs training's movement
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["rollout/mismatch_kl"] < 1e-2 for m in steps if "rollout/mismatch_kl" in m)
