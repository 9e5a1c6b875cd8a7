"""A memory cgroup per sandbox: one limit on all the memory a sandbox makes the kernel hold.

The address-space limit (RLIMIT_AS) counts a process's own mappings only. A sandbox can make
the kernel hold memory that belongs to no mapping: inodes and directory entries of files in its
tmpfs (the tmpfs' size counts data, not inodes: a loop of empty files held 3.5 GiB of kernel
memory), pipe and socket buffers, page tables. A memory cgroup counts all of it, and the kernel
stops the sandbox (failed allocations, or its own OOM kill inside the cgroup) at the limit.

Making a cgroup needs write access to a cgroup hierarchy with the memory controller: root,
outside a container that hides /sys/fs/cgroup. cgroup v1 (a `memory` hierarchy) and v2 (the
parent hands `memory` down in cgroup.subtree_control) both work; where neither is writable,
sandboxes run without one and the other limits stand alone (docs/security.md says so).
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from pathlib import Path

KERNEL_MARGIN = 64 * 1024 * 1024  # page tables, kernel stacks, pipes, inodes: beyond the program's own memory
# cgroup v1 keeps TCP buffers out of memory.usage_in_bytes and counts them only under a limit of
# their own (queues filled and never read held 220 MiB of host memory past a 256 MiB sandbox).
TCP_BUFFER_BYTES = 16 * 1024 * 1024
_made = itertools.count()


@functools.lru_cache(maxsize=None)
def parent() -> tuple[str, int] | None:
    """(a directory where this process may make memory cgroups, the cgroup version), or None."""
    if os.geteuid() != 0:
        return None
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        membership = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    places = []
    for line in mounts:
        fields, _, tail = line.partition(" - ")
        fstype, _, options = tail.split(" ")[:3]
        mount_point = fields.split(" ")[4]
        for entry in membership:
            number, controllers, path = entry.split(":", 2)
            if fstype == "cgroup" and "memory" in options.split(",") and "memory" in controllers.split(","):
                places.append((mount_point + path, 1))
            elif fstype == "cgroup2" and number == "0":
                places.append((mount_point + path, 2))
    for place, version in places:
        if version == 2:
            try:
                if "memory" not in Path(place, "cgroup.subtree_control").read_text().split():
                    continue
            except OSError:
                continue
        probe = os.path.join(place, f"vlrft-probe-{os.getpid()}")
        try:
            os.mkdir(probe)
            usable = os.path.exists(os.path.join(probe, _limit_file(version)))
            os.rmdir(probe)
        except OSError:
            continue
        if usable:
            return place, version
    return None


def _limit_file(version: int) -> str:
    return "memory.limit_in_bytes" if version == 1 else "memory.max"


def create(limit_bytes: int) -> str | None:
    """A new memory cgroup holding at most `limit_bytes` (no swap), or None where none can be
    made. The caller moves the sandbox into it (`join_command`) and removes it (`remove`)."""
    where = parent()
    if where is None:
        return None
    place, version = where
    path = os.path.join(place, f"vlrft-sandbox-{os.getpid()}-{next(_made)}")
    try:
        os.mkdir(path)
        Path(path, _limit_file(version)).write_text(f"{limit_bytes}\n")
        tcp = os.path.join(path, "memory.kmem.tcp.limit_in_bytes")  # v1 counts TCP buffers only once set (v2 always)
        if version == 1 and os.path.exists(tcp):
            Path(tcp).write_text(f"{TCP_BUFFER_BYTES}\n")
        swap = "memory.memsw.limit_in_bytes" if version == 1 else "memory.swap.max"
        if os.path.exists(os.path.join(path, swap)):  # swap counted: memory pushed to swap still counts
            Path(path, swap).write_text(f"{limit_bytes if version == 1 else 0}\n")
    except OSError:
        remove(path)
        return None
    return path


def join_command(path: str, argv: list[str]) -> list[str]:
    """argv run by a shell that first moves itself into the cgroup: what it then becomes (bwrap)
    and everything that starts, starts inside."""
    return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', path, *argv]


def remove(path: str) -> None:
    for _ in range(100):  # its tasks may take a moment to be gone once the sandbox died
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
