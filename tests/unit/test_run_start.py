"""What a run does with its output directory at the start (vlrft/trainer/run_start.py): which
changed keys a resume names, and what starting over removes."""

import json

from vlrft.config import load_config, to_dict
from vlrft.trainer.checkpoint import checkpoint_due
from vlrft.trainer.run_start import changed_keys, changed_keys_line, forget_previous_run

BASE = ["model.path=/m", "data.train_path=/d.jsonl", "train.total_steps=100"]


def config(*overrides: str) -> dict:
    return to_dict(load_config(None, BASE + list(overrides)))


def test_keys_that_change_what_a_resumed_run_computes_are_named_with_both_values():
    saved = config()
    current = config("train.share_prompts=false", "train.micro_batch_tokens=1024", "rollout.temperature=0.7",
                     "reward.default=[{recipe: exact_match, weight: 2.0}]")
    assert changed_keys(saved, current) == [
        ("rollout.temperature", 1.0, 0.7),
        ("train.micro_batch_tokens", saved["train"]["micro_batch_tokens"], 1024),
        ("train.share_prompts", True, False),
        ("reward.default", saved["reward"]["default"], current["reward"]["default"]),
    ]


def test_where_outputs_go_refused_keys_and_keys_newer_than_the_checkpoint_are_not_named():
    saved = config()
    current = config("output.dir=/elsewhere", "checkpoint.keep_last=5", "logging.wandb=offline",
                     "trajectory.save_every=3", "guards.stall_timeout_s=99", "train.seed=7")
    assert changed_keys(saved, current) == []  # (train.seed is refused at resume, not warned)
    del saved["train"]["share_prompts"]  # a checkpoint written before the key existed
    assert changed_keys(saved, config("train.share_prompts=false")) == []


def test_the_warning_is_one_line_and_cuts_long_values():
    line = changed_keys_line("/r/checkpoints/step_000004", [("train.share_prompts", True, False), ("reward.default", ["x" * 80], [])])
    assert "\n" not in line
    assert "train.share_prompts (True -> False)" in line and "…" in line and "x" * 80 not in line


def test_the_last_step_is_always_checkpointed_when_checkpoints_are_on():
    assert [s for s in range(1, 8) if checkpoint_due(s, 3, 7)] == [3, 6, 7]
    assert not any(checkpoint_due(s, 0, 7) for s in range(1, 8))  # 0: only on a signal


def test_starting_over_removes_the_previous_runs_checkpoints_trajectories_and_metrics(tmp_path):
    run = tmp_path / "run"
    for step in (2, 4):
        (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    (run / "trajectories").mkdir()
    (run / "trajectories" / "step_000002.rank0.jsonl").write_text("{}\n")
    (run / "trajectories" / "notes.txt").write_text("mine")  # not vlrft's: kept
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    (run / "final").mkdir()  # replaced when the new run finishes, not before

    assert forget_previous_run(run) == "2 checkpoints (the last at step_000004), 1 trajectory files, 5 metric lines"
    assert not list((run / "checkpoints").iterdir())
    assert [p.name for p in (run / "trajectories").iterdir()] == ["notes.txt"]
    assert (run / "metrics.jsonl").read_text() == "" and (run / "final").is_dir()
    assert forget_previous_run(run) == ""  # nothing left to remove: nothing said
    assert forget_previous_run(tmp_path / "new") == ""
