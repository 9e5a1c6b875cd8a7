"""2-rank torchrun (gloo) training of the tiny models under ZeRO-2 and ZeRO-3: Qwen2.5-VL,
Qwen3-VL on image and video prompts, and the Qwen2 text model."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from tests.ports import free_port  # noqa: F401 - imported from here by other tests
from vlrft.models.loader import load_model, vision_tower

pytestmark = pytest.mark.integration

# Rewards that vary within a group even for an untrained model, so advantages are non-zero.
RECIPE = "def distinct_chars(completions, samples):\n    return [len(set(c)) / 10 for c in completions]\n"


def run_torchrun(config_path, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "vlrft.cli", "train", str(config_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("kind, zero_stage", [("vl", 2), ("qwen3-vl video", 3), ("text", 2), ("text", 3)])
def test_two_rank_training_updates_policy(kind, zero_stage, vl_models, tiny_text, colour_data, video_data, addition_data, tmp_path):
    model_path, data = {
        "vl": (vl_models("qwen2.5-vl"), colour_data),
        "qwen3-vl video": (vl_models("qwen3-vl"), video_data),  # rows with images, videos or both
        "text": (tiny_text, addition_data),
    }[kind]
    (tmp_path / "recipe.py").write_text(RECIPE)
    config = {
        "model": {"path": model_path},
        "data": {"train_path": str(data / ("train_videos.jsonl" if "video" in kind else "train.jsonl")),
                 "eval_path": str(data / "test.jsonl")},
        "rollout": {"rollout_prompts": 4, "n_samples_per_prompt": 4, "max_new_tokens": 6},
        # The entropy mask gathers token entropies over both ranks: exercised here.
        "algo": {"kl": {"coef": 0.01}, "high_entropy_token_ratio": 0.5, "entropy_coef": 0.001},
        # weight_decay 0: a parameter can only move if it received a non-zero gradient.
        "train": {"total_steps": 2, "lr": 1e-2, "weight_decay": 0.0, "zero_stage": zero_stage, "micro_batch_tokens": 200},
        "reward": {"default": [{"recipe": "recipe.py:distinct_chars"}, {"recipe": "exact_match"}]},
        "eval": {"every_steps": 2, "max_prompts": 4},
        "output": {"dir": str(tmp_path / "run")},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    proc = run_torchrun(tmp_path / "cfg.yaml", tmp_path)
    assert "held-out accuracy by step: 0:" in proc.stdout
    # Known third-party warnings are silenced at their source; vlrft's own lines start "vlrft:".
    foreign = [line for line in (proc.stdout + proc.stderr).splitlines() if "warn" in line.lower() and "vlrft:" not in line]
    assert not foreign, foreign[:3]
    # A healthy run trips no guard (each guard's line names its guards.* key).
    assert "guards." not in proc.stdout + proc.stderr

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["reward/distinct_chars/mean"] > 0 and "reward/exact_match/mean" in r
        assert r["train/grad_norm"] > 0 and r["train/entropy"] > 0
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2]

    before, after = load_model(model_path), load_model(str(tmp_path / "run" / "final"))
    changed = {n for (n, a), (_, b) in zip(before.named_parameters(), after.named_parameters()) if not torch.equal(a, b)}
    assert changed, "no policy parameter changed"
    if kind != "text":
        vision = {f"model.visual.{n}" for n, _ in vision_tower(before).named_parameters()}
        assert vision & changed, "the vision tower received no gradient"


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_rank_lora_training_exports_merged_model_and_adapter(zero_stage, tiny_vl, colour_data, tmp_path):
    from peft import PeftModel

    (tmp_path / "recipe.py").write_text(RECIPE)
    config = {
        "model": {"path": tiny_vl, "lora": {"rank": 4, "alpha": 8, "dropout": 0.1, "lr_ratio": 4}},  # LoRA+ groups
        "data": {"train_path": str(colour_data / "train.jsonl")},
        "rollout": {"rollout_prompts": 4, "n_samples_per_prompt": 4, "max_new_tokens": 6},
        "algo": {"kl": {"coef": 0.01}},
        "train": {"total_steps": 2, "lr": 5e-2, "zero_stage": zero_stage, "micro_batch_tokens": 200},
        "reward": {"default": [{"recipe": "recipe.py:distinct_chars"}]},
        "eval": {"every_steps": 0},
        "output": {"dir": str(tmp_path / "run")},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    proc = run_torchrun(tmp_path / "cfg.yaml", tmp_path)
    assert "parameters train (model.lora)" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["rollout/kl"] != 0.0  # step 2 sampled from the adapted policy, scored against its base

    final = tmp_path / "run" / "final"
    merged, base = load_model(str(final)), load_model(tiny_vl)
    changed = {n for (n, a), (_, b) in zip(base.named_parameters(), merged.named_parameters()) if not torch.equal(a, b)}
    assert changed and all(n.endswith("_proj.weight") for n in changed), sorted(changed)[:5]
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    with torch.no_grad():
        expected = merged(input_ids=ids).logits
        got = PeftModel.from_pretrained(base, str(final / "adapter"))(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
