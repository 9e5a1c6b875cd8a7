"""Run model-written Python where it can do no harm (docs/reward_recipes.md, "Code execution").

A policy under RL pressure will find any way a program can fake a reward or reach outside, so
the boundary is the operating system, not Python. With bubblewrap (`bwrap`), each run gets:
- its own user, PID, network, IPC, UTS and cgroup namespaces: no network interface but
  loopback, no process of the trainer in sight (nothing to read in /proc, nothing to signal),
  and everything it started dies with it;
- a filesystem of read-only system and Python directories and one private tmpfs of
  TMPFS_BYTES as the only writable place: no home directory, no file of the trainer or data;
- a seccomp filter that refuses new processes (fork, vfork, clone without CLONE_THREAD) and
  ptrace: threads work, fork bombs and children that outlive the call do not;
- resource limits (address space, CPU seconds, file size, open files), a clean environment,
  and a wall-clock timeout that kills it.
Tests of the `code_unit_tests` recipe run in a second sandbox (`run_tests`): the harness holds
the tests and the verdict; the program only answers calls (sandboxed/run_tests.py).

Without bubblewrap there is no isolation, only rlimits, `unshare -rn` and an audit hook inside
the interpreter (which a determined program can get past). Running then needs the opt-in
`sandbox.unsafe_no_isolation: true` (`allow_unisolated`); otherwise SandboxUnavailable.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from vlrft.errors import ConfigError
from vlrft.isolation.sandboxed.child_limits import TASKS  # threads of one sandbox (also its pids cgroup's)

OUTPUT_LIMIT = 64 * 1024  # bytes of stdout / stderr kept
FILE_LIMIT = 16 * 1024 * 1024  # RLIMIT_FSIZE: an endless print loop fails here (EFBIG)
OPEN_FILES = 64
TMPFS_BYTES = 64 * 1024 * 1024  # the sandbox's only writable place, in memory
SANDBOXED = Path(__file__).parent / "sandboxed"  # the runners, bound read-only into the sandbox
INSIDE = "/opt/vlrft-sandbox"  # where they appear there
UNSAFE_ENV = "VLRFT_SANDBOX_UNSAFE_NO_ISOLATION"  # set from the config; inherited by worker processes
# The variables a sandboxed program sees (and nothing of the trainer's environment).
CHILD_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
             "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class SandboxUnavailable(ConfigError):
    """No OS isolation here and no opt-in to run without it (one line saying how to fix it)."""


@dataclass
class SandboxResult:
    returncode: int  # negative: killed by that signal (SIGKILL on timeout or at the CPU limit)
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@dataclass
class TestVerdict:
    passed: bool
    reason: str  # "pass", or "fail: why" (the harness's words, or the timeout)
    timed_out: bool = False


# ------------------------------------------------------------------------------ isolation


def allow_unisolated(allowed: bool) -> None:
    """`sandbox.unsafe_no_isolation`: run programs without OS isolation where there is none.
    An environment variable, so that reward and environment worker processes inherit it."""
    if allowed:
        os.environ[UNSAFE_ENV] = "1"
    else:
        os.environ.pop(UNSAFE_ENV, None)


def configure(unsafe_no_isolation: bool) -> str | None:
    """Apply `sandbox.unsafe_no_isolation` to this process (and the workers it starts); the
    warning to print when that lets code run unisolated here, else None."""
    allow_unisolated(unsafe_no_isolation)
    problem = isolation_problem() if unsafe_no_isolation else None
    return None if problem is None else (
        f"vlrft: warning: sandbox.unsafe_no_isolation is set and {problem}: model-written code runs "
        "without OS isolation, guarded only inside its interpreter")


def isolation_problem() -> str | None:
    """Why programs cannot be isolated here, or None when bubblewrap works."""
    return _bubblewrap()[1]


def isolated() -> bool:
    """Whether programs run in the OS sandbox; raises SandboxUnavailable when they cannot and
    running without it was not allowed."""
    if isolation_problem() is None:
        return True
    check_can_run_code("this call", os.environ.get(UNSAFE_ENV) == "1")
    return False


def check_can_run_code(what: str, unsafe_allowed: bool, opt_in: str = "set sandbox.unsafe_no_isolation: true") -> None:
    """At start: `what` (a recipe or tool that runs code) may run here, or one line why not."""
    problem = isolation_problem()
    if problem is not None and not unsafe_allowed:
        raise SandboxUnavailable(
            f"{what} runs model-written code, which needs OS isolation, and {problem}: install bubblewrap "
            f"(apt install bubblewrap; it needs unprivileged user namespaces), or {opt_in} to run it with "
            "only in-process guards (unsafe)"
        )


def runs_code(fn) -> bool:
    """True for the built-in code recipe and any function whose module uses this sandbox (its
    functions imported, or the module itself)."""
    module = inspect.getmodule(fn)
    this = sys.modules[__name__]
    return module is not None and (
        module.__name__ == "reward_recipes.code"
        or any(value is run_python or value is run_tests or value is this for value in vars(module).values())
    )


@functools.lru_cache(maxsize=None)
def _bubblewrap() -> tuple[str | None, str | None]:
    """(bwrap's path, None) when a sandbox starts here (probed once), else (None, why not)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return None, "bubblewrap (bwrap) is not installed"
    if _seccomp_filter() is None:
        return None, f"no seccomp filter is written for this machine's architecture ({platform.machine()})"
    result = _run_plain(exe, "print('sandbox ok')", "", 20.0, 256, 1024)
    if result.stdout.strip() != "sandbox ok":
        why = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        return None, f"bwrap cannot start a sandbox here ({why})"
    return exe, None


@functools.lru_cache(maxsize=None)
def _unshare_prefix() -> tuple[str, ...]:
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


# seccomp: syscall numbers per architecture, and the filter as classic BPF (struct sock_filter).
# Refused outright: new processes, ptrace, and memory that no rlimit counts (memfd files, SysV
# shared memory and message queues live outside the address space and the tmpfs).
_ARCHES = {  # arch: (AUDIT_ARCH, refused, clone, clone3, (socket, socketpair))
    "x86_64": (0xC000003E, {"fork": 57, "vfork": 58, "ptrace": 101, "memfd_create": 319, "shmget": 29,
                            "msgget": 68}, 56, 435, (41, 53)),
    "aarch64": (0xC00000B7, {"ptrace": 117, "memfd_create": 279, "shmget": 194, "msgget": 186},  # no fork/vfork
                220, 435, (198, 199)),
}
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000
_X32_BIT = 0x40000000
# Socket families a program may open: local ones and IP (which its network namespace confines).
# Others (AF_VSOCK, AF_PACKET, ...) are not all confined by a network namespace.
_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6


@functools.lru_cache(maxsize=None)
def _seccomp_filter() -> bytes | None:
    """Refuse fork, vfork, clone without CLONE_THREAD, ptrace, memfd_create, shmget, msgget and
    sockets of other families than _FAMILIES (EPERM); clone3 says ENOSYS, so that libc starts
    threads with clone, whose flags a filter can read (clone3's it cannot).
    Syscalls of another ABI (i386 via int 0x80, x32) are refused whole: their numbers differ."""
    if platform.machine() not in _ARCHES:
        return None
    arch, refused, clone, clone3, sockets = _ARCHES[platform.machine()]
    program: list[tuple] = [("ld", 4), ("jeq", arch, None, "deny"), ("ld", 0)]
    if platform.machine() == "x86_64":
        program.append(("jge", _X32_BIT, "deny", None))
    program += [("jeq", nr, "deny", None) for nr in refused.values()]
    program += [("jeq", nr, "family", None) for nr in sockets]
    program += [("jeq", clone3, "enosys", None), ("jeq", clone, None, "allow"),
                ("ld", 16), ("jset", _CLONE_THREAD, "allow", "deny"),  # args[0]: clone's flags
                ("label", "family"), ("ld", 16)]  # args[0]: the socket's family
    program += [("jeq", family, "allow", None) for family in _FAMILIES] + [("ret", _ERRNO | _EPERM)]
    program += [("label", "allow"), ("ret", _ALLOW), ("label", "deny"), ("ret", _ERRNO | _EPERM),
                ("label", "enosys"), ("ret", _ERRNO | _ENOSYS)]
    return _assemble(program)


def _assemble(program: list[tuple]) -> bytes:
    labels, flat = {}, []
    for item in program:
        if item[0] == "label":
            labels[item[1]] = len(flat)
        else:
            flat.append(item)
    codes = {"ld": 0x20, "ret": 0x06, "jeq": 0x15, "jge": 0x35, "jset": 0x45}  # BPF_LD|W|ABS, BPF_RET|K, BPF_JMP|K
    out = b""
    for i, (op, k, *targets) in enumerate(flat):
        jt, jf = (0 if t is None else labels[t] - i - 1 for t in targets) if targets else (0, 0)
        out += struct.pack("=HBBI", codes[op], jt, jf, k)
    return out


# ------------------------------------------------------------------------------ launching


class _Launch:
    """The command that runs one sandboxed interpreter on a runner, and the descriptors it needs."""

    def __init__(self, bwrap: str | None, work: str) -> None:
        self.bwrap, self.work = bwrap, work
        self.fds: list[int] = []  # passed to the child, closed here once it started
        self.cgroup: str | None = None  # its pids cgroup (root only)

    def command(self, runner: str, args: list[str], files: dict[str, str]) -> list[str]:
        """argv for sandboxed/<runner> with `args`; `files` (name -> host path) are placed in
        its working directory."""
        if self.bwrap is None:  # no isolation (opted in): a temporary directory and the hook
            for name, path in files.items():
                shutil.copy(path, os.path.join(self.work, name))
            return [*_unshare_prefix(), sys.executable, "-I", "-B", str(SANDBOXED / runner), *args]
        argv = [self.bwrap, "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                "--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session", "--as-pid-1",
                "--cap-drop", "ALL", "--hostname", "sandbox", "--clearenv"]
        for name, value in {**CHILD_ENV, "HOME": "/tmp", "TMPDIR": "/tmp"}.items():
            argv += ["--setenv", name, value]
        argv += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/lib", "/lib32", "/lib64", "/sbin"):  # merged-/usr links, or directories
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
                 "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp", "--chdir", "/tmp"]
        for prefix in _python_dirs():  # after the tmpfs: a venv under /tmp must not be hidden by it
            argv += ["--ro-bind", prefix, prefix]
        argv += ["--ro-bind", str(SANDBOXED), INSIDE, "--proc", "/proc", "--dev", "/dev"]
        for name, path in files.items():
            argv += ["--file", str(self._keep(os.open(path, os.O_RDONLY))), f"/tmp/{name}"]
        # bwrap's own root and /dev are tmpfs without a size: read-only, /tmp stays the only
        # writable place.
        argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
        read, write = os.pipe()  # the filter: a few hundred bytes, within a pipe's buffer
        os.write(write, _seccomp_filter())
        os.close(write)
        argv += ["--seccomp", str(self._keep(read)), "--", sys.executable, "-I", "-B", f"{INSIDE}/{runner}", *args]
        return argv

    def env(self) -> dict[str, str]:
        """The environment of the launched process (bwrap's, or the unisolated child's)."""
        if self.bwrap is None:
            return {**CHILD_ENV, "HOME": self.work, "TMPDIR": self.work}
        return {"PATH": CHILD_ENV["PATH"]}

    def _keep(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def start(self, argv: list[str], stdin, stdout, stderr, pass_fds=()) -> subprocess.Popen:
        self.cgroup = _new_tasks_cgroup() if self.bwrap is not None else None
        if self.cgroup is not None:  # the shell joins the cgroup, then becomes bwrap: no task escapes it
            argv = ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', self.cgroup, *argv]
        try:
            return subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, cwd=self.work, env=self.env(),
                                    pass_fds=(*self.fds, *pass_fds), start_new_session=True)
        finally:
            for fd in self.fds:
                os.close(fd)
            self.fds.clear()

    def finish(self, proc: subprocess.Popen) -> None:
        """Kill what is left of the launched process and remove its cgroup."""
        _kill(proc)
        if self.cgroup is not None:
            for _ in range(100):  # its tasks may take a moment to be gone once PID 1 died
                try:
                    os.rmdir(self.cgroup)
                    break
                except OSError:
                    time.sleep(0.01)


