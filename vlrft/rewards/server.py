"""`vlrft reward-server`: serve any reward recipe (a reward model included) over HTTP.

Flask app served by waitress (a production WSGI server, thread pool of `threads`).
  GET  /health -> {"status": "ok", "recipe": NAME}
  POST /score  {"completions": [str], "samples": [sample]} -> {"scores": [score]}
Samples use the wire format of vlrft.rewards.wire. Before any of a body is read, its headers
are checked (vlrft.rewards.server_http): with a token every request needs `Authorization:
Bearer TOKEN`; without one only loopback Host names are answered; no Origin (no web page) and a
POST only as application/json. Every error is JSON {"error": one line}: 4xx for a request the
server refuses (vlrft.rewards.server_checks), 500 for a recipe that fails (raises, malformed
output, timeout). The recipe runs in worker processes killed at --timeout-s (a code recipe: at
--max-code-seconds), unless marked runs_in_trainer (vlrft.rewards.server_pool). A non-loopback
bind needs a token; a code recipe also needs --allow-code-recipe (docs/reward_recipes.md,
"Remote rewards").
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import traceback

from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

from vlrft.errors import ConfigError
from vlrft.isolation.sandbox import allow_unisolated, runs_code
from vlrft.rewards.guard import RecipeFailure, call_recipe, runs_in_trainer
from vlrft.rewards.loading import resolve_recipe
from vlrft.rewards.server_checks import (Limits, Rejected, ServerOptions, check_body_length, check_headers,
                                         check_request, check_start, loggable, parse_json)
from vlrft.rewards.server_pool import RecipePool
from vlrft.rewards.wire import PixelLimitError, WireError, check_samples, decode_checked

# One body parsed at a time: json's C parser holds the GIL, so parsing two at once is no faster,
# and each parse may build up to ~50 bytes of objects per body byte before they are counted.
_ONE_PARSE = threading.Lock()


def make_app(recipe: str, kwargs: dict, timeout_s: float, limits: Limits = Limits(),
             pool: RecipePool | None = None) -> Flask:
    """The Flask app; the header checks (token, Host, Origin, Content-Type) ran before it, in
    vlrft.rewards.server_http. The recipe runs in `pool`'s worker processes; without a pool (a
    recipe marked runs_in_trainer) in a thread, with `timeout_s`."""
    fn = resolve_recipe(recipe)
    app = Flask("vlrft-reward-server")

    @app.get("/health")
    def health():
        return jsonify(status="ok", recipe=recipe)

    @app.post("/score")
    def score():
        check_body_length(request.content_length, limits)
        raw = request.stream.read(limits.max_body_bytes + 1)  # capped even if the length lied
        check_body_length(len(raw), limits)
        with _ONE_PARSE:
            body = parse_json(raw, limits)
        completions, samples = check_request(body, limits)
        try:
            checked = check_samples(samples, limits.max_image_pixels, limits.max_request_pixels)
            # Decoded in the recipe's worker (its limit bounds the decode), or here for a recipe
            # that runs in a server thread.
            decoded = checked if pool is not None else decode_checked(checked)
        except PixelLimitError as err:
            raise Rejected(413, str(err)) from None
        except WireError as err:
            raise Rejected(422, str(err)) from None
        try:
            if pool is not None:
                scores = pool.score(completions, decoded, kwargs)
            else:
                scores = call_recipe(fn, completions, decoded, kwargs, timeout_s)
        except RecipeFailure as failure:
            return jsonify(error=f"recipe '{recipe}' failed: {failure}"), 500
        return jsonify(scores=[_plain(s) for s in scores])

    # Every answer is JSON, never an HTML error page: the client quotes the "error" line.
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
        if response.status_code >= 400:  # one line per refused request: an operator sees probes
            error = (response.get_json(silent=True) or {}).get("error", "")
            _log(f"{response.status_code} {loggable(request.method, 20)} {loggable(request.path)} "
                 f"from {request.remote_addr}: {loggable(error, 300)}")
        return response

    return app


def _log(line: str) -> None:
    print(f"vlrft reward server: {line}", file=sys.stderr, flush=True)


def _plain(score):
    """numpy scalars and tuples -> JSON types."""
    if isinstance(score, dict):
        return {k: float(v) for k, v in score.items()}
    if isinstance(score, (list, tuple)):
        return [float(v) for v in score]
    return None if score is None else float(score)


def serve(recipe: str, kwargs: dict, options: ServerOptions = ServerOptions()) -> None:
    from waitress.adjustments import Adjustments
    from waitress.server import MultiSocketServer
    from waitress.task import ThreadedTaskDispatcher

    from vlrft.rewards.server_http import GuardedServer

    fn = resolve_recipe(recipe)
    check_start(options.host, options.token, recipe, fn, options.allow_code_recipe, options.unsafe_no_isolation)
    allow_unisolated(options.unsafe_no_isolation)
    pool = None
    if not runs_in_trainer(fn):  # the trainer's rule (vlrft.rewards.guard)
        code = runs_code(fn)
        pool = RecipePool(recipe, options.threads, options.max_code_seconds if code else options.timeout_s, code)
    app = make_app(recipe, kwargs, options.timeout_s, options.limits, pool)
    adj = Adjustments(
        host=options.host, port=options.port, threads=options.threads, backlog=options.backlog,
        ident="vlrft-reward-server", asyncore_use_poll=True,  # select() cannot watch descriptors past 1023
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
                                   max_connections=options.max_connections, read_timeout_s=options.read_timeout_s)
                     for info in adj.listen]
    except OSError as err:
        where = f"{options.host}:{options.port}"
        raise ConfigError(f"reward server cannot listen on {where} ({err.strerror or err})") from None
    auth = "token required" if options.token else "no token"
    print(f"vlrft reward server: recipe '{recipe}' on http://{options.host}:{options.port} "
          f"({options.threads} threads, {auth})", flush=True)
    MultiSocketServer(sockets, adj, [(s.effective_host, s.effective_port) for s in listeners], dispatcher,
                      listeners[0].log_info).run()
