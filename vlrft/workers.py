"""Worker processes: calls that a timeout really ends.

A `Worker` is a long-lived child process that serves calls one at a time over a socket. A call
names a module-level function (pickled by reference: the worker imports its module) and
picklable arguments; the result comes back pickled. A call still running at its timeout kills
the worker and everything it started, and the next call starts a fresh one; a pure-Python loop,
a C computation holding the GIL or a sleep end alike. The caller never waits on a dead worker: a
closed socket is a failure naming the exit status.

The child is a fresh interpreter (`python -c`), not a fork of the trainer: the trainer's
threads, torch and CUDA state are not inherited, and the child imports only this module and what
its calls need. Or it is forked from a zygote (vlrft.worker_zygote), itself such an interpreter
that has already imported what the calls need: a start of milliseconds, and the memory the
zygote's imports take is shared. Workers stop when their owner is garbage-collected and at
interpreter exit (weakref.finalize), and a worker whose parent died without stopping it kills
itself within a second.
"""

from __future__ import annotations

import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from vlrft.worker_zygote import Zygote

# A worker's start: the interpreter, then `prepare` (importing the callable: a user file's top
# level, a recipe's packages). Not part of a call's timeout, so a recipe whose import takes
# longer than its timeout still runs; the limit only catches an import that never ends.
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 2.0  # at exit an idle worker reads EOF and is gone in milliseconds; a busy one is killed
_PARENT_POLL_S = 1.0
_HEADER_BYTES = 8  # each message is its length, then its pickle
# Runs as `python -c`: the parent's sys.path, so the worker imports what the parent would; then
# the entry (module, function) of its class, given its socket and its parent's pid.
_BOOTSTRAP = "import sys; sys.path[:] = sys.argv[3:]; from {} import {} as entry; entry(int(sys.argv[1]), int(sys.argv[2]))"

_killed = 0
_killed_lock = threading.Lock()


class CallFailed(RuntimeError):
    """A worker call that did not return; the message is one line saying why."""


class CallTimedOut(CallFailed):
    """A call (or a worker's start) outlived its limit; the worker was killed. `capped`: the
    limit was the caller's cap (the step's budget), shorter than the timeout."""

    def __init__(self, message: str, capped: bool):
        super().__init__(message)
        self.capped = capped


def killed_calls() -> int:
    """Calls killed with their worker at their timeout, in this process since it started."""
    return _killed


def uncapped(seconds: float) -> tuple[float, bool]:
    return seconds, False


def one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {one_line(str(err))}"


def raised_text(err: BaseException) -> str:
    return f"raised {error_text(err)}"


class Worker:
    """One child process serving calls one at a time (a lock keeps it so: at most one call in
    flight). `prepare` = (fn, args) runs once after each start (importing what the calls will
    use), under START_TIMEOUT_S instead of a call's timeout. With a `zygote`
    (vlrft.worker_zygote.Zygote) each start is a fork of it, which ran its own `prepare`."""

    entry = ("vlrft.workers", "serve")  # what the fresh interpreter runs

    def __init__(self, prepare: tuple[Callable, tuple] | None = None, zygote: Zygote | None = None):
        self.prepare, self.zygote = prepare, zygote
        self.generation = 0  # processes started so far: each kill is followed by a new one
        self.pid: int | None = None  # of the process started last
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._process is not None

    def call(self, fn: Callable, args: tuple, timeout_s: float, cap: Callable = uncapped) -> Any:
        """fn(*args) in the worker (started first if none is running); its result, or CallFailed
        (CallTimedOut when it ran past `timeout_s`: the worker was killed). `cap(seconds)` ->
        (limit, capped) may shorten each limit (the step's budget)."""
        with self._lock:
            if self._process is None:
                self._start(cap)
            return self._exchange((fn, args), timeout_s, cap, f"timed out after {timeout_s:g}s")

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """End the process (told to by closing its socket; killed, with what it started, when
        still running after `grace_s`) and reap it; its exit status, None if none was running."""
        finalizer, process, sock = self._finalizer, self._process, self._socket
        self._process = self._socket = self._finalizer = None
        if finalizer is None or finalizer.detach() is None:  # none started, or stopped at exit
            return None
        return _stop_process(process, sock, os.getpid(), grace_s)

    def _start(self, cap: Callable) -> None:
        process, parent_end = self.zygote.fork(cap) if self.zygote is not None else _spawn(self.entry)
        self._process, self._socket, self.pid = process, parent_end, process.pid
        self._finalizer = weakref.finalize(self, _stop_process, process, parent_end, os.getpid(), STOP_GRACE_S)
        self.generation += 1
        if self.prepare is not None:
            self._exchange(self.prepare, START_TIMEOUT_S, cap, f"its worker process did not start within {START_TIMEOUT_S:g}s")

    def _exchange(self, request: tuple, timeout_s: float, cap: Callable, timeout_text: str) -> Any:
        limit, capped = cap(timeout_s)
        if limit <= 0:  # nothing sent: the worker stays as it is
            raise CallTimedOut(timeout_text, capped)
        deadline = time.monotonic() + limit
        try:
            data = pickle.dumps(request)
        except Exception as err:  # noqa: BLE001 - pickling raises many types
            raise CallFailed(f"could not be sent to its worker process ({error_text(err)})") from None
        try:
            _send(self._socket, data, deadline)
            reply = _receive(self._socket, deadline)
        except TimeoutError:  # before OSError: a subclass of it
            self.stop(grace_s=0)
            global _killed
            with _killed_lock:
                _killed += 1
            raise CallTimedOut(timeout_text, capped) from None
        except (EOFError, OSError):
            status = self.stop(grace_s=1.0)
            raise CallFailed(f"its worker process died ({exit_text(status)})") from None
        except BaseException:  # interrupted mid-call (KeyboardInterrupt): its reply would come out of step
            self.stop(grace_s=0)
            raise
        try:
            returned, value = pickle.loads(reply)
        except Exception as err:  # noqa: BLE001 - unpickling raises many types
            raise CallFailed(f"returned a result the trainer cannot load ({error_text(err)})") from None
        if not returned:
            raise CallFailed(value)
        return value