@functools.lru_cache(maxsize=None)
def _tasks_cgroup_parent() -> str | None:
    """Where root can make a pids cgroup per sandbox (RLIMIT_NPROC does not bind root), or None
    (not root: the rlimit holds; or no writable pids controller: then threads are bounded by
    the address space and the timeout only)."""
    if os.geteuid() != 0:
        return None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):  # cgroup v1
            parent = f"/sys/fs/cgroup/pids{path}"
        elif number == "0":  # cgroup v2: children get pids only if the parent hands it down
            parent = f"/sys/fs/cgroup{path}"
            try:
                if "pids" not in Path(parent, "cgroup.subtree_control").read_text().split():
                    continue
            except OSError:
                continue
        else:
            continue
        probe = os.path.join(parent, f"vlrft-probe-{os.getpid()}")
        try:
            os.mkdir(probe)
            usable = os.path.exists(os.path.join(probe, "pids.max"))
            os.rmdir(probe)
        except OSError:
            continue
        if usable:
            return parent
    return None


_cgroups_made = iter(range(1 << 62))


def _new_tasks_cgroup() -> str | None:
    parent = _tasks_cgroup_parent()
    if parent is None:
        return None
    path = os.path.join(parent, f"vlrft-sandbox-{os.getpid()}-{next(_cgroups_made)}")
    try:
        os.mkdir(path)
        Path(path, "pids.max").write_text(f"{TASKS}\n")
    except OSError:
        return None
    return path


