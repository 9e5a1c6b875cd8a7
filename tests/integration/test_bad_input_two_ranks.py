"""Acceptance (issue 8), 2 ranks: only rank 1 draws bad prompts and only rank 1 gets a NaN loss.

Under `data.on_bad_sample: skip` nothing hangs: rank 1 runs a placeholder in the step where all
its prompts were skipped, the NaN step is skipped on both ranks, the counters add up over ranks
and the final checkpoint loads. The run is two epochs: a bad prompt is named and counted once,
and neither rank tries it again when the second epoch draws it (on either rank). Under `error`
both ranks stop with a one-line message instead of rank 0 waiting forever in a collective.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.integration.test_torchrun_training import RECIPE, free_port
from vlrft.data.sampler import PromptSampler
from vlrft.models.loader import load_model

pytestmark = pytest.mark.integration

N_ROWS, PROMPTS, STEPS, NAN_STEP = 12, 4, 6, 3  # two epochs


def row(row_id: str, image, text: str = "What colour is the shape? Answer as <answer>colour</answer>.") -> dict:
    return {"id": row_id, "answer": "red", "data_source": "color_shapes",
            "messages": [{"role": "user", "content": [{"type": "image", "image": str(image)}, {"type": "text", "text": text}]}]}


def write_data(root: Path, colour_data: Path) -> None:
    """train.jsonl: rank 1's two prompts are bad in step 1, one in step 2, none in step 3; rank 0
    only draws good rows. skip.jsonl adds three lines that are bad at load time."""
    (root / "not_image.png").write_bytes(b"not a PNG")
    (root / "truncated.png").write_bytes((colour_data / "images" / "train_00001.png").read_bytes()[:60])
    images = shutil.copytree(colour_data / "images", root / "images")  # rows name files inside their data set
    rank1 = PromptSampler(N_ROWS, PROMPTS, 1, 2, seed=0)
    steps = [[index for _, index in rank1.next_indices()] for _ in range(STEPS)]
    bad = {
        steps[0][0]: row("bad-not_image", root / "not_image.png"),
        steps[0][1]: row("bad-truncated", root / "truncated.png"),
        steps[1][0]: row("bad-too_long", images / "train_00002.png", "many more words " * 40),
    }
    rows = [bad.get(i, row(f"good-{i}", images / f"train_{i:05d}.png")) for i in range(N_ROWS)]
    lines = [json.dumps(r) for r in rows]
    (root / "error.jsonl").write_text("\n".join(lines) + "\n")
    (root / "skip.jsonl").write_text("\n".join(lines + ["{oops", "[1]", json.dumps({"id": "no-answer", "messages": []})]) + "\n")


def launch(root: Path, mode: str, zero_stage: int) -> subprocess.CompletedProcess:
    config = {
        "model": {"path": str(root / "model")},
        "data": {"train_path": str(root / f"{mode}.jsonl"), "on_bad_sample": mode, "max_prompt_tokens": 60},
        "rollout": {"rollout_prompts": PROMPTS, "n_samples_per_prompt": 2, "max_new_tokens": 4},
        # 64 tokens: two sequences per micro-batch, so rank 0 runs more micro-batches than rank 1
        "train": {"total_steps": STEPS, "lr": 1e-2, "zero_stage": zero_stage, "micro_batch_tokens": 64},
        "reward": {"default": [{"recipe": "recipe.py:distinct_chars"}]},
        "eval": {"every_steps": 0},
        "output": {"dir": str(root / f"run-{mode}")},
    }
    (root / f"{mode}.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "BAD_INPUT_NAN_STEP": str(NAN_STEP),
           "PYTHONPATH": str(Path(__file__).parents[2])}
    worker = Path(__file__).with_name("bad_input_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(worker), "train", str(root / f"{mode}.yaml")]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=420)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_bad_prompts_and_nan_loss_on_one_rank(zero_stage, tiny_vl, colour_data, tmp_path):
    (tmp_path / "recipe.py").write_text(RECIPE)
    (tmp_path / "model").symlink_to(tiny_vl)
    write_data(tmp_path, colour_data)
    proc = launch(tmp_path, "skip", zero_stage)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count(f"vlrft: skipped 3 bad rows of {tmp_path / 'skip.jsonl'} (on_bad_sample: skip)") == 1
    assert "vlrft: rank 1: skipping row id 'bad-not_image': cannot read image" in out
    assert "vlrft: rank 1: skipping row id 'bad-too_long': prompt has" in out
    assert "vlrft: rank 0: skipping" not in out
    for bad in ("bad-not_image", "bad-truncated", "bad-too_long"):  # once per run, epoch 2 included
        assert out.count(f"skipping row id '{bad}'") == 1, bad
    assert "vlrft: skipped a policy optimizer step: non-finite loss in 1 micro-batch(es) on rank 1; " in out
    records = [json.loads(line) for line in (tmp_path / "run-skip" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "train/lr" in r}
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert steps[1]["data/skipped_rows"] == 3 and all("data/skipped_rows" not in steps[s] for s in range(2, STEPS + 1))
    assert [steps[s]["data/skipped_prompts"] for s in sorted(steps)] == [2, 1, 0, 0, 0, 0]
    assert [steps[s]["train/skipped_nonfinite_steps"] for s in sorted(steps)] == [0, 0, 1, 0, 0, 0]
    assert "train/loss" in steps[2] and "train/loss" not in steps[3]
    final = load_model(str(tmp_path / "run-skip" / "final"))
    before = load_model(tiny_vl)
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), final.parameters()))
    assert all(torch.isfinite(p).all() for p in final.parameters())


def test_bad_prompt_on_one_rank_stops_both_without_a_hang(tiny_vl, colour_data, tmp_path):
    (tmp_path / "recipe.py").write_text(RECIPE)
    (tmp_path / "model").symlink_to(tiny_vl)
    write_data(tmp_path, colour_data)
    start = time.monotonic()
    proc = launch(tmp_path, "error", 2)
    assert proc.returncode != 0
    assert time.monotonic() - start < 300
    err = proc.stderr
    assert f"vlrft: error: row id 'bad-not_image': cannot read image {tmp_path / 'not_image.png'} (cannot identify image file" in err
    assert ("vlrft: error: rank 1 stopped on a bad prompt (data.on_bad_sample: error); its message names the row"
            in err)
