"""The rollout-engine protocol shared by every engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from vlrft.registry import Registry
from vlrft.types import Prompt, Rollout

ENGINES = Registry("rollout engine")


@dataclass
class SamplingParams:
    n: int  # responses per prompt
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    greedy: bool = False  # evaluation: argmax decoding, temperature/top_p ignored


class RolloutEngine(Protocol):
    """An inference copy of the policy: it generates, and receives weights after each update."""

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Rollout]:
        """n responses per prompt, grouped by prompt (group_id = prompt.index), in prompt order."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) tensors by their HF parameter names."""


@ENGINES.register("hf")
def _make_hf_engine(**kwargs) -> RolloutEngine:
    from vlrft.engines.hf_engine import HFEngine

    return HFEngine(**kwargs)
