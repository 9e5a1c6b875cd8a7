"""HF `generate` rollout engine: the CPU default, with its own inference copy of the weights."""

from __future__ import annotations

from typing import Iterable

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from vlrft.distributed import device
from vlrft.engines.base import SamplingParams, make_rollout
from vlrft.models.collate import concat_mm_inputs, mm_token_type_ids
from vlrft.models.attention import decoder_autocast
from vlrft.models.loader import load_model
from vlrft.types import Prompt, Rollout


class SampledTokenLogprobs(LogitsProcessor):
    """The last logits processor: records the log-probability of each sampled token under the
    distribution it was sampled from (after suppression, temperature and top-p). Called at step
    t, it sees the token sampled at step t - 1 (input_ids' last column) and scores it with the
    distribution kept from that step, so only one [B, V] distribution is held at a time."""

    def __init__(self):
        self.previous: torch.Tensor | None = None  # [B, V] log-softmax of the last step's scores
        self.logprobs: list[torch.Tensor] = []  # per step, [B]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._record(input_ids[:, -1])
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _record(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.logprobs.append(self.previous.gather(-1, tokens[:, None]).squeeze(-1))

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[B, new tokens] logprobs, once generate returned `sequences` (the last step's token)."""
        self._record(sequences[:, -1])
        self.previous = None
        return torch.stack(self.logprobs, dim=1) if self.logprobs else sequences.new_zeros((sequences.shape[0], 0), dtype=torch.float32)


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
        # the sampling distribution that the trainer's logprobs assume. Temperature and top-p
        # are not set here: `_processors` applies them, before recording the logprobs.
        return GenerationConfig(
            do_sample=not params.greedy,
            top_k=0 if not params.greedy else None,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            suppress_tokens=self.banned_ids or None,
        )

    @staticmethod
    def _processors(params: SamplingParams) -> tuple[LogitsProcessorList, SampledTokenLogprobs]:
        """Temperature and top-p, then the recorder. transformers would run its own temperature
        and top-p warpers after every processor a caller passes, so they are ours here."""
        recorder = SampledTokenLogprobs()
        warpers = []
        if not params.greedy and params.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(params.temperature))
        if not params.greedy and params.top_p < 1.0:
            warpers.append(TopPLogitsWarper(params.top_p))
        return LogitsProcessorList([*warpers, recorder]), recorder

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
        processors, recorder = self._processors(params)
        with decoder_autocast(self.model):
            out = self.model.generate(
                input_ids=input_ids.to(here),
                attention_mask=attention_mask.to(here),
                generation_config=self._generation_config(params),
                logits_processor=processors,
                **{k: v.to(here) for k, v in mm.items()},
            )  # [B, P + new]
        logprobs = recorder.finish(out).cpu()  # [B, new] the sampling distribution's logprob of each token
        return [
            make_rollout(p, out[row, width:].tolist(), self.tokenizer, self.stop_ids, logprobs[row].tolist())
            for row, p in enumerate(prompts)
        ]

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
