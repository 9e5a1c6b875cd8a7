"""A zygote: one fresh worker interpreter that has run `prepare` (imported an environment's module,
PIL, ...) and forks a worker process from itself for each `Worker(zygote=...)` start. A fork
starts in about a millisecond where a fresh interpreter takes about 85 ms of CPU, and shares the
memory of the zygote's imports copy-on-write (gc.freeze() after `prepare`: the workers' garbage
collections do not write to those pages).

A forked worker is what vlrft.workers starts otherwise, less the interpreter's start: it serves
calls over a socket of its own (`workers.serve`), and a call past its timeout kills it with what
it started (`workers.kill_trees`): it is a process group of its own, set by the zygote before
the worker's pid is given out. The zygote is started as any worker is (a fresh interpreter:
nothing of the trainer's threads, torch or CUDA state), so a worker forked from it inherits
nothing of the trainer either. The zygote ends when its owner closes its socket or dies (it
waits on the owner's pidfd) and kills its workers' trees then; a worker whose zygote died
otherwise kills itself within a second, as any worker whose parent died.

Why not multiprocessing's "forkserver": its children re-import the parent's `__main__` (for
`vlrft train`, vlrft.cli and with it torch: 2.2 s and torch in every environment worker,
measured), its server is one per process, preloading modules by name only (an environment named
`file.py:Class` is not a module), and it brings a resource-tracker process. What it does beyond
that is small enough to do here with the standard library: the worker's socket travels to the
zygote with socket.send_fds; the zygote reaps a worker when its owner asks for its exit status
(the owner, not its parent, cannot wait for it), so an exited worker's pid is not reused before
its owner is done killing it. A worker costs its owner one file descriptor, its socket, as a
worker started afresh does, and the zygote none.
"""

from __future__ import annotations

import gc
import os
import select
import socket
import subprocess
import sys
import time
from typing import Callable

from vlrft.workers import (START_TIMEOUT_S, CallFailed, CallTimedOut, Worker, _answer, _read, _receive, _send, exit_text,
                           kill_trees, serve)

_WORD = 8  # requests: a letter and a word (b"f" and 0, its socket attached; b"w" and a pid); answers: a word
_RUNNING, _UNKNOWN = 1 << 40, 1 << 41  # answers to b"w" that are no exit status
_WAIT_POLL_S = 0.005


class Forked:
    """A worker a zygote forked, to its Worker what a subprocess.Popen is: its pid, and `wait`
    for its exit status, which its zygote reads (the worker is the zygote's child, not ours)."""

    def __init__(self, pid: int, zygote: "Zygote"):
        self.pid, self.zygote = pid, zygote
        self.returncode: int | None = None

    def wait(self, timeout: float) -> int | None:
        """Its exit status once it has exited (None: unknown, its zygote is gone); TimeoutExpired
        when it is still running after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.returncode is None:
            status = self.zygote.exit_status(self.pid)
            if status != _RUNNING:
                self.returncode = None if status == _UNKNOWN else status
                return self.returncode
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker process {self.pid}", timeout)
            time.sleep(_WAIT_POLL_S)
        return self.returncode


class Zygote(Worker):
    """The process that `Worker(zygote=...)` processes are forked from: started (and `prepare`
    run, under START_TIMEOUT_S) at the first `fork`, started again at the next one after it
    died or failed to prepare. Its requests after `prepare` are `fork` and `exit_status`
    (never `call`)."""

    entry = ("vlrft.worker_zygote", "serve_zygote")

    def __init__(self, prepare: tuple[Callable, tuple]):
        super().__init__(prepare)

    def fork(self, cap: Callable) -> tuple[Forked, socket.socket]:
        """A new worker process: its handle and our end of its socket. `cap` as in Worker.call."""
        with self._lock:
            if self._process is not None and self._process.poll() is not None:  # killed: start a fresh one
                self.stop(grace_s=0)
            if self._process is None:
                self._start(cap)
            ours, theirs = socket.socketpair()
            try:
                pid = self._request_fork(theirs.fileno(), cap)
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            return Forked(pid, self), ours

    def exit_status(self, pid: int) -> int:
        """Worker `pid`'s exit status, reaped by the zygote now, or _RUNNING; _UNKNOWN when the
        zygote is gone (its workers with it) or has reaped it before."""
        with self._lock:
            if self._socket is None:
                return _UNKNOWN
            try:
                deadline = time.monotonic() + START_TIMEOUT_S  # the answer comes at once: the zygote waits on nothing
                self._socket.settimeout(START_TIMEOUT_S)
                self._socket.sendall(b"w" + pid.to_bytes(_WORD, "little"))
                return int.from_bytes(_read(self._socket, _WORD, deadline), "little", signed=True)
            except (EOFError, OSError):
                self.stop(grace_s=1.0)
                return _UNKNOWN

    def _start(self, cap: Callable) -> None:
        try:
            super()._start(cap)
        except CallFailed:  # `prepare` raised: a fresh zygote tries again at the next fork
            self.stop(grace_s=0)
            raise

    def _request_fork(self, call_fd: int, cap: Callable) -> int:
        limit, capped = cap(START_TIMEOUT_S)
        timeout_text = f"its worker process did not start within {START_TIMEOUT_S:g}s"
        if limit <= 0:  # nothing sent: the zygote stays as it is
            raise CallTimedOut(timeout_text, capped)
        try:
            self._socket.settimeout(limit)
            socket.send_fds(self._socket, [b"f" + bytes(_WORD)], [call_fd])
            return int.from_bytes(_read(self._socket, _WORD, time.monotonic() + limit), "little", signed=True)
        except TimeoutError:  # before OSError: a subclass of it
            self.stop(grace_s=0)
            raise CallTimedOut(timeout_text, capped) from None
        except (EOFError, OSError):
            status = self.stop(grace_s=1.0)
            raise CallFailed(f"its worker process could not start (the process it is forked from died: {exit_text(status)})") from None
        except BaseException:  # interrupted: its answer would come out of step
            self.stop(grace_s=0)
            raise


# ---- the zygote's side

def serve_zygote(fd: int, parent: int) -> None:
    """Answer `prepare` (an ordinary call), then the requests. Returns in the zygote when it is
    done; in a forked worker, serves that worker's calls."""
    control = socket.socket(fileno=fd)
    try:
        _send(control, _answer(_receive(control, None)), None)
    except (EOFError, OSError):
        return
    gc.freeze()  # what `prepare` built is shared with every worker, never collected there
    workers: set[int] = set()  # the pids of its workers not reaped
    forked = _answer_requests(control, parent, workers)
    if forked is not None:
        serve(*forked)
    else:  # its owner is done with it, or dead: its workers end with it, whatever they are running
        kill_trees(sorted(workers))


