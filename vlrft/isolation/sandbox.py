"""Run model-written Python where it can do no harm (docs/reward_recipes.md, "Code execution").

A policy under RL pressure will find any way a program can fake a reward or reach outside, so
the boundary is the operating system, not Python. With bubblewrap (`bwrap`), each run gets
(vlrft/isolation/launch.py builds it):
- a user that is not the host's root, with no capability;
- its own PID, network, IPC, UTS and cgroup namespaces: no network interface but loopback, no
  process of the trainer in sight (nothing to read in /proc, nothing to signal), and
  everything it started dies with it;
- a filesystem of read-only system and Python directories and one private tmpfs of 64 MiB
  (launch.TMPFS_BYTES) as the only writable place: no home directory, no file of the trainer
  or data;
- an allowlist of system calls (vlrft/isolation/seccomp_policy.py): threads work, new
  processes, io_uring, keys, mounts and the rest do not;
- resource limits (address space, CPU seconds, file size, open files, threads; a memory cgroup
  where one can be made), a clean environment, a fresh session keyring, and a wall-clock
  timeout that kills it.
Tests of the `code_unit_tests` recipe run in a second sandbox (`run_tests`): the harness holds
the tests and the verdict; the program only answers calls (sandboxed/run_tests.py).

Without bubblewrap there is no isolation, only rlimits, `unshare -rn` and an audit hook inside
the interpreter (which a determined program can get past). Running then needs the opt-in
`sandbox.unsafe_no_isolation: true` (`allow_unisolated`); otherwise SandboxUnavailable.
"""

from __future__ import annotations

import inspect
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from vlrft.isolation.launch import Launch, SandboxUnavailable
from vlrft.isolation.seccomp_policy import native_filter

OUTPUT_LIMIT = 64 * 1024  # bytes of stdout / stderr kept
FILE_LIMIT = 16 * 1024 * 1024  # RLIMIT_FSIZE: an endless print loop fails here (EFBIG)
OPEN_FILES = 64
UNSAFE_ENV = "VLRFT_SANDBOX_UNSAFE_NO_ISOLATION"  # set from the config; inherited by worker processes


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


PROBE_AGAIN_S = 60.0  # a failed probe is tried again after this long
_probed: list[tuple[float, tuple[str | None, str | None]]] = []  # (when, outcome) of the last probe


def _bubblewrap() -> tuple[str | None, str | None]:
    """(bwrap's path, None) when a sandbox starts here, else (None, why not). A success holds
    for the process's life; a failure is probed again after PROBE_AGAIN_S, so a moment of
    pressure (memory, disk) does not leave a long-lived worker without its sandbox, or, with
    the unsafe opt-in, running programs unisolated, for good."""
    now = time.monotonic()
    if _probed and (_probed[0][1][0] is not None or now - _probed[0][0] < PROBE_AGAIN_S):
        return _probed[0][1]
    _probed[:] = [(now, _probe())]
    return _probed[0][1]


def _probe() -> tuple[str | None, str | None]:
    exe = shutil.which("bwrap")
    if exe is None:
        return None, "bubblewrap (bwrap) is not installed"
    if native_filter()[0] is None:
        return None, f"no system-call filter can be made here: {native_filter()[1]}"
    result = _run_plain(exe, "print('sandbox ok')", "", 20.0, 256, 1024)
    if result.stdout.strip() != "sandbox ok":
        why = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        return None, f"bwrap cannot start a sandbox here ({why})"
    return exe, None


def _limits(timeout_s: float, memory_mb: int) -> list[str]:
    return [str(memory_mb * 2**20), str(math.ceil(timeout_s) + 1), str(FILE_LIMIT), str(OPEN_FILES)]


def _utf8(text: str) -> bytes:
    """`text` as UTF-8, lone surrogates included (a str from JSON may hold them): the program
    that cannot be read then fails inside the sandbox like any other, instead of here."""
    return text.encode("utf-8", "surrogatepass")


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
        Path(paths["main.py"]).write_bytes(_utf8(code))
        Path(paths["stdin"]).write_bytes(_utf8(stdin))
        launch = Launch(bwrap, work, memory_mb * 2**20)
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
            Path(tmp, name).write_bytes(_utf8(text))
        for name in ("program", "harness"):
            os.mkdir(os.path.join(tmp, name))
        request_r, request_w = os.pipe()  # harness -> program
        reply_r, reply_w = os.pipe()  # program -> harness
        verdict_r, verdict_w = os.pipe()  # harness -> here; the program never holds it
        limits = _limits(timeout_s, memory_mb)
        program_launch = Launch(bwrap, os.path.join(tmp, "program"), memory_mb * 2**20)
        harness_launch = Launch(bwrap, os.path.join(tmp, "harness"), memory_mb * 2**20)
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
