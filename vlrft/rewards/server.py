"""`vlrft reward-server`: serve any reward recipe (a reward model included) over HTTP.

Flask app served by waitress (a production WSGI server, thread pool of `threads`).
  GET  /health -> {"status": "ok", "recipe": NAME}
  POST /score  {"completions": [str], "samples": [sample]} -> {"scores": [score]}
Samples use the wire format of vlrft.rewards.wire. A malformed request is a 400, a recipe
that fails (raises, malformed output, timeout) a 500; both carry {"error": one line}.
"""

from __future__ import annotations

from flask import Flask, jsonify, request

from vlrft.errors import ConfigError
from vlrft.rewards.guard import RecipeFailure, call_recipe
from vlrft.rewards.loading import resolve_recipe
from vlrft.rewards.wire import decode_samples


def make_app(recipe: str, kwargs: dict, timeout_s: float) -> Flask:
    fn = resolve_recipe(recipe)
    app = Flask("vlrft-reward-server")

    @app.get("/health")
    def health():
        return jsonify(status="ok", recipe=recipe)

    @app.post("/score")
    def score():
        body = request.get_json(silent=True)
        if not isinstance(body, dict) or not isinstance(body.get("completions"), list) \
                or not isinstance(body.get("samples"), list):
            return jsonify(error="body must be JSON {'completions': [...], 'samples': [...]}"), 400
        completions, samples = body["completions"], body["samples"]
        if len(completions) != len(samples):
            return jsonify(error=f"{len(completions)} completions but {len(samples)} samples"), 400
        try:
            scores = call_recipe(fn, completions, decode_samples(samples), kwargs, timeout_s)
        except RecipeFailure as failure:
            return jsonify(error=f"recipe '{recipe}' failed: {failure}"), 500
        except (KeyError, TypeError, ValueError) as err:
            return jsonify(error=f"bad sample: {err}"), 400
        return jsonify(scores=[_plain(s) for s in scores])

    return app


def _plain(score):
    """numpy scalars and tuples -> JSON types."""
    if isinstance(score, dict):
        return {k: float(v) for k, v in score.items()}
    if isinstance(score, (list, tuple)):
        return [float(v) for v in score]
    return None if score is None else float(score)


def serve(recipe: str, kwargs: dict, host: str, port: int, threads: int, timeout_s: float) -> None:
    from waitress import create_server

    app = make_app(recipe, kwargs, timeout_s)
    try:
        server = create_server(app, host=host, port=port, threads=threads, ident="vlrft-reward-server")
    except OSError as err:
        raise ConfigError(f"reward server cannot listen on {host}:{port} ({err.strerror or err})") from None
    print(f"vlrft reward server: recipe '{recipe}' on http://{host}:{port} ({threads} threads)", flush=True)
    server.run()
