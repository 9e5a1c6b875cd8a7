"""The user and resource limits a sandboxed interpreter takes on before it reads anything it
was given. Set from inside because the launcher runs in threads (no preexec_fn); they cannot be
undone (the process keeps no capability: not CAP_SETUID to become root again, nor
CAP_SYS_RESOURCE to raise a hard limit)."""

import os
import resource


# Threads (tasks) of the sandbox. The kernel counts them per user: the sandbox's own user
# (started by root) or its user namespace (started by anyone else), so only its own.
TASKS = 256


def become(user: str) -> None:
    """'UID:GID': leave root for that user, with no supplementary groups (a root trainer's
    sandbox; see vlrft/isolation/launch.py). '-': stay."""
    if user == "-":
        return
    uid, gid = (int(part) for part in user.split(":"))
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getgroups():
        raise SystemExit("sandbox: could not leave root")


def apply(memory_bytes: int, cpu_seconds: int, file_bytes: int, open_files: int) -> None:
    for res, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_CPU, cpu_seconds),
                       (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NOFILE, open_files),
                       (resource.RLIMIT_NPROC, TASKS), (resource.RLIMIT_CORE, 0)):
        hard = resource.getrlimit(res)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(res, (value, value))
