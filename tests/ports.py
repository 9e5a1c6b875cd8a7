"""Ports for the tests' own launches (torchrun's --master_port, bare ranks' MASTER_PORT, the
reward servers'). A port found free by binding port 0 comes from the kernel's ephemeral range,
where every outgoing connection (gloo opens many) also takes its port: one could take it
between the pick and the launch's own bind (seen: EADDRINUSE under two pytest-xdist workers).
So the pick comes from below that range, from a slice of its own for each xdist worker."""

import os
import random
import socket
from pathlib import Path

LOWEST = 10000


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def worker_slice() -> range:
    """The ports this pytest process picks from: its xdist worker's share of [LOWEST, ephemeral start)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", "gw0"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    span = (ephemeral_start() - LOWEST) // max(count, 1)
    return range(LOWEST + index * span, LOWEST + (index + 1) * span)


def free_port() -> int:
    """A port of this worker's slice that no socket holds now."""
    ports = worker_slice()
    for _ in range(200):
        port = random.choice(ports)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:  # held
                continue
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1}")
