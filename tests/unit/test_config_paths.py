"""One rule for relative paths (vlrft/config_paths.py): relative to where the path was written,
the config file's directory or, on the command line, the current directory; recipes,
environments and tools included."""

import os
from pathlib import Path

import pytest
import yaml

from vlrft.config import load_config
from vlrft.multiturn.environment import resolve_environment
from vlrft.multiturn.tools import resolve_tool
from vlrft.rewards.loading import resolve_recipe

RECIPE = "def score(completions, samples):\n    return [{score} for _ in completions]\n"
ENVIRONMENT = "class Env:\n    def reset(self, sample):\n        return '{where}'\n"
TOOL = "def {name}(x: str) -> str:\n    return '{where}'\n"


@pytest.fixture
def two_places(tmp_path, monkeypatch):
    """A config directory and a different working directory, each holding its own recipe,
    environment and tool file of the same names (which one loads says which base was used)."""
    config_dir, cwd = tmp_path / "configs", tmp_path / "work"
    for place, score in ((config_dir, 1.0), (cwd, 2.0)):
        (place / "lib").mkdir(parents=True)
        for model in ("policy", "other"):  # (an `owner/name` path that names nothing is a hub id)
            (place / "models" / model).mkdir(parents=True)
        (place / "lib" / "recipe.py").write_text(RECIPE.format(score=score))
        (place / "lib" / "env.py").write_text(ENVIRONMENT.format(where=place.name))
        (place / "lib" / "tool.py").write_text(TOOL.format(name=f"tool_{place.name}", where=place.name))
    monkeypatch.chdir(cwd)
    return config_dir, cwd


def write(config_dir: Path, config: dict) -> Path:
    path = config_dir / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


FILE_CONFIG = {
    "model": {"path": "models/policy", "ref_path": "Qwen/Qwen2.5-VL-3B-Instruct"},
    "data": {"train_path": "data/train.jsonl", "eval_path": "data/eval.jsonl", "media_roots": ["media"]},
    "output": {"dir": "runs/x"},
    "reward": {"default": [{"recipe": "lib/recipe.py:score"},
                           {"recipe": "reward_model", "kwargs": {"path": "models/rm"}}],
               "by_data_source": {"math": [{"recipe": "lib/recipe.py:score"}]},
               "accuracy_recipe": "lib/recipe.py:score"},
    "rollout": {"environment": "lib/env.py:Env"},
}


def test_paths_in_the_config_file_are_relative_to_the_file(two_places):
    config_dir, _ = two_places
    cfg = load_config(write(config_dir, FILE_CONFIG))
    assert cfg.model.path == str(config_dir / "models" / "policy")
    assert cfg.model.ref_path == "Qwen/Qwen2.5-VL-3B-Instruct"  # names nothing there: a hub id
    assert cfg.data.train_path == str(config_dir / "data" / "train.jsonl")
    assert cfg.data.media_roots == [str(config_dir / "media")]
    assert cfg.output.dir == str(config_dir / "runs" / "x")
    assert cfg.reward.default[0].recipe == f"{config_dir / 'lib' / 'recipe.py'}:score"
    assert cfg.reward.default[1].kwargs["path"] == str(config_dir / "models" / "rm")
    assert cfg.reward.by_data_source["math"][0].recipe == f"{config_dir / 'lib' / 'recipe.py'}:score"
    assert cfg.reward.accuracy_recipe == f"{config_dir / 'lib' / 'recipe.py'}:score"
    # What loads is the config directory's file, though the current directory has one too.
    assert resolve_recipe(cfg.reward.default[0].recipe)(["a"], [{}]) == [1.0]
    assert resolve_environment(cfg.rollout.environment)().reset({}) == "configs"


def test_paths_on_the_command_line_are_relative_to_the_current_directory(two_places):
    config_dir, cwd = two_places
    overrides = ["output.dir=runs/y", "data.train_path=data/t.jsonl", "model.path=models/other",
                 "reward.default=[{recipe: lib/recipe.py:score}]", "rollout.environment=lib/env.py:Env",
                 "rollout.environment_args={tools: [lib/tool.py:tool_work, calculator]}"]
    cfg = load_config(write(config_dir, FILE_CONFIG), overrides)
    assert cfg.output.dir == str(cwd / "runs" / "y")
    assert cfg.data.train_path == str(cwd / "data" / "t.jsonl")
    assert cfg.model.path == str(cwd / "models" / "other")
    assert cfg.data.eval_path == str(config_dir / "data" / "eval.jsonl")  # not overridden: the file's
    assert resolve_recipe(cfg.reward.default[0].recipe)(["a"], [{}]) == [2.0]
    assert resolve_environment(cfg.rollout.environment)().reset({}) == "work"
    tools = cfg.rollout.environment_args["tools"]
    assert tools[1] == "calculator"  # a built-in name stays a name
    os.chdir("/")  # resolved once: where a worker process later runs does not matter
    name, tool = resolve_tool(tools[0])
    assert (name, tool("1")) == ("tool_work", "work")


def test_an_override_of_a_section_counts_for_every_path_in_it(two_places):
    config_dir, cwd = two_places
    cfg = load_config(write(config_dir, FILE_CONFIG), ["data={train_path: d.jsonl, media_roots: [m]}"])
    assert cfg.data.train_path == str(cwd / "d.jsonl") and cfg.data.media_roots == [str(cwd / "m")]
    assert cfg.model.path == str(config_dir / "models" / "policy")


def test_a_config_built_in_python_is_relative_to_the_current_directory(two_places):
    _, cwd = two_places
    cfg = load_config(None, ["model.path=models/other", "data.train_path=t.jsonl", "checkpoint.resume=runs/x/checkpoints/step_000004"])
    assert cfg.model.path == str(cwd / "models" / "other")
    assert cfg.checkpoint.resume == str(cwd / "runs" / "x" / "checkpoints" / "step_000004")


def test_names_modules_and_absolute_paths_are_left_as_written(two_places):
    config_dir, cwd = two_places
    absolute = f"{cwd / 'lib' / 'recipe.py'}:score"
    config = FILE_CONFIG | {"reward": {"default": [{"recipe": "exact_match"}, {"recipe": "reward_recipes.format:answer_tag_format"},
                                                   {"recipe": absolute}]},
                            "output": {"dir": "/abs/run"}}
    cfg = load_config(write(config_dir, config))
    assert [s.recipe for s in cfg.reward.default] == ["exact_match", "reward_recipes.format:answer_tag_format", absolute]
    assert cfg.output.dir == "/abs/run"
