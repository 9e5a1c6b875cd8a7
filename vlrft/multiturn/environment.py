"""Environments for multi-turn rollouts: the protocol, finding one by name, and checking what
a step returned. They run in a worker process (multiturn/host.py), where a timeout ends a hung call.

An environment answers the policy's turns. One instance serves one trajectory:

    class MyEnv:
        def __init__(self, **environment_args): ...
        def reset(self, sample: dict) -> None: ...        # the row (same keys a reward recipe sees)
        def step(self, action: str) -> Step | tuple: ... # (observation text, reward, done)

`Step.images` shows the policy images with the observation (vision-language models, HF engine).
An environment class whose observations are text only says so with a class attribute
`shows_images = False` (read from the class, or a factory function, before any instance
exists): a vision-language policy then never runs its vision tower for observations it cannot
get (on text data, not at all); an image it shows anyway fails that trajectory's turn.

The row's prompt is the first observation. A name resolves, in order, to a built-in short name
(BUILTIN_ENVIRONMENTS), an entry point in the group `vlrft.environments`, or
"package.module:Class" / "path/to/file.py:Class" (any callable returning an environment).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable, Protocol

from PIL import Image

from vlrft.errors import ConfigError
from vlrft.registry import load_callable

ENTRY_POINT_GROUP = "vlrft.environments"
BUILTIN_ENVIRONMENTS = {"tools": "vlrft.multiturn.tools:ToolEnvironment"}


@dataclass
class Step:
    """An environment's answer to one turn."""

    observation: str  # shown to the policy as the next user/tool turn ("" with done: nothing)
    reward: float = 0.0  # this turn's reward; recipes see each turn's and their sum
    done: bool = False  # the trajectory ends after this turn
    images: list = field(default_factory=list)  # PIL images (or image paths) shown before the text


class Environment(Protocol):
    def reset(self, sample: dict) -> None: ...

    def step(self, action: str) -> Step | tuple: ...


class EnvironmentFailure(RuntimeError):
    """One failed environment call; the message is one line saying why."""


def plugin_environments() -> dict:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


@functools.lru_cache(maxsize=None)
def resolve_environment(name: str) -> Callable[..., Environment]:
    """The factory a config names (`rollout.environment`); one line naming the problem else."""
    if name in BUILTIN_ENVIRONMENTS:
        return load_callable(BUILTIN_ENVIRONMENTS[name])
    plugins = plugin_environments()
    if name in plugins:
        try:
            return plugins[name].load()
        except Exception as err:  # noqa: BLE001 - a broken plugin is named, whatever it raised
            raise ConfigError(f"environment plugin '{name}' ({plugins[name].value}) failed to load: {err}") from None
    if ":" not in name:
        available = ", ".join(sorted(set(BUILTIN_ENVIRONMENTS) | set(plugins)))
        raise ConfigError(f"unknown environment '{name}'; available: {available}; or give 'package.module:Class' / 'file.py:Class'")
    try:
        return load_callable(name)
    except ValueError as err:
        raise ConfigError(f"environment {err}") from None


def shows_images(name: str) -> bool:
    """Whether environment `name` (`rollout.environment`; "" for none) may show images: unless
    its factory says `shows_images = False`."""
    return bool(name) and getattr(resolve_environment(name), "shows_images", True) is not False


def as_step(answer: Any) -> Step:
    """A Step from what `step` returned (a Step or an (observation, reward, done) tuple)."""
    if isinstance(answer, tuple) and len(answer) == 3:
        answer = Step(*answer)
    if not isinstance(answer, Step):
        raise EnvironmentFailure(f"step returned {type(answer).__name__}, not a Step or (observation, reward, done)")
    if not isinstance(answer.observation, str):
        raise EnvironmentFailure(f"step's observation is {type(answer.observation).__name__}, not text")
    try:
        reward = float(answer.reward)
    except (TypeError, ValueError):
        raise EnvironmentFailure(f"step's reward {answer.reward!r} is not a number") from None
    if not math.isfinite(reward):
        raise EnvironmentFailure(f"step's reward {reward} is not finite")
    images = answer.images
    if not isinstance(images, (list, tuple)) or not all(isinstance(i, (Image.Image, str)) for i in images):
        raise EnvironmentFailure("step's images are not a list of PIL images or image paths")
    return Step(as_text(answer.observation), reward, bool(answer.done), list(images))


def as_text(observation: str) -> str:
    """The observation with what UTF-8 cannot hold replaced by U+FFFD: a tool that echoes
    a call's JSON can pass on a lone surrogate (`"\\ud800"` decodes to one), which the tokenizer
    and the trajectory files refuse."""
    return observation.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
