"""Issue-7 acceptance on a real 2-rank training run of the tiny VL policy: trajectories saved by
both ranks (complete, non-overlapping, images stored once), the wandb (offline) and tensorboard
sinks holding the training metrics and the `traj/` statistics, and the run's report opened in
headless Chromium."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import yaml

from tests.integration.test_torchrun_training import RECIPE, free_port
from tests.report_fixtures import browser_missing, chromium
from tests.unit.test_external_sinks import wandb_records

pytestmark = pytest.mark.integration

pytest.importorskip("wandb", reason="wandb is not installed (pip install 'vlrft[wandb]')")
pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")


@pytest.fixture(scope="module")
def run(tiny_vl, colour_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("trajectory_run")
    (root / "recipe.py").write_text(RECIPE)
    config = {
        "model": {"path": tiny_vl},
        "data": {"train_path": str(colour_data / "train.jsonl"), "eval_path": str(colour_data / "test.jsonl")},
        "rollout": {"rollout_prompts": 4, "n_samples_per_prompt": 4, "max_new_tokens": 6},
        "train": {"total_steps": 2, "lr": 1e-3},
        "reward": {"default": [{"recipe": "recipe.py:distinct_chars"}, {"recipe": "exact_match"}]},
        "eval": {"every_steps": 2, "max_prompts": 4},
        "trajectory": {"save_every": 1},
        "logging": {"wandb": "offline", "wandb_project": "vlrft-test", "tensorboard": True},
        "output": {"dir": str(root / "run")},
    }
    (root / "cfg.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_SILENT": "true",
           "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true", "WANDB_CACHE_DIR": str(root / "wandb-cache"),
           "WANDB_CONFIG_DIR": str(root / "wandb-config"), "WANDB_DATA_DIR": str(root / "wandb-data")}
    env.pop("WANDB_API_KEY", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "vlrft.cli", "train", str(root / "cfg.yaml")]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "run", proc.stdout


def test_both_ranks_save_complete_non_overlapping_steps(run):
    run_dir, _ = run
    trajectories = run_dir / "trajectories"
    names = sorted(p.name for p in trajectories.glob("*.jsonl"))
    assert names == ["step_000001.rank0.jsonl", "step_000001.rank1.jsonl", "step_000002.rank0.jsonl", "step_000002.rank1.jsonl"]
    assert not list(trajectories.rglob("*.tmp"))
    for step in (1, 2):
        ranks = [[json.loads(line) for line in (trajectories / f"step_{step:06d}.rank{r}.jsonl").open()] for r in (0, 1)]
        # Ranks even out their tokens after scoring: 4 prompts x 4 responses in all, each
        # group whole over the two files.
        groups = Counter(r["group_id"] for records in ranks for r in records)
        assert len(groups) == 4 and set(groups.values()) == {4}
        for rank, records in enumerate(ranks):
            assert records, f"rank {rank} saved nothing"
            assert {r["rank"] for r in records} == {rank} and {r["step"] for r in records} == {step}
            for r in records:
                assert len(r["images"]) == 1 and (trajectories / r["images"][0]).is_file()
                assert len(r["response_tokens"]) == len(r["response_ids"]) == len(r["entropy"]) == r["response_length"]
                assert set(r["components"]) == {"distinct_chars", "exact_match"}


def test_sinks_receive_training_metrics_and_trajectory_statistics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = run
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    expected = {}  # step -> every metric the JSONL sink got at that step
    for row in logged:
        expected.setdefault(row.pop("step"), {}).update(row)
    assert {"rollout/reward_mean", "train/loss", "perf/step_seconds", "perf/update_seconds", "perf/sync_seconds",
            "reward/exact_match/mean", "traj/accuracy", "traj/zero_variance_group_frac",
            "traj/entropy/mean"} <= set(expected[1])
    assert "eval/accuracy" in expected[0] and "eval/accuracy" in expected[2]

    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = {}
    for record in wandb_records(log):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    board = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            board.setdefault(event.step, {})[tag] = event.value
    for step, metrics in expected.items():
        assert history[step] == pytest.approx(metrics, rel=1e-9)
        assert board[step] == pytest.approx(metrics, rel=1e-6)  # tensorboard stores float32


def test_report_of_the_run_opens_in_chromium(run):
    run_dir, stdout = run
    assert f"trajectory report: {run_dir / 'report.html'}" in stdout
    summary = json.loads((run_dir / "report.json").read_text())
    assert set(summary["steps"]) == {"1", "2"} and summary["overall"]["reward/mean"] >= 0
    if browser_missing():
        pytest.skip(browser_missing())
    from selenium.webdriver.common.by import By

    driver = chromium()
    try:
        driver.get((run_dir / "report.html").as_uri())
        for section in ("overview", "curves", "histograms", "per-source", "samples"):
            assert driver.find_element(By.ID, section).is_displayed()
        decoded = driver.execute_script(
            "return Array.from(document.images).filter(i => i.complete && i.naturalWidth > 0).length")
        assert decoded >= 1
        assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
        assert driver.save_screenshot(str(run_dir / "report.png"))
    finally:
        driver.quit()
