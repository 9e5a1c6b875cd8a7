"""A dead peer in an asynchronous run (1 trainer + 1 rollout rank under torchrun): the surviving
rank stops with one vlrft line naming the dead rank and its role, not with gloo's traceback,
and by itself, before torchrun's SIGKILL 30 s after its SIGTERM.

- The trainer killed (SIGKILL) mid-run: the rollout rank, waiting on the job's store for
  weights (or sending a batch), gets torchrun's SIGTERM, and its watch finds the trainer silent.
- The rollout rank killed while it scores a batch: the trainer, inside gloo's receive of that
  batch, sees the connection closed at once, and its watch finds which peer went silent.
"""

import re
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.integration.test_async_training import by_rank
from tests.integration.test_resume import launch

pytestmark = pytest.mark.integration

# Once the trainer has logged a step and `hold` exists, a reward call marks `held` and waits for good.
HOLDING_RECIPE = """import time
from pathlib import Path


def distinct_chars(completions, samples):
    here = Path(__file__).parent
    if (here / "hold").exists() and (here / "run" / "metrics.jsonl").is_file():
        (here / "held").touch()
        while True:
            time.sleep(0.05)
    return [len(set(c)) / 10 for c in completions]
"""


def write_config(tmp_path, model: str, data, hold: bool) -> Path:
    (tmp_path / "recipe.py").write_text(HOLDING_RECIPE)
    if hold:
        (tmp_path / "hold").touch()
    config = {
        "model": {"path": model},
        "data": {"train_path": str(data / "train.jsonl")},
        "rollout": {"rollout_prompts": 4, "n_samples_per_prompt": 4, "max_new_tokens": 6, "ranks": 1},
        # Staleness 0: the trainer receives each batch right after it sent the weights for it.
        "train": {"total_steps": 50, "lr": 1e-2, "micro_batch_tokens": 200, "mode": "async", "max_staleness": 0},
        "reward": {"default": [{"recipe": "recipe.py:distinct_chars"}]},
        "eval": {"every_steps": 0},
        "output": {"dir": str(tmp_path / "run")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def wait_for(condition, proc, what: str) -> None:
    deadline = time.time() + 300
    while not condition():
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.time() < deadline, f"no {what}"
        time.sleep(0.1)


@pytest.mark.parametrize("victim, survivor", [("trainer", "rollout"), ("rollout", "trainer")])
def test_the_surviving_rank_names_the_dead_rank_and_its_role_in_one_line(victim, survivor, tiny_text, addition_data,
                                                                           tmp_path):
    proc = launch(write_config(tmp_path, tiny_text, addition_data, hold=victim == "rollout"), ranks=2)
    metrics = tmp_path / "run" / "metrics.jsonl"
    if victim == "trainer":
        wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, proc, "training step")
    else:
        wait_for((tmp_path / "held").is_file, proc, "held reward call")
        time.sleep(1.0)  # the trainer is now inside the receive of this batch
    rank = {"trainer": 0, "rollout": 1}
    launcher = psutil.Process(proc.pid)
    others = launcher.children(recursive=True)  # (the reward workers too)
    by_rank(launcher, rank[victim]).kill()
    out, _ = proc.communicate(timeout=120)
    _, alive = psutil.wait_procs(others, timeout=20)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]

    assert proc.returncode != 0
    lines = re.findall(rf"^vlrft: rank {rank[survivor]} .*$", out, re.M)
    assert len(lines) == 1, out[-4000:]
    assert re.fullmatch(rf"vlrft: rank {rank[survivor]} \({survivor}\) stops: rank {rank[victim]} \({victim}\) died or "
                        rf"stopped answering \(not heard from for \d+ s\)", lines[0]), lines
    assert "gloo" not in out and not re.search(r'File ".*vlrft', out), out[-4000:]  # (torchrun's own traceback stays)
    assert "forcefully exiting via 9" not in out, out[-4000:]  # it ended by itself, before torchrun's SIGKILL
