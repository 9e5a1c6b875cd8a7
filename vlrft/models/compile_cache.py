"""Where TorchInductor keeps the code it compiles: a directory only this user can write.

Inductor writes each compiled kernel as Python and shared-library files into its cache
directory and loads them from there, on this run and every later one. Its default is
`/tmp/torchinductor_<user>`, created if missing and used as found: a directory another local
user made there first (or one anyone may write) would hand that user the trainer's process,
root in a container. (torch writes that default into TORCHINDUCTOR_CACHE_DIR as soon as
torch._dynamo is imported, so a value equal to it is torch's choice, not the user's.) vlrft
compiles (`model.compile`, the HF engine's static decode) only after pointing the variable at a
private directory, and refuses one it cannot trust: a link anywhere on its path, or a
directory on it that another user owns or could write.
"""

from __future__ import annotations

import getpass
import os
import re
import stat
import tempfile
from pathlib import Path

from vlrft.errors import ConfigError

CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
TRITON_VARIABLE = "TRITON_CACHE_DIR"  # Triton's kernels, inductor's among them, where set
# torch features, off by default, that read torch's default directory whatever CACHE_VARIABLE says.
DEFAULT_DIR_READERS = ("TORCHINDUCTOR_ENABLE_CACHING_MODULE", "TORCHINDUCTOR_CPP_WRAPPER", "TORCH_CACHING_PRECOMPILE")


def torch_default_cache() -> Path:
    """torch's own default, `<tmp>/torchinductor_<user>` (as torch._inductor builds it)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return Path(tempfile.gettempdir()) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def default_private_cache() -> Path:
    """~/.cache/vlrft/torchinductor, or under XDG_CACHE_HOME when that is an absolute path (a
    relative one is ignored, as the XDG specification says)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".cache"
    return Path(os.path.abspath(base)) / "vlrft" / "torchinductor"


def untrusted_reason(path: Path) -> str:
    """Why `path` could be written or replaced by another user ("" when it cannot): a link
    anywhere on it, or the directory or one above it owned by another user (root aside), or
    writable by others (a parent only with the sticky bit, as /tmp has)."""
    path = Path(os.path.abspath(path))
    if os.path.realpath(path) != str(path):
        return f"{path} has a symbolic link on its path (it resolves to {os.path.realpath(path)})"
    me = os.geteuid()
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid != me:
        return f"{path} belongs to uid {info.st_uid}, not to this user (uid {me})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    for parent in path.parents:
        up = os.lstat(parent)
        if up.st_uid not in (me, 0):
            return f"{parent} belongs to uid {up.st_uid}: it could replace {path}"
        if up.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not up.st_mode & stat.S_ISVTX:
            return f"{parent} is writable by other users (mode {stat.S_IMODE(up.st_mode):o}): it could replace {path}"
    return ""


def _trusted_directory(path: Path, advice: str) -> Path:
    """`path`, made (mode 700) where missing, then checked; ConfigError naming it otherwise."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        reason = untrusted_reason(path)
    except OSError as err:
        reason = f"{path}: {err.strerror or err}"
    if reason:
        raise ConfigError(f"compiled code would be loaded from a directory another user can write or replace: {reason}; "
                          f"{advice}")
    return path


def _own_directory(variable: str) -> str:
    return f"set {variable} to a directory of your own (mode 700, no link on its path)"


def use_private_compile_cache() -> Path:
    """Point TorchInductor at a directory only this user can write, before anything compiles:
    the one `TORCHINDUCTOR_CACHE_DIR` names (unless it is torch's own default), else
    `default_private_cache()`. Also checks `TRITON_CACHE_DIR` where set, and torch's default
    directory where a feature that reads it is on. Raises ConfigError (one line) otherwise."""
    named = os.environ.get(CACHE_VARIABLE)
    chosen = named is not None and Path(os.path.abspath(named)) != torch_default_cache()
    path = Path(os.path.abspath(named)) if chosen else default_private_cache()
    _trusted_directory(path, _own_directory(CACHE_VARIABLE))
    os.environ[CACHE_VARIABLE] = str(path)
    if os.environ.get(TRITON_VARIABLE):
        _trusted_directory(Path(os.path.abspath(os.environ[TRITON_VARIABLE])), _own_directory(TRITON_VARIABLE))
    on = [flag for flag in DEFAULT_DIR_READERS if os.environ.get(flag, "0") not in ("", "0")]
    if on:
        _trusted_directory(torch_default_cache(), f"{', '.join(on)} read that directory whatever {CACHE_VARIABLE} says: "
                                                  "unset them, or make it your own")
    return path
