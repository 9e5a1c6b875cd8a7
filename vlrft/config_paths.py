"""One rule for relative paths in a config: a path is relative to where it was written.

- Written in a config file: relative to that file's directory (a config and its data travel
  together, and examples run from anywhere).
- Written on the command line (a dotted override such as `output.dir=runs/x`), or in a config
  built in Python (`load_config(None, overrides)`): relative to the current directory, as every
  other path a shell command takes.

The rule covers every key that names a file or directory (FILE_KEYS, MODEL_KEYS, media roots,
`checkpoint.resume`) and every place a config may name a `path/to/file.py:name` callable: reward
recipes, `reward.accuracy_recipe`, `rollout.environment`, and the tools of the built-in tools
environment (`rollout.environment_args.tools`); also the `path` keyword of the built-in
model-scored recipes. Relative paths become absolute here, once, so nothing later depends on the
directory a rank or a worker process happens to run in.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

FILE_KEYS = ("data.train_path", "data.eval_path", "data.ptx_path", "output.dir", "teacher.token_file")
# Also a hub model id (`owner/name`) when that names nothing relative to where it was written.
MODEL_KEYS = ("model.path", "model.ref_path", "critic.path", "teacher.path")
MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
MODEL_RECIPES = ("reward_model", "generative_judge")  # built-in recipes whose `path` kwarg is a checkpoint

Where = Callable[[str], Path]  # dotted location of a value -> the directory it is relative to


def origin(config_dir: Path | None, overridden: list[str]) -> Where:
    """Where a value at a dotted location was written: the command line if an override set it
    (or a section above it), else the config file (no file: the current directory)."""
    def where(location: str) -> Path:
        from_command_line = config_dir is None or any(location == key or location.startswith(key + ".") for key in overridden)
        return Path.cwd() if from_command_line else config_dir
    return where


def absolute(path: str, base: Path) -> str:
    return str((base / path).resolve()) if path and not Path(path).is_absolute() else path


def absolute_callable(spec: str, base: Path) -> str:
    """'dir/file.py:name' made absolute; names, 'pkg.mod:name' and absolute paths as they are."""
    target, colon, name = spec.rpartition(":")
    return f"{absolute(target, base)}:{name}" if colon and target.endswith(".py") else spec


def model_path(path: str, base: Path) -> str:
    return path if MODEL_ID.fullmatch(path) and not (base / path).exists() else absolute(path, base)


def resolve_paths(cfg, where: Where) -> None:
    """Make every relative path and file callable of a built Config absolute (module docstring)."""
    for key in FILE_KEYS + MODEL_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        fix = model_path if key in MODEL_KEYS else absolute
        setattr(getattr(cfg, section), name, fix(value, where(key)))
    cfg.data.media_roots = [absolute(p, where("data.media_roots")) for p in cfg.data.media_roots]
    if cfg.checkpoint.resume not in ("auto", "never"):
        cfg.checkpoint.resume = absolute(cfg.checkpoint.resume, where("checkpoint.resume"))
    cfg.rollout.environment = absolute_callable(cfg.rollout.environment, where("rollout.environment"))
    tools = cfg.rollout.environment_args.get("tools")
    if isinstance(tools, list):  # (a bad value is the environment's to refuse)
        base = where("rollout.environment_args.tools")
        cfg.rollout.environment_args["tools"] = [absolute_callable(t, base) if isinstance(t, str) else t for t in tools]
    cfg.reward.accuracy_recipe = absolute_callable(cfg.reward.accuracy_recipe, where("reward.accuracy_recipe"))
    mixes = [("reward.default", cfg.reward.default)] + [
        (f"reward.by_data_source.{source}", mix) for source, mix in cfg.reward.by_data_source.items()]
    for location, mix in mixes:
        for spec in mix:
            spec.recipe = absolute_callable(spec.recipe, where(location))
            if spec.recipe in MODEL_RECIPES and isinstance(spec.kwargs.get("path"), str):
                spec.kwargs["path"] = absolute(spec.kwargs["path"], where(location))
