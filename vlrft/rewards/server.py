"""`vlrft reward-server`: serve any reward recipe (a reward model included) over HTTP.

Flask app served by waitress (a production WSGI server, thread pool of `threads`).
  GET  /health -> {"status": "ok", "recipe": NAME}
  POST /score  {"completions": [str], "samples": [sample]} -> {"scores": [score]}
Samples use the wire format of vlrft.rewards.wire. With a token every request needs
`Authorization: Bearer TOKEN`. Every error is JSON {"error": one line}: 400/401/413/422 for a
request the server refuses (vlrft.rewards.server_checks), 500 for a recipe that fails (raises,
malformed output, timeout). A non-loopback bind needs a token; a code recipe also needs
--allow-code-recipe (docs/reward_recipes.md, "Remote rewards").
"""

from __future__ import annotations

import json
import sys
import traceback

from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

from vlrft.errors import ConfigError
from vlrft.rewards.guard import RecipeFailure, call_recipe
from vlrft.rewards.loading import resolve_recipe
from vlrft.isolation.sandbox import allow_unisolated
from vlrft.rewards.server_checks import (Limits, Rejected, ServerOptions, check_body_length, check_json_text,
                                         check_request, check_start, check_token)
from vlrft.rewards.wire import PixelLimitError, WireError, decode_samples


def make_app(recipe: str, kwargs: dict, timeout_s: float, token: str | None = None,
             limits: Limits = Limits()) -> Flask:
    fn = resolve_recipe(recipe)
    app = Flask("vlrft-reward-server")

    @app.before_request
    def authenticate():
        check_token(request.headers.get("Authorization"), token)

    @app.get("/health")
    def health():
        return jsonify(status="ok", recipe=recipe)

    @app.post("/score")
    def score():
        check_body_length(request.content_length, limits)
        raw = request.stream.read(limits.max_body_bytes + 1)  # capped even if the length lied
        check_body_length(len(raw), limits)
        try:
            body = json.loads(check_json_text(raw, limits))
        except json.JSONDecodeError as err:
            raise Rejected(400, f"request body is not JSON ({err})") from None
        completions, samples = check_request(body, limits)
        try:
            decoded = decode_samples(samples, limits.max_image_pixels, limits.max_request_pixels)
        except PixelLimitError as err:
            raise Rejected(413, str(err)) from None
        except WireError as err:
            raise Rejected(422, str(err)) from None
        try:
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
            _log(f"{response.status_code} {request.method} {request.path} from {request.remote_addr}: {error}")
        return response

    return app


def waitress_body_cap(limits: Limits) -> int:
    return 2 * limits.max_body_bytes + 1


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
    from waitress import create_server
    from waitress.server import BaseWSGIServer

    from vlrft.rewards.server_http import JsonErrorChannel

    check_start(options.host, options.token, recipe, resolve_recipe(recipe), options.allow_code_recipe,
                options.unsafe_no_isolation)
    allow_unisolated(options.unsafe_no_isolation)
    app = make_app(recipe, kwargs, options.timeout_s, options.token, options.limits)
    sockets: dict = {}
    try:
        server = create_server(
            app, map=sockets, host=options.host, port=options.port, threads=options.threads,
            ident="vlrft-reward-server", connection_limit=options.max_connections, backlog=options.backlog,
            # A body up to twice the limit is read (past 512 KiB into a temporary file, not memory)
            # so the app's JSON 413 reaches a client still sending; a longer one waitress cuts off
            # at once (JsonErrorChannel: also JSON, but a client still sending may see a reset).
            max_request_body_size=waitress_body_cap(options.limits),
        )
    except OSError as err:
        where = f"{options.host}:{options.port}"
        raise ConfigError(f"reward server cannot listen on {where} ({err.strerror or err})") from None
    for listener in sockets.values():
        if isinstance(listener, BaseWSGIServer):
            listener.channel_class = JsonErrorChannel
    auth = "token required" if options.token else "no token"
    print(f"vlrft reward server: recipe '{recipe}' on http://{options.host}:{options.port} "
          f"({options.threads} threads, {auth})", flush=True)
    server.run()
