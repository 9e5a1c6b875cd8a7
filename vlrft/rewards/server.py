"""`vlrft reward-server`: serve any reward recipe (a reward model included) over HTTP.

Flask app served by waitress (a production WSGI server, thread pool of `threads`).
  GET  /health -> {"status": "ok", "recipe": NAME}
  POST /score  {"completions": [str], "samples": [sample]} -> {"scores": [score]}
Samples use the wire format of vlrft.rewards.wire. Before any of a body is read, its headers
are checked (vlrft.rewards.server_http; what it shares with the teacher server is in
vlrft.rewards.server_common): with a token every request needs `Authorization:
Bearer TOKEN`; without one only loopback Host names are answered; no Origin (no web page) and a
POST only as application/json. Every error is JSON {"error": one line}: 4xx for a request the
server refuses (vlrft.rewards.server_checks), 500 for a recipe that fails (raises, malformed
output, timeout). The recipe runs in worker processes killed at --timeout-s (a code recipe: at
--max-code-seconds), unless marked runs_in_trainer (vlrft.rewards.server_pool). A non-loopback
bind needs a token; a code recipe also needs --allow-code-recipe (docs/reward_recipes.md,
"Remote rewards").
"""

from __future__ import annotations

from flask import Flask, jsonify

from vlrft.isolation.sandbox import allow_unisolated, runs_code
from vlrft.rewards.guard import RecipeFailure, call_recipe, runs_in_trainer
from vlrft.rewards.loading import resolve_recipe
from vlrft.rewards.server_checks import Limits, Rejected, ServerOptions, check_request, check_start
from vlrft.rewards.server_common import answer_in_json, listen, read_json_body
from vlrft.rewards.server_pool import RecipePool
from vlrft.rewards.wire import PixelLimitError, WireError, check_samples, decode_checked

NAME = "reward server"  # how its log lines start


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
        completions, samples = check_request(read_json_body(limits), limits)
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

    answer_in_json(app, NAME)
    return app


def _plain(score):
    """numpy scalars and tuples -> JSON types."""
    if isinstance(score, dict):
        return {k: float(v) for k, v in score.items()}
    if isinstance(score, (list, tuple)):
        return [float(v) for v in score]
    return None if score is None else float(score)


def serve(recipe: str, kwargs: dict, options: ServerOptions = ServerOptions()) -> None:
    fn = resolve_recipe(recipe)
    check_start(options.host, options.token, recipe, fn, options.allow_code_recipe, options.unsafe_no_isolation)
    allow_unisolated(options.unsafe_no_isolation)
    pool = None
    if not runs_in_trainer(fn):  # the trainer's rule (vlrft.rewards.guard)
        code = runs_code(fn)
        pool = RecipePool(recipe, options.threads, options.max_code_seconds if code else options.timeout_s, code)
    server = listen(make_app(recipe, kwargs, options.timeout_s, options.limits, pool), options, NAME)
    auth = "token required" if options.token else "no token"
    print(f"vlrft reward server: recipe '{recipe}' on http://{options.host}:{options.port} "
          f"({options.threads} threads, {auth})", flush=True)
    server.run()
