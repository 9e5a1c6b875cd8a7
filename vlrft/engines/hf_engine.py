"""HF `generate` rollout engine: the CPU default, with its own inference copy of the weights."""

from __future__ import annotations

from typing import Iterable

import torch
from transformers import GenerationConfig

from vlrft.distributed import device
from vlrft.engines.base import SamplingParams, make_rollout
from vlrft.experience.collate import concat_mm_inputs, mm_token_type_ids
from vlrft.models.attention import decoder_autocast
from vlrft.models.loader import load_model
from vlrft.types import Prompt, Rollout


class HFEngine:
    def __init__(
        self,
        model_path: str,
        tokenizer,
        stop_ids: list[int],
        banned_ids: list[int],
        max_batch: int = 64,
        compute_dtype: str = "float32",
    ):
        # A separate copy on this rank's device: the trainer's (possibly ZeRO-3-sharded) module
        # never serves generation. It holds and decodes in the trainer's compute dtype (an
        # inference copy needs no fp32 master: half the memory under bf16).
        self.model = load_model(model_path, compute_dtype=compute_dtype, weights_dtype=compute_dtype).eval().to(device())
        # transformers fills every generation field a call leaves unset from the checkpoint's
        # generation_config.json (Qwen2.5 Instruct ships repetition_penalty 1.05, top_k 20):
        # start from library defaults so only the fields `_generation_config` sets can act.
        self.model.generation_config = GenerationConfig()
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.banned_ids = banned_ids
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
        self.max_batch = max_batch  # sequences per generate call (bounds memory)

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        # Built explicitly so no checkpoint default (top_k=50, repetition penalty, ...) changes
        # the sampling distribution that the trainer's logprobs assume.
        sample = {} if params.greedy else {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        return GenerationConfig(
            do_sample=not params.greedy,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            suppress_tokens=self.banned_ids or None,
            **sample,
        )

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Rollout]:
        expanded = [p for p in prompts for _ in range(params.n)]
        rollouts = []
        for start in range(0, len(expanded), self.max_batch):
            rollouts += self._generate_batch(expanded[start : start + self.max_batch], params)
        return rollouts

    def _generate_batch(self, prompts: list[Prompt], params: SamplingParams) -> list[Rollout]:
        width = max(len(p.prompt_ids) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, P] left-padded
        attention_mask = torch.zeros_like(input_ids)
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p.prompt_ids) :] = torch.tensor(p.prompt_ids)
            attention_mask[row, width - len(p.prompt_ids) :] = 1
        mm = concat_mm_inputs([p.mm_inputs for p in prompts]) | mm_token_type_ids(prompts, width, left_pad=True)
        here = self.model.device
        with decoder_autocast(self.model):
            out = self.model.generate(
                input_ids=input_ids.to(here),
                attention_mask=attention_mask.to(here),
                generation_config=self._generation_config(params),
                **{k: v.to(here) for k, v in mm.items()},
            )  # [B, P + new]
        return [make_rollout(p, out[row, width:].tolist(), self.tokenizer, self.stop_ids) for row, p in enumerate(prompts)]

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight sync: the engine model has no parameter '{name}'")
            params[name].copy_(tensor)

    # The HF engine holds a CPU-sized copy and has nothing worth releasing during training.
    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass
