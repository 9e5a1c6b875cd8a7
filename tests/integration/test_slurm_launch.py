"""examples/slurm/train.sbatch runs as written: its torchrun line (c10d rendezvous, ranks from
torchrun, not from Slurm) trains, with `srun` and `scontrol` standing in for a Slurm cluster."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.integration.test_torchrun_training import free_port

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"

# srun on one node: drop srun's own options and run the task; scontrol: this host is the node.
FAKE_SRUN = '#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n'
FAKE_SCONTROL = '#!/usr/bin/env bash\necho 127.0.0.1\n'


def test_sbatch_script_trains_with_torchrun_ranks(tmp_path, tiny_text, addition_data):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    config = {
        "model": {"path": tiny_text},
        "data": {"train_path": str(addition_data / "train.jsonl")},
        "rollout": {"rollout_prompts": 2, "n_samples_per_prompt": 2, "max_new_tokens": 4},
        "train": {"total_steps": 1},
        "eval": {"every_steps": 0},
        "output": {"dir": str(tmp_path / "run")},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # Two Slurm tasks in the job: the ranks must still come from torchrun, not be refused.
    env |= {"PATH": f"{bin_dir}:{env['PATH']}", "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1",
            "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "GPUS_PER_NODE": "2", "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "cfg.yaml"), "train.seed=3"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["seed"] == 3  # overrides pass through
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "rollout/reward_mean" in r] == [1]
    assert (tmp_path / "run" / "final" / "config.json").is_file()
