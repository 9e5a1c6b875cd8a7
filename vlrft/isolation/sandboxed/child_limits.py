"""Resource limits a sandboxed interpreter sets on itself before running anything it was given.
Set from inside because the launcher runs in threads (no preexec_fn); they cannot be raised
again (the process has no CAP_SYS_RESOURCE, and setrlimit above the hard limit needs it)."""

import resource


# Threads (tasks) of the sandbox. Counted per user namespace, so only the sandbox's own; the
# kernel does not apply it to root, for whom the launcher uses a pids cgroup instead.
TASKS = 256


def apply(memory_bytes: int, cpu_seconds: int, file_bytes: int, open_files: int) -> None:
    for res, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_CPU, cpu_seconds),
                       (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NOFILE, open_files),
                       (resource.RLIMIT_NPROC, TASKS), (resource.RLIMIT_CORE, 0)):
        hard = resource.getrlimit(res)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(res, (value, value))
