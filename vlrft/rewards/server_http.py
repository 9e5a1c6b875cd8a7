"""The connection handling of vlrft's servers (reward, teacher), in waitress's own extension points.

waitress reads each request, headers and body, in its event loop (wasyncore: one thread, any
number of connections) and hands it to its thread pool only once complete. Out of the box it
checks nothing before the body; a connection counts against `connection_limit` from accept to
close, and at the limit waitress stops accepting, so the next client, a token holder too, waits
in the kernel's queue; `channel_timeout` is an idle timeout (any byte resets it), looked at every
`cleanup_interval` seconds. So 32 connections sending a byte now and then held the server for
everyone. None of its options changes that (`recv_bytes` and `inbuf_overflow` only size reads
and buffers), but its classes are made to be extended (channel_class, parser_class, the server
class), so this file extends them rather than trading waitress for another server. Here:

- **Checks before the body** (CheckedParser): once a request's headers are in, the header checks
  (vlrft.rewards.server_checks.check_headers: Origin, Host, token, Content-Type) run; a refused
  request is answered at once, its body read only when small (so its client sees the answer,
  not a reset), and the connection closed.
- **A deadline per request** (GuardedServer.maintenance): its headers and body must arrive within
  `read_timeout_s` of its first byte, however steadily they trickle; an idle connection is
  closed after the same time.
- **A floor on the body's rate** (GuardedServer.maintenance): BODY_GRACE_S after its headers, a
  body must have arrived at MIN_BODY_RATE or faster on average, else it is answered 408 and
  closed: a token holder may use the server's connections, not hold them with a trickle.
- **A cap that sheds** (GuardedServer.handle_accept, shed_order): at `max_connections`, each
  connection accepted closes one: first the one that has waited longest without a request the
  checks let in (a stranger, or an idle keep-alive connection; what it sent is read first),
  else the let-in request whose body, still arriving after BODY_GRACE_S, is slowest (answered
  503, which clients retry). So a token holder gets in however many strangers connect. Only
  when no connection may be shed (each holds a request let in, whole or just begun, or was
  accepted within SHED_GRACE_S) does the server stop accepting, as waitress would.
  Up to ACCEPT_BATCH connections are accepted per turn of the loop, so a flood of connections
  does not keep the kernel's queue full while the loop takes them one at a time.
- waitress's own refusals (a body over twice the limit, a malformed request) are JSON too, and
  what a client sent is logged escaped (server_checks.loggable).

Imported only by vlrft.rewards.server_common.listen (waitress is an extra).
"""

from __future__ import annotations

import json
import select
import time
from functools import partial
from http import HTTPStatus
from typing import Callable

from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import TcpWSGIServer
from waitress.task import ErrorTask
from waitress.utilities import Error, RequestEntityTooLarge

from vlrft.rewards.server_checks import Rejected, log, loggable

# A connection accepted (or answered) less than this ago is not shed: its request may be on its
# way. Short, because a client sends its request as it connects, and what a connection has sent
# is read before it is shed (make_room); the accept rate under a flood is max_connections / this
# (with 0.5 s, 1000 reopening strangers held a token holder 3.3 s; with 0.1 s, 0.7 s).
SHED_GRACE_S = 0.1
# A refused request's body up to this size is read (and dropped) before the answer, so that its
# client, still sending, reads the answer rather than a connection reset. A larger one is not read.
DRAIN_BYTES = 64 * 1024
# The floor on a body's rate: BODY_GRACE_S after its headers, received >= MIN_BODY_RATE * (the
# seconds since, less the grace). Far below any network a reward server is called over (16 MiB
# in --read-timeout-s, 30 s, is 550 KB/s already), far above a trickle that holds a connection.
BODY_GRACE_S = 2.0
MIN_BODY_RATE = 32 * 1024  # bytes per second
ACCEPT_BATCH = 64  # connections accepted per turn of the event loop, at most


class Refused(Error):
    """A request the server refused before it was whole (the header checks, a slow body, a full
    server), as waitress's error type."""

    def __init__(self, rejected: Rejected):
        super().__init__(str(rejected))
        self.code, self.reason = rejected.status, HTTPStatus(rejected.status).phrase


