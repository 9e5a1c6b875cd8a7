"""A hub model id in model.path: kept as an id by the config, turned into its snapshot from the
local Hugging Face cache (offline: no download happens in tests), one line when there is none."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.process_env import fresh_process_env
from vlrft.config import ConfigError, load_config
from vlrft.models.hub import is_model_id, local_model_dir

ROOT = Path(__file__).parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(tmp_path: Path, model_dir: str) -> Path:
    """A cache holding `vlrft-test/tiny-text` at revision main, laid out as the hub client
    writes it (refs/main -> snapshots/<commit>/files)."""
    cache = tmp_path / "hub"
    repo = cache / "models--vlrft-test--tiny-text"
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def run_offline(cache: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_config_keeps_hub_ids_and_resolves_local_paths(tmp_path):
    (tmp_path / "cfg.yaml").write_text("model: {path: Qwen/Qwen2.5-VL-7B-Instruct, ref_path: ckpt/ref}\n")
    (tmp_path / "cfg2.yaml").write_text("model: {path: models/policy}\n")
    (tmp_path / "models" / "policy").mkdir(parents=True)
    overrides = ["data.train_path=x.jsonl"]
    cfg = load_config(tmp_path / "cfg.yaml", overrides)
    assert cfg.model.path == "Qwen/Qwen2.5-VL-7B-Instruct"  # names nothing next to the config: an id
    assert cfg.model.ref_path == "ckpt/ref"  # owner/name-shaped too: an id until something is there
    assert load_config(tmp_path / "cfg2.yaml", overrides).model.path == str(tmp_path / "models" / "policy")
    assert is_model_id("Qwen/Qwen2.5-1.5B") and not is_model_id("./a/b") and not is_model_id("a/b/c")


def test_a_missing_local_path_is_one_line():
    with pytest.raises(ConfigError, match=r"^config key 'model.path': no model directory at /no/such/dir$"):
        local_model_dir("/no/such/dir", "model.path")


def test_vlrft_train_names_a_missing_model_directory_in_one_line(tmp_path, addition_data):
    (tmp_path / "cfg.yaml").write_text(
        f"model: {{path: {tmp_path / 'gone'}}}\ndata: {{train_path: {addition_data / 'train.jsonl'}}}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n"
    )
    env = fresh_process_env()
    proc = subprocess.run([sys.executable, "-m", "vlrft.cli", "train", str(tmp_path / "cfg.yaml")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"vlrft: error: config key 'model.path': no model directory at {tmp_path / 'gone'}"


def test_a_cached_hub_id_loads_through_the_trainers_resolution(tmp_path, tiny_text, addition_data):
    cache = hub_cache(tmp_path, tiny_text)
    code = (
        "from vlrft.config import load_config\n"
        "from vlrft.models.hub import resolve_model_paths\n"
        "from vlrft.data.encoding import PromptEncoder\n"
        "from vlrft.models.loader import load_model\n"
        f"cfg = load_config(None, ['model.path=vlrft-test/tiny-text', 'data.train_path={addition_data / 'train.jsonl'}'])\n"
        "resolve_model_paths(cfg)\n"
        "print(cfg.model.path)\n"
        "print(type(load_model(cfg.model.path)).__name__, PromptEncoder(cfg.model.path, 3136, 12544, 64).tokenizer.eos_token)\n"
    )
    proc = run_offline(cache, code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path, loaded = proc.stdout.strip().splitlines()[-2:]
    assert Path(path) == cache / "models--vlrft-test--tiny-text" / "snapshots" / COMMIT
    assert loaded.startswith("Qwen2ForCausalLM ")


def test_an_id_the_cache_lacks_is_one_line(tmp_path, tiny_text):
    cache = hub_cache(tmp_path, tiny_text)
    code = (
        "from vlrft.models.hub import local_model_dir\n"
        "from vlrft.errors import VlrftError\n"
        "try:\n"
        "    local_model_dir('vlrft-test/not-there', 'model.path')\n"
        "except VlrftError as err:\n"
        "    print(err)\n"
    )
    proc = run_offline(cache, code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    message = proc.stdout.strip()
    assert "\n" not in message
    assert message.startswith("config key 'model.path': 'vlrft-test/not-there' is not a local directory, and the "
                              "Hugging Face hub (or its local cache) gave no snapshot of it (")
