"""Run untrusted Python (model-generated programs) in a limited child process.

Layers, each enough to stop the ordinary cases and together hard to slip past by accident:
- a separate interpreter (`python -I -B`) in a fresh temporary directory with a minimal environment,
  its own session (so a wall-clock timeout kills the whole process group);
- rlimits set by the child itself (memory, CPU seconds, file size, open files, no core dumps);
  the caller runs in threads, so nothing here may use signal.alarm or preexec_fn;
- a network namespace with no usable interface (`unshare -rn`) where the kernel allows one;
- an audit hook (cannot be removed once installed) that refuses network use, process spawning,
  killing other processes, raising rlimits, and writes outside the temporary directory. The
  write guard is best effort (it does not see dir_fd), the rest closes the usual escapes.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

OUTPUT_LIMIT = 64 * 1024  # bytes of stdout / stderr kept
FILE_LIMIT = 16 * 1024 * 1024  # RLIMIT_FSIZE: an endless print loop fails here (EFBIG)
OPEN_FILES = 64

# The child's own setup: limits first, then the hook last, right before the user code runs, so the
# setup itself is never refused. argv: memory bytes, CPU seconds, file size bytes, open files.
_RUNNER = r"""
import os, resource, sys, types
def limit(res, value):
    hard = resource.getrlimit(res)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(res, (value, value))
mem, cpu, fsize, nofile = (int(v) for v in sys.argv[1:5])
for res, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                   (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0)):
    limit(res, value)
with open("main.py", "rb") as f:
    code = compile(f.read(), "main.py", "exec")
main = types.ModuleType("__main__")
main.__file__, sys.argv = "main.py", ["main.py"]
sys.modules["__main__"] = main
def install(root):
    # User code can reach module globals (frames) and patch modules, so what the hook decides on
    # is literal constants (immutable, in its code object) or bound as defaults at creation; the
    # hook itself is reachable only through gc.get_*, refused below.
    def hook(event, args, root=root, real=os.path.realpath, fsdecode=os.fsdecode, sep=os.sep,
             isinstance=isinstance, paths=(str, bytes, os.PathLike),
             writes=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND):
        if event.startswith(("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                             "os.fork", "os.kill", "signal.pthread_kill", "pty.", "ctypes.",
                             "resource.setrlimit", "resource.prlimit", "gc.get_")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        # Raw process / memory access past the events above. ImportError, so libraries with an
        # optional `import ctypes` (numpy) still import.
        if event == "import" and args[0] in {"_posixsubprocess", "_ctypes", "_xxsubinterpreters",
                                             "_testcapi", "_testinternalcapi"}:
            raise ImportError(f"sandbox: import of {args[0]} is not allowed")
        if event == "open":
            targets = args[:1] if isinstance(args[2], int) and args[2] & writes else ()
        elif event in {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                       "os.symlink", "os.truncate", "os.utime", "shutil.rmtree"}:
            targets = args[:2]
        else:
            return
        for path in targets:
            if isinstance(path, paths):  # not a file descriptor or a mode
                path = fsdecode(real(path))
                if path != root and not path.startswith(root + sep):
                    raise PermissionError(f"sandbox: {event} outside the sandbox directory is not allowed")
    sys.addaudithook(hook)
install(os.path.realpath(os.getcwd()))  # last: nothing of the setup above is refused
del limit, install, f, res, value, mem, cpu, fsize, nofile
exec(code, main.__dict__)
"""


@dataclass
class SandboxResult:
    returncode: int  # negative: killed by that signal (SIGKILL on timeout or at the CPU limit)
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@functools.lru_cache(maxsize=None)
def _unshare_prefix() -> tuple[str, ...]:
    """("/usr/bin/unshare", "-rn") when an unprivileged user + network namespace can be made here
    (probed once by running the interpreter in one), else () and the audit hook alone guards."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    try:
        probe = subprocess.run([exe, "-rn", sys.executable, "-I", "-c", "pass"], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ()
    return (exe, "-rn") if probe.returncode == 0 else ()


def network_namespace_available() -> bool:
    return bool(_unshare_prefix())


def _read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def run_python(code: str, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512, *,
               output_limit: int = OUTPUT_LIMIT) -> SandboxResult:
    """Run `code` as a script with `stdin` as its standard input, within `timeout_s` wall-clock
    seconds and `memory_mb` of address space; stdout / stderr are cut to `output_limit` bytes."""
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError(f"run_python: timeout_s and memory_mb must be positive, got {timeout_s}, {memory_mb}")
    with tempfile.TemporaryDirectory(prefix="vlrft-sandbox-", ignore_cleanup_errors=True) as tmp:
        work = os.path.join(tmp, "work")  # the child's cwd; its std streams live beside it, out of reach
        os.mkdir(work)
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        paths = [os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")]
        with open(paths[0], "w", encoding="utf-8") as f:
            f.write(stdin)
        # Streams are files, not pipes: no reader threads, no deadlock on big input, and
        # RLIMIT_FSIZE bounds what a print loop can write.
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": work, "TMPDIR": work,
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        limits = (memory_mb * 2**20, math.ceil(timeout_s) + 1, FILE_LIMIT, OPEN_FILES)
        cmd = [*_unshare_prefix(), sys.executable, "-I", "-B", "-c", _RUNNER, *map(str, limits)]
        timed_out = False
        with open(paths[0], "rb") as fin, open(paths[1], "wb") as fout, open(paths[2], "wb") as ferr:
            proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr, cwd=work, env=env,
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                # Still unreaped, so its pid is still the group id: kill everything it started.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        return SandboxResult(proc.returncode, _read_capped(paths[1], output_limit),
                             _read_capped(paths[2], output_limit), timed_out)
