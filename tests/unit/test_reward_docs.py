"""docs/reward_recipes.md's worked example runs as written: the recipe file, its test, and the
config that plugs it in (the integration test trains with the same file)."""

import importlib
import re
import sys
from pathlib import Path

import yaml

from vlrft.config import load_config
from vlrft.rewards import RewardMix

DOC = Path(__file__).resolve().parents[2] / "docs" / "reward_recipes.md"


def doc_blocks() -> dict[str, str]:
    """Fenced blocks whose first line is a '# name' comment, by name."""
    blocks = re.findall(r"```\w*\n# (\S+)\n(.*?)```", DOC.read_text(), re.DOTALL)
    return {name: body for name, body in blocks}


def write_example(directory: Path) -> Path:
    """Writes the doc's colour_reward.py into `directory` and returns its path."""
    path = directory / "colour_reward.py"
    path.write_text(doc_blocks()["colour_reward.py"])
    return path


def test_worked_example_recipe_and_its_test_run(tmp_path, monkeypatch):
    blocks = doc_blocks()
    assert {"colour_reward.py", "test_colour_reward.py", "config"} <= set(blocks)
    write_example(tmp_path)
    (tmp_path / "test_colour_reward.py").write_text(blocks["test_colour_reward.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("colour_reward", "test_colour_reward"):
        sys.modules.pop(name, None)
    importlib.import_module("test_colour_reward").test_colour_credit()


def test_worked_example_config_loads_and_scores(tmp_path, monkeypatch):
    (tmp_path / "my_rewards").mkdir()
    write_example(tmp_path / "my_rewards")
    monkeypatch.chdir(tmp_path)  # file recipes are relative to the launch directory
    raw = yaml.safe_load(doc_blocks()["config"])
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({"model": {"path": "m"}, "data": {"train_path": "d"}, **raw}))
    cfg = load_config(tmp_path / "cfg.yaml")
    spec = cfg.reward.by_data_source["color_shapes"][1]
    assert (spec.name, spec.timeout_s, spec.fallback) == ("format", 5.0, 0.0)
    mix = RewardMix(cfg.reward)
    samples = [{"answer": "red", "data_source": "color_shapes"}, {"answer": "red", "data_source": "other"}]
    totals, components, _ = mix.score(["<answer>blue</answer>", "<answer>red</answer>"], samples)
    assert components == [{"colour_credit": 0.1, "format": 1.0}, {"exact_match": 1.0}]
    assert totals[0] == 0.1 * 1.0 + 1.0 * 0.1 and totals[1] == 1.0
