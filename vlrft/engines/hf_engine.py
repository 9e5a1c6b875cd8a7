"""HF rollout engine: the CPU default, with its own inference copy of the weights.

It decodes with the HF model and its KV cache like `generate`, with one difference that pays on
RL batches: a response that has stopped leaves the batch (its rows of the cache are dropped),
so the remaining steps compute only the responses still running. `generate` keeps computing
every row until the longest response ends, which on length-skewed batches is most of the work.
That is the `dynamic` decode; `static` (static_decode.py, the CUDA default) keeps every shape
fixed so the step can be compiled and replayed as a CUDA graph. Both sample alike (`_sample`).
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Callable, Iterable, Iterator

import torch
from transformers import TopPLogitsWarper

from vlrft import progress
from vlrft.distributed import device
from vlrft.engines.base import SamplingParams, make_rollout
from vlrft.engines.static_decode import StaticDecoder, cuda_graphs, resolve_decode
from vlrft.engines.weight_digest import tensor_digest
from vlrft.models.collate import concat_mm_inputs, gather_responses, mm_token_type_ids
from vlrft.models.forward import policy_forward
from vlrft.models.packing import pack, prompt_positions
from vlrft.models.attention import decoder_autocast
from vlrft.models.loader import load_model
from vlrft.types import Prompt, Rollout


def kv_cache_name(model) -> str:
    """The name the installed transformers gives the KV cache, as a forward argument and an
    output field: `cache` from 5.24 on (where `past_key_values` warns on every call and goes in
    5.40), `past_key_values` before. Read once from the model's own forward signature."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFEngine:
    def __init__(
        self,
        model_path: str,
        tokenizer,
        stop_ids: list[int],
        banned_ids: list[int],
        max_batch: int = 64,
        compute_dtype: str = "float32",
        decode: str = "auto",
    ):
        # A separate copy on this rank's device: the trainer's (possibly ZeRO-3-sharded) module
        # never serves generation. It holds and decodes in the trainer's compute dtype (an
        # inference copy needs no fp32 master: half the memory under bf16).
        self.model = load_model(model_path, compute_dtype=compute_dtype, weights_dtype=compute_dtype).eval().to(device())
        # The checkpoint's generation_config.json (Qwen2.5 Instruct ships repetition_penalty
        # 1.05, top_k 20) is never read: sampling is exactly what `_sample` does, the
        # distribution the trainer's logprobs assume.
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.banned_ids = banned_ids
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
        self.max_batch = max_batch  # sequences per decoding batch (bounds memory)
        self.rope_index = getattr(self.model.model, "get_rope_index", None)  # Qwen-VL's M-RoPE ids
        # Partial rollouts: called after each decoding step; True when it loaded new weights
        # (by `update_weights`), and the responses in flight go on under them. None: never.
        self.new_weights: Callable[[], bool] | None = None
        self.loads = 0  # update_weights calls that changed a tensor (a frozen actor's version changes none)
        self.cache_name = kv_cache_name(self.model)
        # rollout.hf_decode: `static` compiles its step on CUDA only (CUDA graphs); on CPU
        # inductor's compiled step measured slower than the eager one (docs/engines.md).
        self.decode = resolve_decode(decode, self.model.device)
        on_cuda = self.model.device.type == "cuda"
        self.static = StaticDecoder(self, cuda_graphs() if on_cuda else None) if self.decode == "static" else None

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Rollout]:
        expanded = [p for p in prompts for _ in range(params.n)]
        rollouts = []
        for start in range(0, len(expanded), self.max_batch):
            rollouts += self._generate_batch(expanded[start : start + self.max_batch], params)
            progress.advance()  # (a large evaluation set is many batches: not a stall)
        return rollouts

    def _prompt_positions(self, prompts: list[Prompt], attention_mask: torch.Tensor) -> torch.Tensor:
        """Left-padded prompts' position ids: [B, P], or Qwen-VL's M-RoPE [3, B, P] (the
        prompt's own, as the trainer numbers them); padding gets 0 (it is masked out)."""
        if self.rope_index is None:
            return (attention_mask.cumsum(-1) - 1).clamp(min=0)
        positions = torch.zeros((3, *attention_mask.shape), dtype=torch.long)
        for row, p in enumerate(prompts):
            positions[:, row, attention_mask.shape[1] - len(p.prompt_ids) :] = prompt_positions(self.rope_index, p)[:, 0]
        return positions

    def _sample(self, logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Next tokens [B] and their logprobs [B] under the distribution they are drawn from:
        banned tokens removed, then temperature, then top-p (the order `generate` uses)."""
        scores = logits.float()
        if self.banned_ids:
            scores[:, self.banned_ids] = -float("inf")
        if not params.greedy:
            if params.temperature != 1.0:
                scores = scores / params.temperature
            if params.top_p < 1.0:
                scores = TopPLogitsWarper(params.top_p)(None, scores)
        logprobs = torch.log_softmax(scores, dim=-1)  # [B, V]
        if params.greedy:
            tokens = logprobs.argmax(-1)
        else:
            tokens = torch.multinomial(logprobs.exp(), 1).squeeze(1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(1)

    def _prefill(self, prompts: list[Prompt]):
        """Run the prompts through the model, each distinct one (and its images) once; its cache
        rows are then repeated for its responses (`generate` passes each prompt n times in a
        row). Returns (cache, last logits [B, V], attention mask [B, P], next positions)."""
        distinct = list({id(p): p for p in prompts}.values())
        row_of = {id(p): row for row, p in enumerate(distinct)}
        width = max(len(p.prompt_ids) for p in distinct)
        input_ids = torch.full((len(distinct), width), self.pad_id, dtype=torch.long)  # [U, P] left-padded
        attention_mask = torch.zeros_like(input_ids)
        for row, p in enumerate(distinct):
            input_ids[row, width - len(p.prompt_ids) :] = torch.tensor(p.prompt_ids)
            attention_mask[row, width - len(p.prompt_ids) :] = 1
        positions = self._prompt_positions(distinct, attention_mask)
        mm = concat_mm_inputs([p.mm_inputs for p in distinct]) | mm_token_type_ids([p.mm_token_types for p in distinct], width, left_pad=True)
        here = self.model.device
        expand = torch.tensor([row_of[id(p)] for p in prompts], device=here)  # [B] each response's prompt row
        # Responses continue from the prompt's largest position id (on all three M-RoPE axes).
        start = positions.amax(dim=(0, 2) if positions.dim() == 3 else -1, keepdim=True)  # [U, 1] / [1, U, 1]
        next_position = ((start.expand(3, -1, -1) if positions.dim() == 3 else start).to(here) + 1)[..., expand, :]
        attention_mask = attention_mask.to(here)
        out = self.model(
            input_ids=input_ids.to(here), attention_mask=attention_mask, position_ids=positions.to(here),
            use_cache=True, logits_to_keep=1, **{k: v.to(here) for k, v in mm.items()},
        )
        cache = getattr(out, self.cache_name)
        if len(distinct) < len(prompts):
            cache.batch_select_indices(expand)
        return cache, out.logits[expand, -1], attention_mask[expand], next_position

    def _generate_batch(self, prompts: list[Prompt], params: SamplingParams) -> list[Rollout]:
        if self.static is not None:
            tokens, logprobs = self.static.generate_batch(prompts, params)
        else:
            tokens, logprobs = self._decode_dynamic(prompts, params)
        tokens, logprobs = tokens.tolist(), logprobs.cpu().tolist()
        return [make_rollout(p, tokens[row], self.tokenizer, self.stop_ids, logprobs[row]) for row, p in enumerate(prompts)]

    def _decode_dynamic(self, prompts: list[Prompt], params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled tokens [B, N] (pad after a stop) and their logprobs [B, N]; a stopped
        response leaves the batch and the cache."""
        here = self.model.device
        tokens = torch.full((len(prompts), params.max_new_tokens), self.pad_id, dtype=torch.long, device=here)  # [B, N]
        logprobs = torch.zeros(tokens.shape, device=here)  # [B, N] the sampling distribution's logprob of each token
        stop_ids = torch.tensor(self.stop_ids, device=here)
        running = torch.arange(len(prompts), device=here)  # rows of the batch still decoding
        with decoder_autocast(self.model):
            cache, logits, attention_mask, next_position = self._prefill(prompts)  # [B, V], [B, P]
            for step in range(params.max_new_tokens):
                token, logprob = self._sample(logits, params)
                tokens[running, step], logprobs[running, step] = token, logprob
                going = ~torch.isin(token, stop_ids)
                if step + 1 == params.max_new_tokens or not going.any():
                    break
                if not going.all():  # stopped responses leave the batch and the cache
                    keep = going.nonzero().squeeze(1)
                    cache.batch_select_indices(keep)
                    running, token, attention_mask, next_position = running[keep], token[keep], attention_mask[keep], next_position[..., keep, :]
                loads = self.loads
                if self.new_weights is not None and self.new_weights() and self.loads != loads:
                    # Partial rollouts: the weights changed mid-response. Each running response
                    # goes on under the new weights from a fresh prefill of its prompt and its
                    # tokens so far (the cache held the old weights' keys and values).
                    sofar = [continued(prompts[row], tokens[row, : step + 1].tolist()) for row in running.tolist()]
                    cache, logits, attention_mask, next_position = self._prefill(sofar)
                    continue
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(running), 1))], dim=1)
                out = self.model(
                    input_ids=token[:, None], attention_mask=attention_mask, position_ids=next_position,
                    use_cache=True, **{self.cache_name: cache},
                )
                logits = out.logits[:, -1]
                next_position = next_position + 1
        return tokens, logprobs

    @torch.no_grad()
    def score(self, rollouts: list[Rollout], temperature: float) -> list[torch.Tensor]:
        """Each response's per-token logprobs ([R_i], CPU) under the weights this engine serves,
        by the trainer's own forward on one packed micro-batch (the weight-sync check)."""
        batch = pack(rollouts)
        return gather_responses(batch, policy_forward(self.model, batch, temperature).logp, "cpu")

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Copies of the weights it serves, on the CPU, by the names `update_weights` takes."""
        return ((name, param.detach().to("cpu", copy=True)) for name, param in self.model.named_parameters())

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype it holds its weights in (a sync casts what it is sent to it)."""
        return next(self.model.parameters()).dtype

    def served_digests(self) -> dict[str, int]:
        """The digest (engines/weight_digest.py) of every weight it serves, by name, as held in
        `weight_dtype`."""
        dtype = self.weight_dtype
        return {name: tensor_digest(param, dtype) for name, param in self.model.named_parameters()}

    def expected_digests(self, sent: dict[str, int]) -> dict[str, int]:
        """The trainer's digests by the names it serves them under: its own."""
        return sent

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        changed = False
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight sync: the engine model has no parameter '{name}'")
            params[name].copy_(tensor)
            changed = True
        self.loads += changed

    # The HF engine holds a CPU-sized copy and has nothing worth releasing during training.
    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass


def continued(prompt: Prompt, response_ids: list[int]) -> Prompt:
    """`prompt` followed by a response's first tokens, as one prompt to prefill (text tokens:
    their modality ids are 0 and their M-RoPE positions continue the prompt's)."""
    types = prompt.mm_token_types + [0] * len(response_ids) if prompt.mm_token_types else []
    return replace(prompt, prompt_ids=prompt.prompt_ids + response_ids, mm_token_types=types)