def _python_dirs() -> list[str]:
    """This interpreter's directories (a venv, a pyenv or conda install), read-only in the
    sandbox; those under /usr are there already. Refused if one is '/': that would be all."""
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    dirs.add(os.path.dirname(os.path.realpath(sys.executable)))
    if "/" in dirs:
        raise SandboxUnavailable("the Python installation lives at '/', which the sandbox would have to expose whole")
    return sorted(d for d in dirs if not (d == "/usr" or d.startswith("/usr/")))


def _limits(timeout_s: float, memory_mb: int) -> list[str]:
    return [str(memory_mb * 2**20), str(math.ceil(timeout_s) + 1), str(FILE_LIMIT), str(OPEN_FILES)]


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process group (bwrap, or the unisolated child and what it started), reap it.
    A sandbox dies with bwrap (--die-with-parent), and all of it with its PID 1."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # unreaped, so its pid is still the group id
        except ProcessLookupError:
            pass
    proc.wait()


def _read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _check(timeout_s: float, memory_mb: int) -> None:
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError(f"sandbox: timeout_s and memory_mb must be positive, got {timeout_s}, {memory_mb}")


def run_python(code: str, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512, *,
               output_limit: int = OUTPUT_LIMIT) -> SandboxResult:
    """Run `code` as a script with `stdin` as its standard input, within `timeout_s` wall-clock
    seconds and `memory_mb` of address space; stdout / stderr are cut to `output_limit` bytes."""
    _check(timeout_s, memory_mb)
    bwrap = _bubblewrap()[0] if isolated() else None
    return _run_plain(bwrap, code, stdin, timeout_s, memory_mb, output_limit)


