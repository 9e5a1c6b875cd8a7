"""Checkpoint bookkeeping without training: atomic publish and rotation, what a resume discards,
the metrics log rewrite, config keys that must not change across a resume, config checks."""

import json

import pytest

from vlrft.config import ConfigError, load_config, to_dict
from vlrft.trainer.checkpoint import (
    changed_state_keys,
    clear_temporaries,
    complete_checkpoints,
    discard_after,
    publish,
    resume_path,
    temporary_dir,
    truncate_metrics_after,
)

BASE = ["model.path=m", "data.train_path=t.jsonl", "reward.default=[{recipe: exact_match}]"]


def fake_checkpoint(run, step: int, publish_it: bool = True):
    temporary = temporary_dir(run, step)
    temporary.mkdir(parents=True)
    (temporary / "trainer.pt").write_text(str(step))
    return publish(temporary, keep_last=2) if publish_it else temporary


def test_publish_renames_into_place_and_keeps_the_newest(tmp_path):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    # A save killed half-way is never a checkpoint, and the next save clears it.
    half = fake_checkpoint(tmp_path, 4, publish_it=False)
    assert resume_path("auto", tmp_path).name == "step_000003"
    clear_temporaries(tmp_path)
    assert not half.exists()
    # Saving a step again (a resumed run) replaces it.
    again = fake_checkpoint(tmp_path, 3)
    assert again.name == "step_000003" and [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000002", "step_000003"]


def test_resume_modes(tmp_path):
    assert resume_path("never", tmp_path) is None and resume_path("auto", tmp_path) is None
    with pytest.raises(ConfigError, match=r"'checkpoint.resume': .*nowhere is not a vlrft checkpoint"):
        resume_path(str(tmp_path / "nowhere"), tmp_path)
    assert resume_path(str(fake_checkpoint(tmp_path, 5)), tmp_path).name == "step_000005"


def test_resuming_discards_the_abandoned_future(tmp_path):
    for step in (10, 20):
        fake_checkpoint(tmp_path, step)
    trajectories = tmp_path / "trajectories"
    trajectories.mkdir()
    for step in (10, 15, 20):
        (trajectories / f"step_{step:06d}.rank0.jsonl").write_text("{}\n")
    lines = [json.dumps({"step": s, "x": s}) for s in (0, 10, 11, 20)] + ['{"step": 21, "x"']  # cut by the kill
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    discard_after(tmp_path, 10)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000010"]
    assert sorted(p.name for p in trajectories.iterdir()) == ["step_000010.rank0.jsonl"]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "metrics.jsonl", "trajectories"]
    truncate_metrics_after(tmp_path / "absent.jsonl", 3)  # no log yet: nothing to do


def test_config_keys_that_shape_the_saved_state_must_match():
    saved = to_dict(load_config(None, BASE))
    assert changed_state_keys(saved, to_dict(load_config(None, BASE + ["train.lr=0.5", "train.total_steps=99"]))) == []
    current = to_dict(load_config(None, BASE + ["train.ema_beta=0.9", "algo.kl.coef=0.1"]))
    assert changed_state_keys(saved, current) == ["train.ema_beta", "algo.kl.coef"]


def test_checkpoint_and_logging_keys_are_validated(monkeypatch):
    with pytest.raises(ConfigError, match="'checkpoint.keep_last' must be >= 1"):
        load_config(None, BASE + ["checkpoint.keep_last=0"])
    with pytest.raises(ConfigError, match="'checkpoint.save_steps' must be >= 0"):
        load_config(None, BASE + ["checkpoint.save_steps=-1"])
    with pytest.raises(ConfigError, match="'logging.wandb' is 'offlne'; valid: disabled, offline, online"):
        load_config(None, BASE + ["logging.wandb=offlne"])
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"'logging.tensorboard' needs the tensorboard package.*vlrft\[tensorboard\]"):
        load_config(None, BASE + ["logging.tensorboard=true"])
