"""Reading a checkpoint's pickle without trusting it, in a worker process (vlrft.workers).

A resume's rank 0 probes every pickle the resume will read before any rank loads one
(trainer/checkpoint.py, `check_checkpoint`). Only the archive's `data.pkl` is read, never the
tensor data: an unpickler that knows only the allow-listed names builds an inert stand-in for
each and a placeholder for each tensor storage, so nothing is imported and no code runs. What a
name-list check cannot see, the probe's timeout ends: a pickle of plain data can still take
forever (a dict keyed by a deep tuple DAG hashes 2**depth times, in C, where no signal reaches),
and the worker is killed with it. Standard library only: the worker starts in milliseconds.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
import zipfile

# A real data.pkl holds names and a few hundred bytes per tensor (tens of KB for the tiny
# models, MBs for the largest MoE models); beyond this it is not vlrft's or DeepSpeed's.
MAX_PICKLE_BYTES = 64 << 20
DATA_PKL = re.compile(r"^[^/]+/data\.pkl$")  # torch.save's layout: <archive>/data.pkl


class Inert:
    """What an allowed name unpickles as: it takes any arguments and state and holds nothing."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state) -> None:
        pass


class InertDict(dict):
    """collections.OrderedDict's stand-in: items are set on it (their keys hashed, as in the real
    load), and its attributes (`_metadata`) are dropped."""

    def __setstate__(self, state) -> None:
        pass


class RefusedName(Exception):
    """The pickle names a global outside the allow-list."""


class ProbeUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: frozenset[str]):
        super().__init__(io.BytesIO(data))
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        qualified = f"{module}.{name}"
        if qualified not in self.allowed:
            raise RefusedName(qualified)
        return InertDict if qualified == "collections.OrderedDict" else Inert

    def persistent_load(self, pid):  # a tensor storage: its bytes stay unread
        return Inert()


def probe(path: str, allowed: frozenset[str]) -> tuple[str, str] | None:
    """None when `path` is a torch.save archive whose pickle names only `allowed` globals and
    unpickles (keys hashed, containers built); else (kind, detail): ("name", the first global
    outside `allowed`) or ("unreadable", why, one line)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO or a link is refused, not waited on
    except OSError as err:
        return "unreadable", err.strerror or str(err)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return "unreadable", "not a regular file"
    with open(fd, "rb") as file:
        try:
            data = pickle_bytes(file)
        except zipfile.BadZipFile as err:
            return "unreadable", f"not a torch.save archive ({err})"
        except (ValueError, OSError, EOFError) as err:  # a damaged archive
            return "unreadable", f"its archive is damaged ({type(err).__name__}: {' '.join(str(err).split())[:160]})"
    if isinstance(data, str):
        return "unreadable", data
    try:
        ProbeUnpickler(data, allowed).load()
    except RefusedName as err:
        return "name", str(err)
    except MemoryError:
        return "unreadable", "unpickling it needs more memory than its check may take"
    except RecursionError:
        return "unreadable", "its pickle nests too deeply"
    except Exception as err:  # noqa: BLE001 - a malformed pickle raises many types
        return "unreadable", f"its pickle is malformed ({type(err).__name__}: {' '.join(str(err).split())[:160]})"
    return None


def pickle_bytes(file) -> bytes | str:
    """The archive's data.pkl, or why it is not a torch.save archive vlrft or DeepSpeed wrote:
    one data.pkl, every record stored uncompressed (as torch.save writes them; a compressed
    record could expand without bound), the pickle at most MAX_PICKLE_BYTES."""
    archive = zipfile.ZipFile(file)
    pickles = [info for info in archive.infolist() if DATA_PKL.match(info.filename)]
    if len(pickles) != 1:
        return "not a torch.save archive (no single <archive>/data.pkl)"
    compressed = next((info.filename for info in archive.infolist() if info.compress_type != zipfile.ZIP_STORED), None)
    if compressed is not None:
        return f"its record {compressed} is compressed (torch.save stores every record as it is)"
    if pickles[0].file_size > MAX_PICKLE_BYTES:
        return f"its pickle is {pickles[0].file_size} bytes, more than a checkpoint's may have ({MAX_PICKLE_BYTES >> 20} MiB)"
    with archive.open(pickles[0]) as record:
        data = record.read(MAX_PICKLE_BYTES + 1)
    if len(data) > MAX_PICKLE_BYTES:
        return f"its pickle is larger than a checkpoint's may be ({MAX_PICKLE_BYTES >> 20} MiB)"
    return data
