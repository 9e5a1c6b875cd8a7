"""A recipe from a user file outside the repo (the docs' worked example) and one from an
installed entry-point package train the colour task in a 2-rank run, beside a recipe that
raises and one that hangs (each step finishes within the timeout, failures are counted)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from tests.integration.test_torchrun_training import free_port
from tests.recipe_plugin import install_recipe_plugin
from tests.unit.test_reward_docs import write_example
from vlrft.models.loader import load_model

pytestmark = pytest.mark.integration

# A verifier that crashes and one that never returns: the run must not notice beyond the counts.
BROKEN = (
    "import time\n"
    "def explodes(completions, samples):\n    raise RuntimeError('verifier crashed')\n"
    "def hangs(completions, samples):\n    time.sleep(10**6)\n"
)
PLUGIN = "def brevity(completions, samples):\n    return [1.0 - s['response_length'] / 8 for s in samples]\n"


def test_user_file_and_entry_point_recipes_train_the_colour_task(warm_vl, colour_data, tmp_path):
    # Format-warmed-up (the session's warmed model): it answers <answer>colour</answer> with a
    # varying colour and length, so both recipes' rewards vary within a group.
    tiny_vl = warm_vl
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    recipe_file = write_example(outside)
    (outside / "broken.py").write_text(BROKEN)
    site = install_recipe_plugin(tmp_path, "brevity_reward", "brevity", PLUGIN)
    config = {
        "model": {"path": tiny_vl},
        "data": {"train_path": str(colour_data / "train.jsonl"), "eval_path": str(colour_data / "test.jsonl")},
        "rollout": {"rollout_prompts": 4, "n_samples_per_prompt": 4, "max_new_tokens": 8},
        "train": {"total_steps": 2, "lr": 1e-2, "weight_decay": 0.0, "micro_batch_tokens": 400},
        "reward": {"by_data_source": {"color_shapes": [
            {"recipe": f"{recipe_file}:colour_credit", "kwargs": {"wrong_colour": 0.5}},
            {"recipe": "brevity", "weight": 0.5},
            {"recipe": f"{outside / 'broken.py'}:explodes", "fallback": 0.0},
            {"recipe": f"{outside / 'broken.py'}:hangs", "timeout_s": 1.0},
        ]}},
        "eval": {"every_steps": 0},
        "output": {"dir": str(tmp_path / "run")},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(site), os.getcwd()])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "vlrft.cli", "train", str(tmp_path / "cfg.yaml")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reward recipe '" in proc.stderr and "failed (timed out after 1s)" in proc.stderr
    assert "failed (raised RuntimeError: verifier crashed)" in proc.stderr

    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "rollout/reward_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert "reward/colour_credit/mean" in r and "reward/brevity/mean" in r
        assert r["reward/colour_credit/failures"] == 0 and r["reward/brevity/failures"] == 0
        # One failed call per rank and step each; the raising one scored its fallback 0, the
        # hanging one (fallback None) is absent from the components.
        assert r["reward/explodes/failures"] == 2 and r["reward/hangs/failures"] == 2
        assert r["reward/explodes/mean"] == 0.0 and "reward/hangs/mean" not in r
        assert r["rollout/color_shapes/reward_mean"] == pytest.approx(r["rollout/reward_mean"])
        assert "rollout/color_shapes/accuracy" in r and r["train/grad_norm"] > 0
    before, after = load_model(tiny_vl), load_model(str(tmp_path / "run" / "final"))
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), after.parameters()))
