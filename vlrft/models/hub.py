"""Model ids from the Hugging Face hub (`Qwen/Qwen2.5-VL-7B-Instruct`) as local directories.

Everything downstream (tokenizer, image processor, both engines, the loaders, checkpoints)
reads a directory, so an id is turned into its snapshot directory once, at start: the hub's
local cache when it holds the snapshot (`HF_HUB_OFFLINE=1` makes that the only place looked
at), else a download of the files a checkpoint needs, by one rank per node first.
"""

from __future__ import annotations

import os
from pathlib import Path

from vlrft.config_paths import MODEL_ID
from vlrft.distributed import barrier
from vlrft.errors import ConfigError

# What a checkpoint needs: config, weights, tokenizer and processor files (not .bin or .pth
# copies of the same weights, not the repository's other files).
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def is_model_id(path: str) -> bool:
    """`owner/name` that is not a relative path to something on disk."""
    return bool(MODEL_ID.fullmatch(path)) and not Path(path).exists()


def local_model_dir(path: str, key: str) -> str:
    """`path` when it is a directory; the local snapshot of a hub model id; else a one-line
    ConfigError naming the config `key`."""
    if Path(path).is_dir():
        return path
    if not is_model_id(path):
        raise ConfigError(f"config key '{key}': no model directory at {path}")
    from huggingface_hub import snapshot_download  # noqa: PLC0415 - only for hub ids

    try:
        return snapshot_download(repo_id=path, allow_patterns=CHECKPOINT_FILES)
    except Exception as err:  # noqa: BLE001 - offline, unknown id, gated repo, network: all one line
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"config key '{key}': '{path}' is not a local directory, and the Hugging Face hub (or its local "
            f"cache) gave no snapshot of it ({reason})"
        ) from None


def resolve_model_paths(cfg) -> None:
    """Replace hub ids in `model.path`, `model.ref_path`, `critic.path` and `teacher.path` by their local
    snapshot directories (a collective: every rank calls it). Local rank 0 fetches first so a
    node downloads each model once; the other ranks then find it in the cache."""
    fields = [(cfg.model, "path", "model.path"), (cfg.model, "ref_path", "model.ref_path"), (cfg.critic, "path", "critic.path"),
              (cfg.teacher, "path", "teacher.path")]
    fields = [(section, name, key) for section, name, key in fields if getattr(section, name)]
    for section, name, key in fields:  # a local path that is not there: one line, before any loading
        if not is_model_id(getattr(section, name)):
            local_model_dir(getattr(section, name), key)
    hub = [(section, name, key) for section, name, key in fields if is_model_id(getattr(section, name))]
    if not hub:
        return
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    problem = None
    if first:
        try:
            resolved = [local_model_dir(getattr(section, name), key) for section, name, key in hub]
        except ConfigError as err:
            problem = err
    barrier()  # the node's copy is in the cache (or it failed, and every rank fails alike)
    if problem is not None:
        raise problem
    if not first:
        resolved = [local_model_dir(getattr(section, name), key) for section, name, key in hub]
    for (section, name, _), directory in zip(hub, resolved):
        setattr(section, name, directory)
