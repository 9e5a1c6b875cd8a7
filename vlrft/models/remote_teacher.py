"""A remote teacher (`teacher.url`): a `vlrft teacher-server` scores the student's tokens, so the
ranks that train never hold the teacher's weights.

At start every rank that trains asks the server's GET /health: unreachable, or a teacher that
cannot score the student (another tokenizer vocabulary, too few token ids, no vision tower for
a vision-language student), is one line naming the URL. Each step a rank sends its own
rollouts (vlrft.models.teacher_wire: each prompt once, as many samples a request as the
server's limits allow) and gets each response token's logprob and argmax flag, as the local
teacher's pass gives them. Requests follow the reward client's rules
(vlrft.rewards.retrying_call): a timeout each (`teacher.timeout_s`), `teacher.retries`
retries of what may pass, all of a step within `teacher.deadline_s`; then one line.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer

from vlrft.errors import ConfigError, VlrftError
from vlrft.models.teacher_server_cli import TOKEN_ENV
from vlrft.models.teacher_wire import RequestLimits, logprob_requests, vocab_digest
from vlrft.rewards.retrying_call import RetryingCall, bearer_headers
from vlrft.rewards.server_checks import read_token
from vlrft.types import Rollout

ANSWER_BYTES_PER_TOKEN = 64  # a /logprobs answer's bound: this per response token sent, plus ANSWER_SLACK_BYTES
ANSWER_SLACK_BYTES = 1 << 20
BACKOFF_S = 0.5  # the first retry's wait (then doubled, jittered: retrying_call.backoff_delay)


class RemoteTeacherError(VlrftError, RuntimeError):
    """The teacher server could not score a step's tokens; one line naming the URL."""


@dataclass(frozen=True)
class RemoteSettings:
    url: str  # teacher.url
    token: str | None  # teacher.token_file's line, else $VLRFT_TEACHER_TOKEN
    timeout_s: float
    retries: int
    deadline_s: float
    min_pixels: int  # data.min_pixels, data.max_pixels: how the student's processor sized its images
    max_pixels: int

    @classmethod
    def of(cls, cfg) -> "RemoteSettings":
        t = cfg.teacher
        return cls(t.url.rstrip("/"), read_token(t.token_file or None, TOKEN_ENV, "teacher"), t.timeout_s,
                   t.retries, t.deadline_s, cfg.data.min_pixels, cfg.data.max_pixels)

    def call(self, parse) -> RetryingCall:
        return RetryingCall(bearer_headers(self.token), self.timeout_s, self.retries, BACKOFF_S,
                            time.monotonic() + self.deadline_s, "teacher.url", RemoteTeacherError, parse)