def _answer_requests(control: socket.socket, parent: int, workers: set[int]) -> tuple[int, int] | None:
    """Answer each request until the parent closes its end or dies: None then. In a forked worker
    it returns: that worker's socket and its parent."""
    try:
        watched = os.pidfd_open(parent)
    except ProcessLookupError:
        return None
    if os.getppid() != parent:  # it died before it was watched
        return None
    poller = select.poll()
    for fd in (control.fileno(), watched):
        poller.register(fd, select.POLLIN)
    while True:
        if any(fd == watched for fd, _ in poller.poll()):
            return None
        try:
            request, fds, _, _ = socket.recv_fds(control, 1 + _WORD, 1)
            if request and len(request) < 1 + _WORD:  # a stream: the rest follows
                request += _read(control, 1 + _WORD - len(request), None)
        except (EOFError, OSError):
            return None
        if not request:
            return None
        if request[:1] == b"w":
            answer = _exit_status(int.from_bytes(request[1:], "little"), workers)
        else:
            zygote = os.getpid()
            for stream in (sys.stdout, sys.stderr):  # what was printed is not printed again by each worker
                if stream is not None:
                    stream.flush()
            answer = os.fork()
            if answer == 0:
                control.close()
                os.close(watched)
                os.setpgid(0, 0)
                _reseed_numpy()
                return fds[0], zygote
            os.close(fds[0])
            try:
                os.setpgid(answer, answer)  # here too: the group exists before its pid is given out, whoever runs first
            except OSError:  # it already exited (and ran setpgid itself)
                pass
            workers.add(answer)
        try:
            control.sendall(answer.to_bytes(_WORD, "little", signed=True))
        except OSError:
            return None


def _exit_status(pid: int, workers: set[int]) -> int:
    """Reaped only when its owner asks: until then an exited worker is a zombie, and its pid (its
    process group's id) is nobody else's when the owner kills it."""
    if pid not in workers:
        return _UNKNOWN
    reaped, status = os.waitpid(pid, os.WNOHANG)
    if reaped == 0:
        return _RUNNING
    workers.discard(pid)
    return os.waitstatus_to_exitcode(status)


def _reseed_numpy() -> None:
    """Python's `random` reseeds itself in a forked child; numpy's global generator does not, and
    every worker would draw the numbers of the others, where fresh interpreters draw their own."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
