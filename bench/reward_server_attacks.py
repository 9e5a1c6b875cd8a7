"""What attacks on a `vlrft reward-server` cost its clients: each starts a server on loopback
(a token, default flags otherwise), runs the attack from this process, and prints numbers.

    python bench/reward_server_attacks.py strangers 1000  # a request's first byte, reopened when closed
    python bench/reward_server_attacks.py uploads 140     # token holders' uploads at a byte a second
    python bench/reward_server_attacks.py json dicts      # a 16 MiB body of [{},{},...] (or: nested)

strangers / uploads: a token holder's GET /health every 0.3 s for 25 s; prints the median and
the slowest. json: the server's peak memory (VmHWM) before and after the body. Attacker and
server share the machine, so the attack's own speed is part of what is measured. Nothing here
is asserted: docs/reward_recipes.md ("Remote rewards") keeps the numbers with their command.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
TOKEN = "bench-token-0123456789"


def start_server(workdir: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = Path(workdir, "token")
    token.write_text(TOKEN + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "vlrft.cli", "reward-server", "--recipe", "exact_match",
                             "--port", str(port), "--token-file", str(token)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir,
                            env={**os.environ, "PYTHONPATH": str(HERE)})
    deadline = time.monotonic() + 60
    while health(port) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the reward server did not start")
        time.sleep(0.2)
    return proc, port


def request(port: int, data: bytes, timeout: float = 15.0) -> bytes | None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(data)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            return answer
    except OSError:
        return None


def health(port: int) -> float | None:
    """Seconds a token holder's GET /health took, None when it failed."""
    start = time.monotonic()
    answer = request(port, f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
                           "Connection: close\r\n\r\n".encode())
    return time.monotonic() - start if answer and answer.startswith(b"HTTP/1.1 200") else None


class Flood:
    """`count` connections to a server on loopback `port`, run in a thread until `close`; each is
    opened without waiting for the server to accept it and opened again once the server closed
    it. `opened`: connections opened so far."""

    def __init__(self, port: int, count: int):
        self.port, self.count, self.opened = port, count, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def fill(self, sockets: list[socket.socket]) -> None:
        while len(sockets) < self.count:
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", self.port))
            sockets.append(sock)
            self.opened += 1

    def run(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


class Strangers(Flood):
    """Connections that send one byte of a request line and nothing more."""

    def run(self) -> None:
        sockets: list[socket.socket] = []
        while not self.stop.is_set():
            self.fill(sockets)
            self.stop.wait(0.05)
            alive = []
            for sock in sockets:
                try:
                    sock.send(b"G")
                    alive.append(sock)
                except BlockingIOError:
                    alive.append(sock)
                except OSError:
                    sock.close()
            sockets = alive
        for sock in sockets:
            sock.close()


class Uploads(Flood):
    """A token holder's uploads: valid headers for a 10,000-byte body, then a byte a second."""

    def run(self) -> None:
        head = (f"POST /score HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Content-Type: application/json\r\nContent-Length: 10000\r\n\r\n").encode()
        sockets: list[socket.socket] = []
        sent: set[socket.socket] = set()  # those whose headers went out
        while not self.stop.is_set():
            self.fill(sockets)
            alive = []
            for sock in sockets:
                try:
                    if sock.recv(1, socket.MSG_PEEK) == b"":  # the server closed it
                        raise OSError("closed")
                except BlockingIOError:  # nothing to read: still open
                    pass
                except OSError:
                    sent.discard(sock)
                    sock.close()
                    continue
                try:
                    sock.send(b" " if sock in sent else head)
                    sent.add(sock)
                except OSError:  # it would block, or the server closed it: the next turn's peek tells
                    pass
                alive.append(sock)
            sockets = alive
            self.stop.wait(1.0)
        for sock in sockets:
            sock.close()


def latencies(port: int, attack: type[Flood], count: int, seconds: float = 25.0) -> None:
    flood = attack(port, count)
    time.sleep(2.0)
    taken = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        taken.append(health(port))
        time.sleep(0.3)
    flood.close()
    done = sorted(t for t in taken if t is not None)
    answered = f"median {statistics.median(done):.2f}s, slowest {done[-1]:.2f}s, " if done else ""
    print(f"{attack.__name__.lower()} {count}: a token holder's GET /health x{len(taken)} (15 s timeout): {answered}"
          f"failed {len(taken) - len(done)}")


def json_peak(port: int, pid: int, shape: str) -> None:
    unit = {"dicts": "{}", "nested": "[" * 900 + "]" * 900}[shape]
    size = 16 * 2**20 - 64
    items = ",".join([unit] * ((size - 40) // (len(unit) + 1)))
    body = ('{"completions":[],"samples":[],"x":[' + items + "]}").encode()
    before = vm_hwm(pid)
    answer = request(port, f"POST /score HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
                           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
                           "\r\n".encode() + body, timeout=120) or b"(no answer)"
    grew, status = vm_hwm(pid) - before, answer.split(b"\r\n")[0].decode()
    print(f"json {shape}: {len(body) / 2**20:.0f} MiB body -> {status}; server peak memory "
          f"+{grew / 2**20:.0f} MB = {grew / len(body):.0f} bytes per body byte")


def vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("attack", choices=["strangers", "uploads", "json"])
    parser.add_argument("size", help="connections (strangers, uploads) or the body's shape (json: dicts, nested)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        proc, port = start_server(workdir)
        try:
            if args.attack == "json":
                json_peak(port, proc.pid, args.size)
            else:
                latencies(port, Strangers if args.attack == "strangers" else Uploads, int(args.size))
        finally:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
