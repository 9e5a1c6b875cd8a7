"""One run per output directory: rank 0 holds an exclusive lock on `output.dir/.vlrft.lock`.

Two runs writing one directory would rotate away each other's checkpoints, and a resuming run
would discard the other's newer steps. The lock is an `flock`: the kernel releases it when the
holding process ends, however it ends (SIGKILL, power loss), so a stale lock file never blocks
a resume. The file names the holder (pid and host) for the error message only.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from vlrft.distributed import broadcast_from_rank0
from vlrft.errors import ConfigError

LOCK_FILE = ".vlrft.lock"
_held: dict[Path, int] = {}  # run dir -> open descriptor, kept for the life of the process


def lock_run_dir(run_dir: Path) -> None:
    """Take the run directory's lock, or raise a one-line ConfigError naming its holder.
    Re-entrant within a process: a trainer built again in the same process (tests, notebooks)
    is the same run, not a second one."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # no truncation: the holder's line stays
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"config key 'output.dir': {run_dir} is in use by another run ({holder}); "
            "wait for it to end or choose another output.dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    _held[run_dir] = fd


def claim_run_dir(run_dir: Path, rank: int) -> None:
    """Rank 0 takes the lock; every rank fails with rank 0's message if it cannot (collective)."""
    problem = ""
    if rank == 0:
        try:
            lock_run_dir(run_dir)
        except ConfigError as err:
            problem = str(err)
    problem = broadcast_from_rank0(problem)
    if problem:
        raise ConfigError(problem)