def _run_plain(bwrap: str | None, code: str, stdin: str, timeout_s: float, memory_mb: int,
               output_limit: int) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="vlrft-sandbox-", ignore_cleanup_errors=True) as tmp:
        work = os.path.join(tmp, "work")  # unisolated: the child's cwd; its streams live beside it
        os.mkdir(work)
        paths = {name: os.path.join(tmp, name) for name in ("main.py", "stdin", "stdout", "stderr")}
        Path(paths["main.py"]).write_text(code, encoding="utf-8")
        Path(paths["stdin"]).write_text(stdin, encoding="utf-8")
        launch = _Launch(bwrap, work)
        argv = launch.command("run_program.py", [*_limits(timeout_s, memory_mb), str(int(bwrap is None))],
                              {"main.py": paths["main.py"]})
        # Streams are files, not pipes: no reader threads, no deadlock on big input, and
        # RLIMIT_FSIZE bounds what a print loop can write.
        with open(paths["stdin"], "rb") as fin, open(paths["stdout"], "wb") as fout, open(paths["stderr"], "wb") as ferr:
            proc = launch.start(argv, fin, fout, ferr)
            try:
                proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            launch.finish(proc)
        return SandboxResult(proc.returncode, _read_capped(paths["stdout"], output_limit),
                             _read_capped(paths["stderr"], output_limit), timed_out)