class JsonErrorTask(ErrorTask):
    """waitress's answer to a request it (or this file) refused, as JSON {"error": line}."""

    def execute(self):
        err, request = self.request.error, self.request
        if isinstance(err, Refused):
            message = err.body
            self.channel.server.note(f"{err.code} {loggable(request.command or '?', 20)} {loggable(request.path or '?')} "
                f"from {self.channel.addr[0]}: {loggable(message, 300)}")
        else:
            if isinstance(err, RequestEntityTooLarge):
                cap = self.channel.server.adj.max_request_body_size - 1
                message = f"request body is over twice the limit of {cap // 2} bytes (--max-body-mb)"
            else:
                message = f"{err.reason}: {err.body}"
            self.channel.server.note(f"{err.code} (refused by waitress) from {self.channel.addr[0]}: {loggable(message, 300)}")
        body = json.dumps({"error": message}).encode()
        self.status = f"{err.code} {err.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class CheckedParser(HTTPRequestParser):
    """waitress's request parser, running `check(method, headers)` once the headers are in."""

    def __init__(self, adj, check: Callable[[str, dict], None]):
        super().__init__(adj)
        self.check = check
        self.let_in = False  # the headers passed the checks
        self.refusal: Rejected | None = None
        self.body_started: float | None = None  # when the headers were in and a body was to follow

    def received(self, data: bytes) -> int:
        had_headers = self.headers_finished
        consumed = super().received(data)
        if self.headers_finished and not had_headers and self.error is None:
            try:
                self.check(self.command, self.headers)
                self.let_in = True
            except Rejected as refusal:
                self.refusal = refusal
                self.expect_continue = False  # no "100 Continue": the body is not wanted
                if not self.completed and (self.chunked or self.content_length > DRAIN_BYTES):
                    self.completed = True
                    consumed = len(data)  # the rest is body, not a next request
            if not self.completed:
                self.body_started = time.time()
        if self.refusal is not None and self.completed:
            self.error = Refused(self.refusal)
        return consumed

    def body_rate(self, now: float) -> tuple[float, float] | None:
        """(seconds since the body began, bytes per second so far) while a body is arriving."""
        if self.body_started is None or self.completed:
            return None
        elapsed = max(now - self.body_started, 1e-6)
        return elapsed, self.body_bytes_received / elapsed


def body_too_slow(received: int, elapsed: float) -> bool:
    """A body past its grace that has arrived slower than MIN_BODY_RATE on average."""
    return elapsed > BODY_GRACE_S and received < MIN_BODY_RATE * (elapsed - BODY_GRACE_S)


class GuardedChannel(HTTPChannel):
    """One connection: its requests parsed with the server's header checks, and the times the
    server's deadline and cap look at."""

    error_task_class = JsonErrorTask

    def __init__(self, server, sock, addr, adj, map=None):
        super().__init__(server, sock, addr, adj, map)
        self.parser_class = partial(CheckedParser, check=server.check)
        self.waiting_since = self.creation_time  # since the connection opened or last answered
        self.request_started = self.creation_time  # first byte of the request being read

    def received(self, data):
        if self.request is None and data:
            self.request_started = time.time()
        return super().received(data)

    def service(self):  # in a worker thread
        super().service()
        if not self.requests:
            self.waiting_since = time.time()

    def holds_request_let_in(self) -> bool:
        return any(r is not None and r.let_in for r in (*self.requests, self.request))

    def arriving_body(self, now: float) -> tuple[float, float] | None:
        """body_rate of the request being read, if its body is arriving and nothing is queued."""
        if self.request is None or self.requests or self.will_close:
            return None
        return self.request.body_rate(now)

    def cut_short(self, rejected: Rejected) -> None:
        """Answer the request being read with `rejected` (or the refusal of its headers, if they
        were refused), JSON, then close the connection, as though the request had arrived whole.
        In the event loop's thread, as received() is."""
        with self.requests_lock:
            request = self.request
            if request is None or self.will_close or self.close_when_flushed:
                return
            self.request, request.error, request.completed = None, Refused(request.refusal or rejected), True
            self.requests.append(request)
            if len(self.requests) == 1:
                self.server.add_task(self)  # while it is queued, readable() reads nothing more


def sheddable(channel: GuardedChannel, now: float) -> bool:
    """Whether a connection may be closed to make room: it has no request let in and has waited
    SHED_GRACE_S or more, or its let-in request's body is still arriving after BODY_GRACE_S."""
    if channel.will_close:
        return False
    if not channel.holds_request_let_in():
        return now - channel.waiting_since >= SHED_GRACE_S
    arriving = channel.arriving_body(now)
    return arriving is not None and arriving[0] >= BODY_GRACE_S


def shed_order(channels: list[GuardedChannel], now: float) -> list[GuardedChannel]:
    """The sheddable connections in the order to close them: those with no request let in,
    waiting longest first; then the let-in uploads, slowest first."""
    def key(channel):
        arriving = channel.arriving_body(now) if channel.holds_request_let_in() else None
        return (0, channel.waiting_since) if arriving is None else (1, arriving[1])
    return sorted((c for c in channels if sheddable(c, now)), key=key)


