"""`vlrft teacher-server`'s flags and their translation into TeacherOptions. Imports neither
Flask nor torch, so `vlrft --help` stays quick and works without the rewards extra."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from vlrft.errors import ConfigError
from vlrft.rewards.server_checks import ListenOptions
from vlrft.rewards.server_cli import add_listen_guards, listen_options

TOKEN_ENV = "VLRFT_TEACHER_TOKEN"
PORT = 8001


@dataclass(frozen=True)
class TeacherOptions:
    """`vlrft teacher-server`'s options; the defaults are its flags' defaults."""

    model: str
    compute_dtype: str = "float32"
    attention: str = "auto"
    micro_batch_tokens: int = 4096  # tokens per forward, and the longest sequence (prompt + response)
    max_tokens: int = 65536  # tokens per request: each sample's prompt and response (the most the forwards hold)
    listen: ListenOptions = field(default_factory=lambda: ListenOptions(port=PORT))

    def __post_init__(self):
        for name in ("micro_batch_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"teacher server: --{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


_DEFAULTS = TeacherOptions(model="")


def add_teacher_server_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", required=True, help="the teacher: an HF checkpoint directory or a hub id")
    add("--compute-dtype", default=_DEFAULTS.compute_dtype, choices=("float32", "bfloat16"),
        help="the forward's precision and the weights' dtype (bfloat16 halves a GPU's share)")
    add("--attention", default=_DEFAULTS.attention, help="as model.attention: auto, sdpa, sdpa_segments, "
                                                         "flash_attention_2, torch_varlen")
    add("--micro-batch-tokens", type=int, default=_DEFAULTS.micro_batch_tokens,
        help="tokens per forward (the activations' memory), and the most of one prompt and its response")
    add("--max-tokens", type=int, default=_DEFAULTS.max_tokens,
        help="most tokens per request: each sample's prompt and response, summed (the most its forwards hold)")
    add_listen_guards(parser, PORT, TOKEN_ENV, "samples")


def teacher_server_options(args: argparse.Namespace) -> TeacherOptions:
    return TeacherOptions(
        model=args.model, compute_dtype=args.compute_dtype, attention=args.attention,
        micro_batch_tokens=args.micro_batch_tokens, max_tokens=args.max_tokens,
        listen=listen_options(args, TOKEN_ENV, "teacher server"),
    )
