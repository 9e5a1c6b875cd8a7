"""guards.on_collapse: rollback on the demo's launcher, 2 ranks (trainer/rollback.py): a collapse
scripted by the reward recipes (scripted_collapse.py: good for 4 steps, nothing from step 5) is
named at step 5, and the policy goes back to the checkpoint of step 3, the newest before the
peak's rollouts, with half the learning rate; a resumed run keeps the lower rate."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

DEMO = Path(__file__).resolve().parents[2] / "examples" / "color_shapes" / "run.sh"
RECIPES = Path(__file__).resolve().parent / "scripted_collapse.py"
SETTINGS = ["rollout.rollout_prompts=4", "rollout.n_samples_per_prompt=4", "eval.every_steps=0", "trajectory.save_every=0",
            "checkpoint.save_steps=1", "checkpoint.keep_last=10", "guards.on_collapse=rollback",
            f"reward.default=[{{recipe: {RECIPES}:task}}, {{recipe: {RECIPES}:format_score, weight: 0.1}}]",
            f"reward.accuracy_recipe={RECIPES}:task", "train.lr_schedule=constant"]


def demo(run_dir: Path, *overrides: str) -> str:
    done = subprocess.run(["bash", str(DEMO), f"output.dir={run_dir}", *SETTINGS, *overrides], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "NPROC": "2"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


def policy_state(run_dir: Path, step: int) -> dict:
    """The policy's weights and the learning-rate schedule in the checkpoint of `step`."""
    files = list((run_dir / "checkpoints" / f"step_{step:06d}" / "policy").rglob("mp_rank_00_model_states.pt"))
    return torch.load(files[0], map_location="cpu", weights_only=False)  # (the test's own run's file)


def test_a_collapse_rolls_the_policy_back_to_the_checkpoint_before_it(tmp_path):
    run = tmp_path / "run"
    out = demo(run, "train.total_steps=5")
    rolled = [line for line in out.splitlines() if line.startswith("vlrft: rolled back")]
    assert rolled == [f"vlrft: rolled back to {run}/checkpoints/step_000003 after the collapse from step 5: the policy "
                      "of step 3, learning rate x0.5 from now on (0.0005; guards.on_collapse: rollback)"], out[-3000:]
    assert sum("vlrft: warning: collapse (" in line and "from step 5" in line for line in out.splitlines()) == 1
    metrics = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert [metrics[s]["guards/collapse"] for s in range(1, 6)] == [0, 0, 0, 0, 1]
    assert (metrics[5]["guards/rollback"], metrics[5]["guards/rollback_to_step"], metrics[5]["train/lr_scale"]) == (1, 3, 0.5)

    # The checkpoint after the rollback (step 5, the last) holds the policy of step 3, which
    # step 4 had changed, and the halved schedule
    three, four, five = (policy_state(run, step) for step in (3, 4, 5))
    assert any(not torch.equal(three["module"][k], four["module"][k]) for k in three["module"])
    assert all(torch.equal(three["module"][k], five["module"][k]) for k in three["module"])
    assert five["lr_scheduler"]["base_lrs"] == [0.5 * lr for lr in three["lr_scheduler"]["base_lrs"]]
    saved = torch.load(run / "checkpoints" / "step_000005" / "trainer.pt", weights_only=False)
    assert (saved["rollbacks"], saved["lr_scale"]) == ([3], 0.5)

    demo(run, "train.total_steps=6")  # resumed: the lower rate stays
    metrics = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert metrics[6]["train/lr"] == pytest.approx(metrics[4]["train/lr"] / 2, rel=1e-6)
