"""Reading a checkpoint's files without trusting them (what a resume reads: trainer/checkpoint.py).

Every `.pt` file loads with `weights_only=True` (`load_state`): tensors, plain data and, in
DeepSpeed's files, the few DeepSpeed classes of DEEPSPEED_STATE_CLASSES, never code. Before
that, on rank 0: `checkpoint_files` walks the tree without following links and refuses a link
or a special file, and `PickleProbe` unpickles each pickle in a killable worker
(trainer/checkpoint_probe.py), refusing one that names anything outside the allow-list or does
not finish in time. Each refusal is one ConfigError line naming the file.
"""

from __future__ import annotations

import os
import pickle
import re
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from vlrft.errors import ConfigError
from vlrft.trainer.checkpoint_probe import probe
from vlrft.workers import CallFailed, CallTimedOut, Worker, error_text, limit_data_memory

# The classes DeepSpeed 0.19 pickles into its state files besides tensors and plain data: the
# ZeRO optimizer's loss scaler, stage and fragment addresses (found by saving ZeRO 0-3, fp32 and
# bf16, with LoRA, a critic and CPU offload, and listing each file's pickle globals:
# `torch.serialization.get_unsafe_globals_in_checkpoint`). Plain classes, rebuilt from data.
DEEPSPEED_STATE_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
DEEPSPEED_STATE_DIRS = ("policy", "critic")
# The names torch.save writes for tensors and state dicts of the dtypes vlrft trains in (listed
# from the pickles of the same checkpoints): what a probe allows, with DEEPSPEED_STATE_CLASSES
# in DeepSpeed's files. torch.load's weights_only allow-list is a second, wider check.
TENSOR_GLOBALS = frozenset({
    "collections.OrderedDict", "torch.Size", "torch.Tensor", "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter", "torch._tensor._rebuild_from_type_v2",
    *(f"torch.{kind}Storage" for kind in ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char",
                                          "Byte", "Bool", "ComplexFloat", "ComplexDouble")),
})
TAMPERED = "(not written by vlrft, or tampered with)"


def load_state(path: Path, map_location: Any = "cpu", classes: Sequence[type] = (), mmap: bool = False) -> Any:
    """A checkpoint `.pt` file, tensors, plain data and `classes` only (`weights_only`; vlrft's
    own files need no class): a file carrying anything else is refused in one line naming it,
    never executed. On the CPU by default: each tensor then goes to this rank's device as it is
    restored. `mmap`: tensors stay in the file until read (for a check that reads none)."""
    try:
        must_be_regular(path)
        with torch.serialization.safe_globals(list(classes)):
            return torch.load(path, weights_only=True, map_location=map_location, mmap=mmap)
    except pickle.UnpicklingError as err:
        culprit = re.search(r"GLOBAL (\S+)", str(err))  # torch's message is many lines, with bad advice
        what = f"{culprit[1]}, not only tensors and plain data" if culprit else "objects other than tensors and plain data"
        raise ConfigError(f"refusing to load checkpoint file {path}: it holds {what} {TAMPERED}") from None
    except (OSError, RuntimeError, EOFError) as err:
        raise ConfigError(f"checkpoint file {path} cannot be read: {str(err).splitlines()[0]}") from None


def must_be_regular(path: Path) -> None:
    """OSError unless `path` is a regular file, not a link to one: opening a FIFO planted under a
    checkpoint's name would wait for a writer forever."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise OSError(f"{path} is not a regular file")


def checkpoint_files(checkpoint: Path) -> list[Path]:
    """Every file under `checkpoint`, walked without following links. A link, or anything but a
    regular file or a directory, is refused in one line naming it: through a link rank 0's checks
    and a rank's load could read different files, and opening a FIFO waits forever."""
    found, todo = [], [checkpoint]
    while todo:
        here = todo.pop()
        try:
            with os.scandir(here) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
        except OSError as err:
            raise ConfigError(f"checkpoint directory {here} cannot be read: {err.strerror or err}") from None
        for entry in entries:
            if entry.is_symlink():
                raise ConfigError(f"refusing to resume from {checkpoint}: {entry.path} is a symbolic link, which no "
                                  f"checkpoint vlrft writes holds {TAMPERED}")
            if entry.is_dir(follow_symlinks=False):
                todo.append(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                found.append(Path(entry.path))
            else:
                raise ConfigError(f"refusing to resume from {checkpoint}: {entry.path} is not a regular file {TAMPERED}")
    return sorted(found)


class PickleProbe:
    """Unpickles checkpoint pickles, one at a time, in a worker process of its own
    (checkpoint_probe.probe: no tensor data read, nothing imported, no code run), each within
    `timeout_s` and `memory_bytes`: past either the worker is killed and the file refused. A
    context manager: the worker stops on leaving it."""

    def __init__(self, timeout_s: float, memory_bytes: int):
        self.timeout_s = timeout_s
        self.worker = Worker(prepare=(limit_data_memory, (memory_bytes,)))

    def __enter__(self) -> PickleProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.worker.stop()

    def check(self, path: Path, deepspeed: bool) -> None:
        """Refuse `path` in one line naming it unless its pickle unpickles in time with only
        TENSOR_GLOBALS (and, `deepspeed`, DEEPSPEED_STATE_CLASSES) in it."""
        allowed = TENSOR_GLOBALS | frozenset(DEEPSPEED_STATE_CLASSES if deepspeed else ())
        try:
            found = self.worker.call(probe, (str(path), allowed), self.timeout_s)
        except CallTimedOut:
            raise ConfigError(f"refusing to load checkpoint file {path}: its pickle did not unpickle within "
                              f"{self.timeout_s:g}s {TAMPERED}") from None
        except CallFailed as err:
            raise ConfigError(f"checkpoint file {path} cannot be read: its check failed ({err})") from None
        if found is None:
            return
        kind, detail = found
        if kind == "name":
            besides = "tensors, plain data and DeepSpeed's state" if deepspeed else "tensors and plain data"
            raise ConfigError(f"refusing to load checkpoint file {path}: it holds {detail}, not only {besides} {TAMPERED}")
        raise ConfigError(f"checkpoint file {path} cannot be read: {detail}")


@contextmanager
def restoring(path: Path) -> Iterator[None]:
    """Any failure while a rank restores what it loaded from `path` (a file, or DeepSpeed's
    directory) becomes one line naming it. Rank 0 checked what every rank restores before any
    loaded it (checkpoint.check_checkpoint), so this is what no check could see."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever the restoring code raises
        raise ConfigError(f"cannot resume from {path}: {error_text(err)}") from None