def run_tests(program: str, tests: str, timeout_s: float = 5.0, memory_mb: int = 512) -> TestVerdict:
    """Run `tests` (Python asserts naming the program's functions) against `program`: the
    program in one sandbox, the tests in another that holds the verdict. Both within
    `timeout_s` wall-clock seconds, each within `memory_mb` of address space."""
    _check(timeout_s, memory_mb)
    bwrap = _bubblewrap()[0] if isolated() else None
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="vlrft-sandbox-", ignore_cleanup_errors=True) as tmp:
        for name, text in (("main.py", program), ("tests.py", tests)):
            Path(tmp, name).write_text(text, encoding="utf-8")
        for name in ("program", "harness"):
            os.mkdir(os.path.join(tmp, name))
        request_r, request_w = os.pipe()  # harness -> program
        reply_r, reply_w = os.pipe()  # program -> harness
        verdict_r, verdict_w = os.pipe()  # harness -> here; the program never holds it
        limits = _limits(timeout_s, memory_mb)
        program_launch, harness_launch = _Launch(bwrap, os.path.join(tmp, "program")), _Launch(bwrap, os.path.join(tmp, "harness"))
        try:  # the harness first: without isolation its files are not the program's to change
            argv = harness_launch.command("run_tests.py", [*limits, str(reply_r), str(request_w), str(verdict_w)], {})
            with open(f"{tmp}/tests.py", "rb") as fin:
                harness_proc = harness_launch.start(argv, fin, subprocess.DEVNULL, subprocess.DEVNULL,
                                                    (reply_r, request_w, verdict_w))
            argv = program_launch.command("run_program.py", [*limits, str(int(bwrap is None)), "serve",
                                                             str(request_r), str(reply_w)], {"main.py": f"{tmp}/main.py"})
            try:
                program_proc = program_launch.start(argv, subprocess.DEVNULL, subprocess.DEVNULL, subprocess.DEVNULL,
                                                    (request_r, reply_w))
            except BaseException:
                harness_launch.finish(harness_proc)
                raise
        finally:
            for fd in (request_r, request_w, reply_r, reply_w, verdict_w):
                os.close(fd)
        try:
            harness_proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        harness_launch.finish(harness_proc)
        program_launch.finish(program_proc)  # its answers are no longer wanted, whatever it is doing
        with os.fdopen(verdict_r, "rb") as f:
            said = f.read(1000).decode("utf-8", errors="replace")
    if timed_out:
        return TestVerdict(False, f"fail: timed out after {timeout_s:g}s", True)
    if said == "pass":
        return TestVerdict(True, said)
    return TestVerdict(False, said if said.startswith("fail: ") else "fail: the harness gave no verdict")