class RemoteTeacher:
    """The client of one teacher server (`connect` builds it)."""

    def __init__(self, settings: RemoteSettings, limits: RequestLimits):
        self.settings, self.limits = settings, limits

    def score(self, rollouts: list[Rollout], temperature: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per rollout: [R] the teacher's logprob of each response token at `temperature`, and
        [R] 1.0 where the token is the teacher's most likely (float32, on the CPU)."""
        s = self.settings
        video = next((r for r in rollouts if "pixel_values_videos" in r.mm_inputs()), None)
        if video is not None:
            raise RemoteTeacherError(f"teacher.url {s.url}: row id {video.prompt.id!r} has a video, and a remote "
                                     "teacher takes images only (teacher.path runs one that takes videos)")
        logprobs = [torch.zeros(0) for _ in rollouts]
        argmax = [torch.zeros(0) for _ in rollouts]
        call = s.call(_answer)
        for body, indices in logprob_requests(rollouts, temperature, s.min_pixels, s.max_pixels, self.limits):
            lengths = [len(rollouts[i].response_ids) for i in indices]
            answer = call.request(s.url + "/logprobs", body, ANSWER_BYTES_PER_TOKEN * sum(lengths) + ANSWER_SLACK_BYTES)
            if [len(row) for row in answer["logprobs"]] != lengths or [len(row) for row in answer["argmax"]] != lengths:
                raise RemoteTeacherError(f"teacher.url {s.url}/logprobs: the answer's rows do not match the "
                                         f"{len(indices)} responses sent (one value per response token)")
            for i, row, hits in zip(indices, answer["logprobs"], answer["argmax"]):
                logprobs[i] = torch.tensor(row, dtype=torch.float32)
                argmax[i] = torch.tensor(hits, dtype=torch.float32)
        return logprobs, argmax


def connect(cfg) -> RemoteTeacher:
    """The remote teacher of `cfg` once its server answered GET /health with a teacher that can
    score `model.path`'s samples: RemoteTeacherError when unreachable, ConfigError when not."""
    settings = RemoteSettings.of(cfg)
    health = settings.call(_health).request(settings.url + "/health")  # (at most 64 KiB)
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens()
    problem = remote_teacher_problem(cfg.model.path, settings.url, health, longest)
    if problem:
        raise ConfigError(problem)
    return RemoteTeacher(settings, RequestLimits(health["max_items"], health["max_tokens"], health["max_body_bytes"],
                                                 health["max_request_pixels"]))


def remote_teacher_problem(student_path: str, url: str, health: dict, longest: int) -> str:
    """Why the teacher `health` describes cannot score `student_path`'s samples of up to
    `longest` tokens ("" when it can): the checks of models/teacher.teacher_problem, from what
    the server reports, and the length of a sequence it takes."""
    if vocab_digest(AutoTokenizer.from_pretrained(student_path).get_vocab()) != health["vocab_sha256"]:
        return (f"teacher.url {url} serves a teacher whose tokenizer vocabulary differs from model.path "
                f"{student_path}'s: the teacher must read the student's token ids as the student does")
    student = AutoConfig.from_pretrained(student_path)
    sampled = student.get_text_config().vocab_size
    if health["vocab_size"] < sampled:
        return (f"teacher.url {url} scores {health['vocab_size']} token ids, fewer than the {sampled} model.path "
                f"{student_path} can sample")
    if hasattr(student, "vision_config") and not health["vision"]:
        return (f"teacher.url {url} serves a teacher with no vision tower, and model.path {student_path} is a "
                "vision-language model: the teacher must see the student's images")
    if longest > health["max_sequence_tokens"]:
        return (f"teacher.url {url} scores sequences of at most {health['max_sequence_tokens']} tokens (its "
                f"--micro-batch-tokens), and this run's reach {longest} (data.max_prompt_tokens + the longest response)")
    return ""


HEALTH_FIELDS = {"vocab_sha256": str, "vocab_size": int, "vision": bool, "max_items": int, "max_tokens": int,
                 "max_sequence_tokens": int, "max_body_bytes": int, "max_request_pixels": int}


def _health(url: str, raw: bytes) -> dict:
    try:
        health = json.loads(raw)
    except ValueError:
        health = None
    if not isinstance(health, dict) or any(type(health.get(k)) is not t for k, t in HEALTH_FIELDS.items()) \
            or any(health[k] < 1 for k in HEALTH_FIELDS if HEALTH_FIELDS[k] is int):
        raise RemoteTeacherError(f"teacher.url {url}: not a vlrft teacher server's health answer "
                                 f"(one with {', '.join(HEALTH_FIELDS)})")
    return health


def _answer(url: str, raw: bytes) -> dict:
    """The answer, once every logprob is a number that stays finite as a float32 and is <= 0 and
    every argmax flag is 0 or 1 (anything else, a huge int or a deeply nested one included, is
    one line)."""
    try:
        answer = json.loads(raw)
        rows = [answer.get(k) for k in ("logprobs", "argmax")] if isinstance(answer, dict) else [None]
        valid = all(isinstance(r, list) and all(isinstance(row, list) for row in r) for r in rows) \
            and all(_is_logprob(v) for row in answer["logprobs"] for v in row) \
            and all(type(v) is int and v in (0, 1) for row in answer["argmax"] for v in row)
    except (ValueError, OverflowError, RecursionError):
        valid = False
    if not valid:
        raise RemoteTeacherError(f"teacher.url {url}: the answer is not JSON {{'logprobs': [[finite number <= 0]], "
                                 "'argmax': [[0 or 1]]}")
    return answer


def _is_logprob(v) -> bool:
    if type(v) not in (int, float):
        return False
    as_float32 = float(torch.tensor(float(v), dtype=torch.float32))
    return math.isfinite(as_float32) and as_float32 <= 0
