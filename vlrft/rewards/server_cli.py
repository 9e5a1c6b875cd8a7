"""The flags that protect vlrft's servers (token, limits, connections) and their translation
into options: those `vlrft reward-server` and `vlrft teacher-server` share, and the reward
server's own. Here rather than in vlrft/cli.py to keep that file a table of commands; imports
no Flask, so `vlrft --help` works without the rewards extra."""

from __future__ import annotations

import argparse

from vlrft.rewards.server_checks import TOKEN_ENV, Limits, ListenOptions, ServerOptions, read_token

_DEFAULTS = Limits()
_OPTIONS = ServerOptions()


def add_listen_guards(parser: argparse.ArgumentParser, port: int, token_env: str, items: str) -> None:
    """The flags of both servers: where they listen (`port` by default), the token (`token_env`
    names its variable), the request limits (`items`: what --max-items counts) and the
    connection handling."""
    add = parser.add_argument
    add("--host", default=_OPTIONS.host, help="any address but loopback needs a token")
    add("--port", type=int, default=port)
    add("--threads", type=int, default=_OPTIONS.threads, help="requests served at once")
    add("--token-file", help=f"file holding the bearer token clients must send (else ${token_env}); "
                             "required for any --host but loopback")
    add("--max-body-mb", type=float, default=_DEFAULTS.max_body_bytes / 2**20, help="largest request body")
    add("--max-items", type=int, default=_DEFAULTS.max_items, help=f"most {items} per request")
    add("--max-image-pixels", type=int, default=_DEFAULTS.max_image_pixels, help="largest image (width x height)")
    add("--max-request-pixels", type=int, default=_DEFAULTS.max_request_pixels,
        help="most pixels of all of a request's images together")
    add("--max-json-depth", type=int, default=_DEFAULTS.max_json_depth, help="deepest JSON nesting")
    add("--max-json-values", type=int, default=_DEFAULTS.max_json_values,
        help="most JSON values (numbers, strings, arrays, objects) per request")
    add("--max-connections", type=int, default=_OPTIONS.max_connections,
        help="open connections; past it each new one closes the one waiting longest without a request "
             "let in (else the slowest upload)")
    add("--backlog", type=int, default=_OPTIONS.backlog,
        help="connections the kernel queues until the server accepts them (capped by net.core.somaxconn)")
    add("--read-timeout-s", type=float, default=_OPTIONS.read_timeout_s,
        help="seconds for a request's headers and body to arrive, from its first byte; idle connections close after it")


def listen_options(args: argparse.Namespace, token_env: str, what: str) -> ListenOptions:
    """`add_listen_guards`' flags as ListenOptions; `what` ("teacher server") names the server
    in a token file's error."""
    return ListenOptions(**_listen_fields(args, token_env, what))


def _listen_fields(args: argparse.Namespace, token_env: str, what: str) -> dict:
    limits = Limits(
        max_body_bytes=int(args.max_body_mb * 2**20), max_items=args.max_items,
        max_image_pixels=args.max_image_pixels, max_request_pixels=args.max_request_pixels,
        max_json_depth=args.max_json_depth, max_json_values=args.max_json_values,
    )
    return dict(host=args.host, port=args.port, threads=args.threads, token=read_token(args.token_file, token_env, what),
                max_connections=args.max_connections, backlog=args.backlog, read_timeout_s=args.read_timeout_s,
                limits=limits)


def add_reward_server_guards(parser: argparse.ArgumentParser) -> None:
    add_listen_guards(parser, _OPTIONS.port, TOKEN_ENV, "completions")
    add = parser.add_argument
    add("--allow-code-recipe", action="store_true",
        help="serve a recipe that executes completions (code_unit_tests) on a non-loopback --host")
    add("--unsafe-no-isolation", action="store_true",
        help="run a code recipe even where bubblewrap cannot isolate it (in-process guards only: unsafe)")
    add("--max-code-seconds", type=float, default=_OPTIONS.max_code_seconds,
        help="a code recipe: seconds for all of a request's programs and tests (then killed, 413)")


def reward_server_options(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        **_listen_fields(args, TOKEN_ENV, "reward server"), timeout_s=args.timeout_s,
        allow_code_recipe=args.allow_code_recipe, unsafe_no_isolation=args.unsafe_no_isolation,
        max_code_seconds=args.max_code_seconds,
    )
