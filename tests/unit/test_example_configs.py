"""Every example config loads and validates as shipped (hub ids stay ids), fits the launch its
script makes (8 ranks a node), and every launch script parses and names files that exist."""

import re
import subprocess
from pathlib import Path

import pytest

from vlrft.config import load_config
from vlrft.config_paths import MODEL_ID
from vlrft.config_checks import check_world_size

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REAL_RUNS = ["qwen2_5_vl_geo3k", "qwen2_5_math"]
CONFIGS = sorted(EXAMPLES.glob("*/*.yaml"))


def test_every_real_run_folder_has_configs_and_both_launchers():
    for folder in REAL_RUNS:
        assert sorted(p.name for p in (EXAMPLES / folder).glob("*.sh")) == ["run.sh"]
        assert (EXAMPLES / folder / "train.sbatch").is_file()
        assert list((EXAMPLES / folder).glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_config_validates(path):
    cfg = load_config(path)
    if path.parent.name in REAL_RUNS:
        assert MODEL_ID.fullmatch(cfg.model.path), cfg.model.path  # a hub id, kept as written
        assert cfg.model.compute_dtype == "bfloat16" and cfg.rollout.engine == "vllm"
        assert cfg.rollout.max_new_tokens >= 1024 and cfg.train.lr <= 2e-5
        check_world_size(cfg, 8, 8)  # what run.sh launches on one node
        check_world_size(cfg, 16, 8)  # two Slurm nodes
        assert cfg.data.train_path.startswith(str(EXAMPLES.parent / "data"))  # relative to the file


@pytest.mark.parametrize("script", sorted(EXAMPLES.glob("*/*.sh")) + sorted(EXAMPLES.glob("*/*.sbatch")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_launch_scripts_parse_and_name_existing_files(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for default in re.findall(r"\$\{(?:CONFIG|1):-([\w.]+\.yaml)\}", text):
        assert (script.parent / default).is_file(), f"{script.name} defaults to missing {default}"
    for named in re.findall(r"examples/[\w/]+\.(?:sbatch|sh|py)", text):
        assert (EXAMPLES.parent / named).is_file(), f"{script.name} names missing {named}"
    # Overrides on a command line are relative to where it runs (examples/launch.sh: the
    # repository's root), not to the config file: a path there that climbs out is a mistake.
    for key, value in re.findall(r"\b((?:data\.\w+_path|output\.dir|model\.path|teacher\.path))=(\S+)", text):
        assert not value.startswith("../"), f"{script.name}: {key}={value} leaves the repository from its root"
