"""The rollout-engine protocol shared by every engine."""

from __future__ import annotations

import hashlib
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
    # Base seed of this generate call (the trainer derives it from train.seed, step and sampling
    # round). The vLLM engine seeds each request from it, so the ranks of a TP group sample
    # identically by construction and a resumed run samples what the original run would have.
    # None: the engine's own generator.
    seed: int | None = None


def derived_seed(*parts: int) -> int:
    """A 31-bit seed mixed from integers (distinct inputs give unrelated seeds)."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class RolloutEngine(Protocol):
    """An inference copy of the policy: it generates, and receives weights after each update."""

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Rollout]:
        """n responses per prompt, grouped by prompt (group_id = prompt.index), in prompt order."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) tensors by their HF parameter names."""

    def score(self, rollouts: list[Rollout], temperature: float) -> list[torch.Tensor]:
        """Each response's per-token logprobs ([R_i]) under the weights the engine serves now
        (the weight-sync check compares them with the trainer's). An engine whose
        `scores_images` is False is only given text prompts."""

    def sleep(self) -> None:
        """Release accelerator memory while the trainer updates (no-op where unsupported)."""

    def wake(self) -> None:
        """Take the memory back before the next weight sync and generation."""


def make_rollout(prompt: Prompt, new_ids: list[int], tokenizer, stop_ids: list[int], logprobs=None) -> Rollout:
    """A rollout from generated ids: cut after the first stop id; no stop id = truncated."""
    stop = next((i for i, t in enumerate(new_ids) if t in stop_ids), None)
    response = new_ids if stop is None else new_ids[: stop + 1]
    return Rollout(
        prompt=prompt,
        group_id=prompt.index,
        response_ids=response,
        response_text=tokenizer.decode(response, skip_special_tokens=True),
        truncated=stop is None,
        logprobs=None if logprobs is None else list(logprobs[: len(response)]),
    )


# Factories take (cfg, tokenizer, stop_ids, banned_ids): each engine reads its own config keys.
@ENGINES.register("hf")
def _make_hf_engine(cfg, tokenizer, stop_ids: list[int], banned_ids: list[int]) -> RolloutEngine:
    from vlrft.engines.hf_engine import HFEngine

    return HFEngine(cfg.model.path, tokenizer, stop_ids, banned_ids, compute_dtype=cfg.model.compute_dtype,
                    decode=cfg.rollout.hf_decode)


@ENGINES.register("vllm")
def _make_vllm_engine(cfg, tokenizer, stop_ids: list[int], banned_ids: list[int]) -> RolloutEngine:
    from vlrft.distributed import global_world_size, world_size
    from vlrft.engines.vllm_engine import VLLMEngine

    if world_size() != global_world_size():
        # An async run's rollout rank: vLLM takes the whole job as its world, so it runs in a
        # process whose world is the rollout ranks' engines (engine_process.py). The policy
        # EMA's evaluation puts the last weights sent back afterwards: it keeps them.
        from vlrft.engines.engine_process import EngineProcess

        return EngineProcess("vllm", cfg, tokenizer, stop_ids, banned_ids, keep_weights=cfg.train.ema_beta > 0)

    return VLLMEngine(
        cfg.model.path,
        tokenizer,
        stop_ids,
        banned_ids,
        tp_size=cfg.rollout.engine_tp_size,
        seed=cfg.train.seed,
        max_model_len=cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens(),
        memory_fraction=cfg.rollout.vllm_memory_fraction,
        image_pixels=(cfg.data.min_pixels, cfg.data.max_pixels),
        dtype=cfg.model.compute_dtype,
    )
