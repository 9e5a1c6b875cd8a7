"""The `vlrft reward-server` flags that protect it (token, limits, connections) and their
translation into ServerOptions. Here rather than in vlrft/cli.py to keep that file a table of
commands; imports no Flask, so `vlrft --help` works without the rewards extra."""

from __future__ import annotations

import argparse

from vlrft.rewards.server_checks import TOKEN_ENV, Limits, ServerOptions, read_token

_DEFAULTS = Limits()
_OPTIONS = ServerOptions()


def add_reward_server_guards(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--token-file", help=f"file holding the bearer token clients must send (else ${TOKEN_ENV}); "
                             "required for any --host but loopback")
    add("--allow-code-recipe", action="store_true",
        help="serve a recipe that executes completions (code_unit_tests) on a non-loopback --host")
    add("--unsafe-no-isolation", action="store_true",
        help="run a code recipe even where bubblewrap cannot isolate it (in-process guards only: unsafe)")
    add("--max-body-mb", type=float, default=_DEFAULTS.max_body_bytes / 2**20, help="largest request body")
    add("--max-items", type=int, default=_DEFAULTS.max_items, help="most completions per request")
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
    add("--max-code-seconds", type=float, default=_OPTIONS.max_code_seconds,
        help="a code recipe: seconds for all of a request's programs and tests (then killed, 413)")


def reward_server_options(args: argparse.Namespace) -> ServerOptions:
    limits = Limits(
        max_body_bytes=int(args.max_body_mb * 2**20), max_items=args.max_items,
        max_image_pixels=args.max_image_pixels, max_request_pixels=args.max_request_pixels,
        max_json_depth=args.max_json_depth, max_json_values=args.max_json_values,
    )
    return ServerOptions(
        host=args.host, port=args.port, threads=args.threads, timeout_s=args.timeout_s,
        token=read_token(args.token_file), allow_code_recipe=args.allow_code_recipe,
        unsafe_no_isolation=args.unsafe_no_isolation,
        max_connections=args.max_connections, backlog=args.backlog, read_timeout_s=args.read_timeout_s,
        max_code_seconds=args.max_code_seconds, limits=limits,
    )
