"""How one sandboxed interpreter is started: bubblewrap's command line, the user it runs as, and
the process it becomes (vlrft/isolation/sandbox.py runs programs through it).

Three things here hold even when the trainer runs as root, as it does in most containers:
- **Never the host's root.** bubblewrap started by root with a user namespace maps the
  sandbox's uid 0 to the host's root: every root-owned file it can see stays writable
  (/proc/sys/kernel/core_pattern among them, whose `|helper` runs as root at the next core
  dump). So a root trainer starts bwrap without a user namespace, keeping only the right to
  change user (CAP_SETUID, CAP_SETGID), and the runner's first act inside is to become a user
  of its own (SANDBOX_UIDS, no supplementary groups), which clears every capability: the
  kernel checks every file against an ordinary user, and the thread limit (RLIMIT_NPROC,
  which the kernel does not apply to root) holds. A non-root trainer's bwrap makes an
  unprivileged user namespace of its user. `/proc/sys` is, in addition, an empty read-only
  tmpfs, and `/sys` is absent.
- **A fresh session keyring** for each sandbox: the process that becomes bwrap is forked from
  a thread that first joined a new anonymous session keyring (credentials are per thread),
  so the trainer's keys are not the sandbox's even by possession. The seccomp
  allowlist refuses keyctl, add_key and request_key besides.
- **A system-call allowlist** (vlrft/isolation/seccomp_policy.py), loaded by bwrap.
And, where one can be made (root), a memory cgroup per sandbox (vlrft/isolation/memory_cgroup.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vlrft.errors import ConfigError
from vlrft.isolation import memory_cgroup
from vlrft.isolation.seccomp_policy import native_filter

# A root trainer's sandboxes run as a user of their own, picked at random from this range (no
# file on the host belongs to one): the kernel counts RLIMIT_NPROC per user, so one sandbox's
# threads cannot use up another's.
SANDBOX_UIDS = range(0x5A000000, 0x5B000000)
TMPFS_BYTES = 64 * 1024 * 1024  # the sandbox's only writable place, in memory
SANDBOXED = Path(__file__).parent / "sandboxed"  # the runners, bound read-only into the sandbox
INSIDE = "/opt/vlrft-sandbox"  # where they appear there
# The variables a sandboxed program sees (and nothing of the trainer's environment).
CHILD_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
             "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_KEYCTL = {"x86_64": 250, "aarch64": 219}  # the keyctl system call's number
_KEYCTL_JOIN_SESSION_KEYRING = 1


class SandboxUnavailable(ConfigError):
    """No OS isolation here and no opt-in to run without it (one line saying how to fix it)."""


class Launch:
    """The command that runs one sandboxed interpreter on a runner, and the descriptors it needs."""

    def __init__(self, bwrap: str | None, work: str, memory_bytes: int) -> None:
        self.bwrap, self.work, self.memory_bytes = bwrap, work, memory_bytes
        self.fds: list[int] = []  # passed to the child, closed here once it started
        self.cgroup: str | None = None  # its memory cgroup, where one can be made

    def command(self, runner: str, args: list[str], files: dict[str, str]) -> list[str]:
        """argv for sandboxed/<runner> with the user it becomes and `args`; `files` (name ->
        host path) are placed in its working directory."""
        if self.bwrap is None:  # no isolation (opted in): a temporary directory and the hook
            for name, path in files.items():
                shutil.copy(path, os.path.join(self.work, name))
            return [*unshare_prefix(), sys.executable, "-I", "-B", str(SANDBOXED / runner), "-", *args]
        argv = [self.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv", "--cap-drop", "ALL"]
        if os.geteuid() == 0:  # the runner keeps the right to become an ordinary user, and nothing else
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:  # an unprivileged bwrap needs a user namespace; the program may not make more
            argv += ["--unshare-user", "--disable-userns"]
        for name, value in {**CHILD_ENV, "HOME": "/tmp", "TMPDIR": "/tmp"}.items():
            argv += ["--setenv", name, value]
        argv += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/lib", "/lib32", "/lib64", "/sbin"):  # merged-/usr links, or directories
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
                 "--perms", "01777", "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp", "--chdir", "/tmp"]
        # After the tmpfs (a venv under /tmp must not be hidden by it); the directories above
        # each bound one made readable (root's bwrap makes them 0700, which its user cannot enter).
        made: set[str] = {"/", "/tmp"}
        for source, inside in [*((prefix, prefix) for prefix in python_dirs()), (str(SANDBOXED), INSIDE)]:
            for parent in reversed(Path(inside).parents):
                if str(parent) not in made:
                    made.add(str(parent))
                    argv += ["--perms", "0755", "--dir", str(parent)]
            argv += ["--ro-bind", source, inside]
        # /dev/pts hidden: a pseudo-terminal takes ioctls that attach line disciplines, whose
        # kernel modules load on demand, and an ioctl's argument cannot be filtered reliably.
        argv += ["--proc", "/proc", "--size", "4096", "--tmpfs", "/proc/sys", "--dev", "/dev",
                 "--size", "4096", "--tmpfs", "/dev/pts"]
        for name, path in files.items():
            argv += ["--file", str(self._keep(os.open(path, os.O_RDONLY))), f"/tmp/{name}"]
        # bwrap's own root and /dev are tmpfs without a size: read-only, /tmp stays the only
        # writable place.
        argv += ["--remount-ro", "/proc/sys", "--remount-ro", "/dev", "--remount-ro", "/"]
        read, write = os.pipe()  # the filter: a few KiB, within a pipe's buffer
        os.write(write, native_filter()[0])
        os.close(write)
        argv += ["--seccomp", str(self._keep(read)), "--", sys.executable, "-I", "-B", f"{INSIDE}/{runner}",
                 self.user(), *args]
        return argv

    def user(self) -> str:
        """What the runner becomes before it reads the program ("UID:GID"), or "-": stay (an
        unprivileged bwrap's user namespace holds a user already, the unisolated child is you)."""
        if self.bwrap is None or os.geteuid() != 0:
            return "-"
        uid = random.choice(SANDBOX_UIDS)
        return f"{uid}:{uid}"

    def env(self) -> dict[str, str]:
        """The environment of the launched process (bwrap's, or the unisolated child's)."""
        if self.bwrap is None:
            return {**CHILD_ENV, "HOME": self.work, "TMPDIR": self.work}
        return {"PATH": CHILD_ENV["PATH"]}

    def _keep(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def start(self, argv: list[str], stdin, stdout, stderr, pass_fds=()) -> subprocess.Popen:
        if self.bwrap is not None:  # the program's memory, its tmpfs, and what the kernel holds for it
            self.cgroup = memory_cgroup.create(self.memory_bytes + TMPFS_BYTES + memory_cgroup.KERNEL_MARGIN)
            if self.cgroup is not None:
                argv = memory_cgroup.join_command(self.cgroup, argv)
        try:
            return spawn_in_fresh_keyring(argv, stdin=stdin, stdout=stdout, stderr=stderr, env=self.env(),
                                          cwd=self.work, pass_fds=(*self.fds, *pass_fds), start_new_session=True)
        except BaseException:
            if self.cgroup is not None:
                memory_cgroup.remove(self.cgroup)
            raise
        finally:
            for fd in self.fds:
                os.close(fd)
            self.fds.clear()

    def finish(self, proc: subprocess.Popen) -> None:
        """SIGKILL the process group (bwrap, or the unisolated child and what it started), reap
        it, remove its cgroup. A sandbox dies with bwrap (--die-with-parent), and all of it with
        its PID 1."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # unreaped, so its pid is still the group id
            except ProcessLookupError:
                pass
        proc.wait()
        with _started_lock:
            _started.discard(proc.pid)
        if self.bwrap is not None and receives_orphans():
            reap_orphaned_sandboxes()
        if self.cgroup is not None:
            memory_cgroup.remove(self.cgroup)


# bwrap's outer process exits as soon as it has the program's status, before its PID-namespace
# init (the inner bwrap) has exited: the kernel hands that one to the nearest subreaper, else
# to PID 1, and it stays a zombie until that process reaps it. A trainer that is PID 1 of its
# container (or a subreaper) receives them, and Python reaps only children it started: every
# sandbox call would leak a pid until fork fails. Such a trainer reaps them, only zombies named
# bwrap that it did not start itself (another thread's Popen waits on those). It does not make
# itself a subreaper: every other orphan of its descendants (an environment worker's killed
# children) would then stay its zombie. Under torchrun as PID 1, run an init (docs/security.md).
PR_GET_CHILD_SUBREAPER = 37
_started: set[int] = set()  # pids of bwraps started here and not yet reaped by their Popen
_started_lock = threading.Lock()


def _forget_parents_sandboxes() -> None:
    """In a forked child: its parent's bwraps are not its children, and a lock another thread
    held at the fork would stay held."""
    global _started_lock
    _started.clear()
    _started_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_parents_sandboxes)


def receives_orphans() -> bool:
    """Whether orphaned processes are handed to this one: PID 1 of its namespace, or a subreaper."""
    flag = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    return os.getpid() == 1 or flag.value != 0


def reap_orphaned_sandboxes(wait_s: float = 1.0) -> None:
    """Reap this process's children named bwrap that no Popen of its own waits on: the inner
    bwraps handed over when their outer one ended, which die with it (--die-with-parent);
    waiting up to `wait_s` for those still exiting."""
    deadline = time.monotonic() + wait_s
    while True:
        with _started_lock:
            orphans = [(pid, state) for pid, state in _children("bwrap") if pid not in _started]
            for pid, state in orphans:
                if state == "Z":
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
        if all(state == "Z" for _, state in orphans) or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _children(name: str) -> list[tuple[int, str]]:
    """(pid, state) of this process's children whose command is `name`."""
    me, found = os.getpid(), []
    for task in Path(f"/proc/{me}/task").glob("*/children"):  # (empty where the kernel lacks CONFIG_PROC_CHILDREN)
        try:
            pids = task.read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            comm, _, rest = stat.partition(" (")[2].rpartition(") ")
            if comm == name:
                found.append((int(pid), rest.split()[0]))
    return found


def spawn_in_fresh_keyring(argv: list[str], **popen) -> subprocess.Popen:
    """subprocess.Popen(argv, **popen) from this process's spawning thread, which joins a new,
    empty session keyring before each start: the child inherits that keyring, and no other
    thread of this process changes its own. Where the kernel or a container's filter refuses
    keyctl, the child keeps the caller's keyring (the sandbox's allowlist refuses keyctl, so it
    stays out of reach)."""
    return _spawner().submit(_spawn, argv, popen).result()


def _spawn(argv: list[str], popen: dict) -> subprocess.Popen:
    number = _KEYCTL.get(platform.machine())
    if number is not None:
        ctypes.CDLL(None, use_errno=True).syscall(number, _KEYCTL_JOIN_SESSION_KEYRING, None)
    with _started_lock:
        proc = subprocess.Popen(argv, **popen)
        _started.add(proc.pid)
    return proc


_spawners: dict[int, ThreadPoolExecutor] = {}


def _spawner() -> ThreadPoolExecutor:
    """One long-lived thread per process (a forked child makes its own): bwrap's
    --die-with-parent fires when the *thread* that started it ends, so it must not be a
    thread that ends with the call."""
    pid = os.getpid()
    if pid not in _spawners:
        _spawners.clear()
        _spawners[pid] = ThreadPoolExecutor(1, thread_name_prefix="vlrft-sandbox-spawn")
    return _spawners[pid]


@functools.lru_cache(maxsize=None)
def unshare_prefix() -> tuple[str, ...]:
    """Without bubblewrap: ("unshare", "-rn") where a user + network namespace can be made."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    try:
        probe = subprocess.run([exe, "-rn", sys.executable, "-I", "-c", "pass"], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ()
    return (exe, "-rn") if probe.returncode == 0 else ()


def python_dirs() -> list[str]:
    """This interpreter's directories (a venv, a pyenv or conda install), read-only in the
    sandbox; those under /usr are there already. Refused if one is '/': that would be all."""
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    dirs.add(os.path.dirname(os.path.realpath(sys.executable)))
    if "/" in dirs:
        raise SandboxUnavailable("the Python installation lives at '/', which the sandbox would have to expose whole")
    return sorted(d for d in dirs if not (d == "/usr" or d.startswith("/usr/")))