def has_input(sock) -> bool:
    """Whether a socket has something to read (a request's bytes, a connection to accept) now."""
    poller = select.poll()  # not select.select: it cannot watch descriptors past 1023
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


class GuardedServer(TcpWSGIServer):
    """waitress's TCP server with the deadline, the floor and the shedding cap (module docstring)."""

    channel_class = GuardedChannel

    def __init__(self, *args, check: Callable[..., None], max_connections: int,
                 read_timeout_s: float, name: str, **kwargs):
        # Set before waitress's __init__, which starts listening: the loop may ask for them at once.
        self.check_headers, self.max_connections, self.read_timeout_s = check, max_connections, read_timeout_s
        self.name = name  # "reward server": how its log lines start
        self.shed_quietly = 0  # connections shed since the last log line
        super().__init__(*args, **kwargs)

    def note(self, line: str) -> None:  # (not `log`: wasyncore's dispatcher has one)
        log(self.name, line)

    def check(self, method: str, headers: dict) -> None:
        self.check_headers(method, headers, port=int(self.effective_port))

    def open_channels(self) -> list[GuardedChannel]:
        """Every listener's connections, less those closing (closed on the loop's next turn)."""
        return [c for c in self._map.values() if isinstance(c, GuardedChannel) and not c.will_close]

    def readable(self) -> bool:
        """Whether to accept now (asked on every turn of the event loop): there is room, or a
        connection to shed for it."""
        now = time.time()
        if now >= self.next_channel_cleanup:
            self.next_channel_cleanup = now + self.adj.cleanup_interval
            self.maintenance(now)
        if not self.accepting:
            return False
        channels = self.open_channels()
        return len(channels) < self.max_connections or any(sheddable(c, now) for c in channels)

    def handle_accept(self):
        """Accept the connections waiting, up to ACCEPT_BATCH, each past the cap closing one."""
        for _ in range(ACCEPT_BATCH):
            if not (has_input(self.socket) and self.make_room(time.time())):
                return
            super().handle_accept()

    def make_room(self, now: float) -> bool:
        """Whether there is room for one more connection, after shedding one if need be."""
        channels = self.open_channels()
        if len(channels) < self.max_connections:
            return True
        for channel in shed_order(channels, now):
            if channel.readable() and has_input(channel.socket):  # sent, not read yet: the loop
                channel.handle_read()  # reads after it accepts, and not at all while a parse holds the GIL
            if not channel.connected:  # its client closed it: room made
                return True
            if sheddable(channel, now):  # still, with what it sent read
                self.shed(channel, now)
                return True
        return False

    def shed(self, channel: GuardedChannel, now: float) -> None:
        if not channel.holds_request_let_in():
            channel.will_close = True
            self.shed_quietly += 1  # counted, logged once a second (maintenance): a flood is many
            return
        elapsed, rate = channel.arriving_body(now)
        channel.cut_short(Rejected(503, f"the server is at --max-connections {self.max_connections} and this "
                                        f"request's body was still arriving after {elapsed:.1f}s ({_rate(rate)}): the "
                                        "slowest upload makes room; retry"))

    def maintenance(self, now: float) -> None:
        super().maintenance(now)  # idle connections: channel_timeout
        if self.shed_quietly:
            self.note(f"closed {self.shed_quietly} connection(s) that sent no request let in for {SHED_GRACE_S:g}s or "
                f"more: the server is at --max-connections {self.max_connections}")
            self.shed_quietly = 0
        for channel in list(self.active_channels.values()):
            if channel.request is None or channel.requests or channel.will_close:
                continue
            if now - channel.request_started > self.read_timeout_s:
                channel.will_close = True
                self.note(f"closed a connection from {channel.addr[0]}: its request did not arrive in full within "
                    f"{self.read_timeout_s:g}s (--read-timeout-s)")
                continue
            arriving = channel.arriving_body(now)
            if arriving is not None and body_too_slow(channel.request.body_bytes_received, arriving[0]):
                channel.cut_short(Rejected(408, f"request body arrived at {_rate(arriving[1])}, under the floor of "
                                                f"{_rate(MIN_BODY_RATE)} (after the first {BODY_GRACE_S:g}s): "
                                                "send it faster"))


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1024:.0f} KiB/s" if bytes_per_s >= 1024 else f"{bytes_per_s:.0f} bytes/s"
