"""A resume is validated before anything after its checkpoint is discarded: a refused resume
(changed state-shaping key, other world size) deletes no checkpoint, trajectory or metric line;
an accepted one then discards the abandoned future."""

import hashlib
import json

import pytest
import torch

from vlrft.config import ConfigError
from tests.unit.test_freeze_vision import build

RUN = ["train.total_steps=4", "checkpoint.save_steps=2", "checkpoint.keep_last=3", "trajectory.save_every=1",
       "eval.every_steps=0"]


def snapshot(run) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in run.rglob("*") if p.is_file()}


def logged_steps(run) -> list[int]:
    return sorted({json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()})


def test_a_refused_resume_deletes_nothing(tiny_text, addition_data, tmp_path, world_of_one):
    run = tmp_path / "run"
    build(tiny_text, addition_data, run, RUN).train()
    step_2 = run / "checkpoints" / "step_000002"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert len(list((run / "trajectories").glob("step_00000[34].rank0.jsonl"))) == 2 and logged_steps(run)[-2:] == [3, 4]

    before = snapshot(run)
    with pytest.raises(ConfigError, match=r"cannot resume from .*step_000002: config keys train.seed differ") as refused:
        build(tiny_text, addition_data, run, RUN + [f"checkpoint.resume={step_2}", "train.seed=7"])
    assert "\n" not in str(refused.value)
    assert snapshot(run) == before  # step 4, trajectories of steps 3-4, their metric lines: all still there

    state = torch.load(step_2 / "trainer.pt", weights_only=True)
    torch.save({**state, "world_size": 2}, step_2 / "trainer.pt")
    before = snapshot(run)
    with pytest.raises(ConfigError, match=r"step_000002 was written by 2 ranks; .*this run has 1"):
        build(tiny_text, addition_data, run, RUN + [f"checkpoint.resume={step_2}"])
    assert snapshot(run) == before

    torch.save(state, step_2 / "trainer.pt")  # the same resume, acceptable: now the future goes
    resumed = build(tiny_text, addition_data, run, RUN + [f"checkpoint.resume={step_2}"])
    assert resumed.global_step == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    assert not list((run / "trajectories").glob("step_00000[34].rank0.jsonl")) and max(logged_steps(run)) == 2
