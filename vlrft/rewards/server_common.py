"""What vlrft's servers (`vlrft reward-server`, `vlrft teacher-server`) share: a request body
read within its limits and parsed, every answer JSON with one line per error, and waitress
listening with the header checks, the deadlines and the connection cap of server_http.

Imports Flask; waitress only inside `listen` (both are the rewards extra).
"""

from __future__ import annotations

import functools
import math
import threading
import traceback

from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

from vlrft.errors import ConfigError
from vlrft.rewards.server_checks import (ListenOptions, Limits, Rejected, check_body_length, check_headers, log,
                                         loggable, parse_json)

# One body parsed at a time: json's C parser holds the GIL, so parsing two at once is no faster,
# and each parse may build up to ~50 bytes of objects per body byte before they are counted.
_ONE_PARSE = threading.Lock()


def read_json_body(limits: Limits):
    """The request's body, parsed: at most --max-body-mb read (even if Content-Length lied),
    UTF-8 JSON within the depth and value limits (server_checks.parse_json), else Rejected."""
    check_body_length(request.content_length, limits)
    raw = request.stream.read(limits.max_body_bytes + 1)
    check_body_length(len(raw), limits)
    with _ONE_PARSE:
        return parse_json(raw, limits)


def answer_in_json(app: Flask, name: str) -> None:
    """Every answer of `app` JSON, never an HTML error page (clients quote the "error" line):
    a Rejected as its 4xx, an HTTP error as its code, a bug as 500 with its traceback on the
    server's stderr; and one log line per refused request, so that an operator sees probes."""

    @app.errorhandler(Rejected)
    def rejected(err: Rejected):
        return jsonify(error=str(err)), err.status

    @app.errorhandler(HTTPException)
    def http_error(err: HTTPException):
        return jsonify(error=f"{err.code} {err.name}: {err.description}"), err.code

    @app.errorhandler(Exception)
    def internal_error(err: Exception):  # a bug: its traceback for the operator, one line for the client
        traceback.print_exc()
        return jsonify(error=f"internal server error ({type(err).__name__})"), 500

    @app.after_request
    def log_refusal(response):
        if response.status_code >= 400:
            error = (response.get_json(silent=True) or {}).get("error", "")
            log(name, f"{response.status_code} {loggable(request.method, 20)} {loggable(request.path)} "
                      f"from {request.remote_addr}: {loggable(error, 300)}")
        return response


def listen(app: Flask, options: ListenOptions, name: str):
    """waitress's server for `app` on options.host:port, with server_http's checks (its
    `run()` serves until `close()`); `name` ("reward server") starts its log lines. ConfigError
    when it cannot listen there."""
    from waitress.adjustments import Adjustments
    from waitress.server import MultiSocketServer
    from waitress.task import ThreadedTaskDispatcher

    from vlrft.rewards.server_http import GuardedServer

    adj = Adjustments(
        host=options.host, port=options.port, threads=options.threads, backlog=options.backlog,
        ident=f"vlrft-{name.replace(' ', '-')}", asyncore_use_poll=True,  # select() cannot watch descriptors past 1023
        cleanup_interval=1, channel_timeout=max(1, math.ceil(options.read_timeout_s)),  # idle connections
        max_request_header_size=16 * 1024,  # our clients send a few hundred bytes
        # A body up to twice the limit is read (past 512 KiB into a temporary file, not memory)
        # so the app's JSON 413 reaches a client still sending; a longer one waitress cuts off
        # at once (also JSON, but a client still sending may see a reset).
        max_request_body_size=2 * options.limits.max_body_bytes + 1,
    )
    dispatcher = ThreadedTaskDispatcher()
    dispatcher.set_thread_count(adj.threads)
    sockets: dict = {}
    check = functools.partial(check_headers, token=options.token)
    try:
        # As waitress.create_server, with waitress's TCP server extended (server_http.py).
        listeners = [GuardedServer(app, sockets, dispatcher=dispatcher, adj=adj, sockinfo=info, check=check,
                                   max_connections=options.max_connections, read_timeout_s=options.read_timeout_s,
                                   name=name)
                     for info in adj.listen]
    except OSError as err:
        dispatcher.shutdown()
        raise ConfigError(f"{name} cannot listen on {options.host}:{options.port} ({err.strerror or err})") from None
    return MultiSocketServer(sockets, adj, [(s.effective_host, s.effective_port) for s in listeners], dispatcher,
                             listeners[0].log_info)