def _spawn(entry: tuple[str, str]) -> tuple[subprocess.Popen, socket.socket]:
    """A fresh interpreter running `entry` (module, function); it and our end of its socket."""
    parent_end, child_end = socket.socketpair()
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP.format(*entry), str(child_end.fileno()), str(os.getpid()), *map(str, sys.path)],
            pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: a kill reaches what it started
        )
    except OSError as err:
        parent_end.close()
        raise CallFailed(f"its worker process could not start ({one_line(str(err))})") from None
    finally:
        child_end.close()
    return process, parent_end


def limit_data_memory(limit: int) -> None:
    """Lower this process's RLIMIT_DATA (heap and private mappings) to `limit` bytes: a worker's
    `prepare` for calls on a stranger's file (a decoder, an unpickler), which then fail their
    allocation (MemoryError) past it instead of making the kernel end the trainer."""
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def exit_text(status: int | None) -> str:
    if status is None:
        return "exit status unknown"
    if status < 0:
        return f"killed by {signal.Signals(-status).name}" if -status in signal.valid_signals() else f"signal {-status}"
    return f"exit code {status}"


def _stop_process(process: Any, sock: socket.socket, owner: int, grace_s: float) -> int | None:
    """`process`: a subprocess.Popen, or what a zygote forked (its pid and wait, alike)."""
    if os.getpid() != owner:  # a forked copy of the owner: the worker is not its to stop
        return None
    sock.close()  # an idle worker reads EOF and exits
    if grace_s > 0:
        try:
            return process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    kill_trees([process.pid])
    try:
        return process.wait(5.0)  # SIGKILL is immediate unless the kernel holds it (a stuck mount)
    except subprocess.TimeoutExpired:
        return None  # reaped later: by subprocess, or by its zygote


def kill_trees(pids: list[int]) -> None:
    """SIGKILL each worker's process group and every descendant (one that started its own
    session, as the code sandbox does, is outside the group). The descendants are found
    first: once the worker is dead they are re-parented and out of sight."""
    doomed = _descendants(pids)
    for kill, target in [*((os.killpg, pid) for pid in pids), *((os.kill, d) for d in doomed)]:
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _descendants(pids: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs: the process group is all a kill reaches
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent = int(f.read().rpartition(b")")[2].split()[1])  # the name in () may hold spaces
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(pids)
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


# ---- the wire: a length, then a pickle; each read and write bounded by the call's deadline

def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _send(sock: socket.socket, data: bytes, deadline: float | None) -> None:
    for part in (len(data).to_bytes(_HEADER_BYTES, "little"), data):
        sock.settimeout(_left(deadline))
        sock.sendall(part)


def _receive(sock: socket.socket, deadline: float | None) -> bytearray:
    size = int.from_bytes(_read(sock, _HEADER_BYTES, deadline), "little")
    return _read(sock, size, deadline)


def _read(sock: socket.socket, size: int, deadline: float | None) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        sock.settimeout(_left(deadline))
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError
        got += n
    return buffer


# ---- the worker's side

def serve(fd: int, parent: int) -> None:
    """The worker's loop: answer each request with (True, result) or (False, one line) until the
    parent closes its end."""
    sock = socket.socket(fileno=fd)
    if sys.stdout is not None:  # what a call printed is not lost in a buffer when it is killed
        sys.stdout.reconfigure(line_buffering=True)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="vlrft-worker-watch").start()
    while True:
        try:
            request = _receive(sock, None)
        except (EOFError, OSError):
            return
        try:
            _send(sock, _answer(request), None)
        except OSError:
            return


def _answer(request: bytes) -> bytes:
    try:
        fn, args = pickle.loads(request)
        reply = (True, fn(*args))
    except BaseException as err:  # noqa: BLE001 - anything the call raises (SystemExit too) is its failure
        reply = (False, raised_text(err))
    try:
        return pickle.dumps(reply)
    except Exception as err:  # noqa: BLE001 - pickling raises many types
        return pickle.dumps((False, f"returned {type(reply[1]).__name__}, which cannot be sent back from its worker process "
                                    f"({error_text(err)})"))


def _exit_with_parent(parent: int) -> None:
    """A worker outliving its parent (killed before it could stop the worker) would run a hung
    call forever: once re-parented, it kills its process group, itself included."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os.killpg(0, signal.SIGKILL)
