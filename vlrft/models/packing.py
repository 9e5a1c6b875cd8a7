"""Packing: a micro-batch's sequences concatenated into one row, isolated from each other by a
block-diagonal causal attention mask (sdpa) or by the varlen kernel's sample starts (flash-
attention), with per-sample position ids (3-D M-RoPE for Qwen-VL).

No padding is processed; a sample's pixel inputs travel with it in sample order. `micro_batches`
is the one way the experience pass, the update and the critic cut their samples into micro-batches.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vlrft.distributed import all_reduce_max_int
from vlrft.models.attention import block_causal_mask, uses_varlen, varlen_kwargs
from vlrft.models.collate import concat_mm_inputs, rollout_of, sequence_length
from vlrft.types import Experience, MicroBatch, Prompt, Rollout


def split_by_token_budget(samples: list, micro_batch_tokens: int) -> list[list]:
    """First-fit decreasing: samples longest first, each into the first group with room for it
    (a lone longer sample forms its own group). Fewer, fuller groups than a consecutive split
    when lengths are skewed; each group keeps its samples in their input order."""
    lengths = [sequence_length(s) for s in samples]
    groups: list[list[int]] = []
    room: list[int] = []  # tokens left in each group
    for i in sorted(range(len(samples)), key=lambda i: -lengths[i]):
        fits = next((g for g, free in enumerate(room) if lengths[i] <= free), None)
        if fits is None:
            groups.append([i])
            room.append(micro_batch_tokens - lengths[i])
        else:
            groups[fits].append(i)
            room[fits] -= lengths[i]
    return [[samples[i] for i in sorted(group)] for group in groups]


def empty_response(prompt: Prompt) -> Experience:
    """An experience that runs the model on `prompt` with an empty response and adds nothing:
    no response tokens, out of the loss and its denominators, never scored or logged."""
    rollout = Rollout(prompt=prompt, group_id=-1, response_ids=[], response_text="", truncated=False)
    empty = torch.zeros(0)
    return Experience(
        rollout, 0.0, {}, old_logprobs=empty, ref_logprobs=empty, advantages=empty, values=empty, returns=empty,
        entropy=empty, correction=empty, in_loss=False,
    )


def dummy_sample(samples: list) -> Experience:
    """What a micro-batch that only evens out the count runs: an empty response on the first
    token of the shortest prompt, images and videos dropped (the vision tower still runs on
    every rank: models/vision_calls.py)."""
    prompt = min((rollout_of(s).prompt for s in samples), key=lambda p: len(p.prompt_ids))
    prompt = replace(prompt, prompt_ids=prompt.prompt_ids[:1], mm_token_types=prompt.mm_token_types[:1], mm_inputs={},
                     images=[])
    return empty_response(prompt)


def micro_batches(samples: list, micro_batch_tokens: int, placeholder=None) -> list[MicroBatch]:
    """The one micro-batch path of the experience pass, the update and the critic: this rank's
    samples split by the token budget and packed, then as many micro-batches on every rank (a
    collective): ZeRO-3 gathers parameters inside each forward and ZeRO-2 reduces gradients
    inside each backward, so a rank with fewer micro-batches than its peers would hang them. A
    rank short of the count adds dummy micro-batches (`dummy_sample`; run, never counted).
    `placeholder` (a sample) makes the dummy when this rank has no samples. [] when no rank has
    any sample."""
    batches = [pack(group) for group in split_by_token_budget(samples, micro_batch_tokens)]
    count = all_reduce_max_int(len(batches))
    if len(batches) == count:
        return batches
    pool = samples or ([placeholder] if placeholder is not None else [])
    if not pool:
        raise ValueError("a rank without samples needs a placeholder to join its peers' micro-batches")
    return batches + [pack([dummy_sample(pool)], dummy=True) for _ in range(count - len(batches))]


def pack(samples: list, dummy: bool = False) -> MicroBatch:
    rollouts = [rollout_of(s) for s in samples]
    lengths = [len(r.prompt.prompt_ids) + len(r.response_ids) for r in rollouts]
    input_ids = torch.tensor([t for r in rollouts for t in r.prompt.prompt_ids + r.response_ids])[None]  # [1, T]
    response_mask = torch.tensor(
        [flag for r in rollouts for flag in [0] * len(r.prompt.prompt_ids) + [1] * len(r.response_ids)]
    )[None]  # [1, T]
    mm_inputs = concat_mm_inputs([r.mm_inputs() for r in rollouts])
    types = [r.mm_token_types() for r in rollouts]
    if any(types):
        mm_inputs["mm_token_type_ids"] = torch.tensor([t for kinds, length in zip(types, lengths) for t in kinds or [0] * length])[None]  # [1, T]
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=None,  # built per attention implementation by forward_inputs
        response_mask=response_mask,
        mm_inputs=mm_inputs,
        samples=list(samples),
        dummy=dummy,
        seq_lengths=lengths,
    )


def position_ids(backbone: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """Each packed sample's own positions: [1, T] restarting at 0, or for models with a rope
    index (Qwen-VL's M-RoPE) that model's [3, 1, T] ids, sample by sample: the prompt's from
    the model's own function (once per prompt, shared by its responses), then the response,
    all text, continuing from the prompt's largest id + 1 on all three axes, as the function
    numbers text after the last image. A multi-turn response holding observation images is
    numbered by the function over the whole sequence instead."""
    rope_index = getattr(backbone, "get_rope_index", None)
    if rope_index is None:
        return torch.cat([torch.arange(length) for length in batch.seq_lengths])[None]
    parts = []
    for sample in batch.samples:
        rollout = rollout_of(sample)
        if rollout.observation_images:
            parts.append(rope_positions(rope_index, rollout.prompt.prompt_ids + rollout.response_ids,
                                        rollout.mm_token_types(), rollout.mm_inputs(), rollout.rope_positions))
            continue
        prompt = prompt_positions(rope_index, rollout.prompt)  # [3, 1, P]
        start = int(prompt.max()) + 1 if prompt.numel() else 0
        response = torch.arange(start, start + len(rollout.response_ids)).expand(3, 1, -1)  # [3, 1, R]
        parts += [prompt, response]
    return torch.cat(parts, dim=-1)  # [3, 1, T]


def prompt_positions(rope_index, prompt: Prompt) -> torch.Tensor:
    """The prompt's M-RoPE ids by `rope_index`, [3, 1, P], cached on the prompt."""
    return rope_positions(rope_index, prompt.prompt_ids, prompt.mm_token_types, prompt.mm_inputs, prompt.rope_positions)


def rope_positions(rope_index, ids: list[int], types: list[int], mm_inputs: dict, cache: dict) -> torch.Tensor:
    """M-RoPE ids of a token sequence with its pixel inputs by `rope_index`, [3, 1, N], kept
    in `cache` under the function's name."""
    key = getattr(rope_index, "__qualname__", repr(rope_index))
    if key not in cache:
        ids = torch.tensor(ids)[None]  # [1, N]
        video = {k: mm_inputs[k] for k in ("video_grid_thw", "second_per_grid_ts") if k in mm_inputs}
        cache[key], _ = rope_index(
            ids,
            image_grid_thw=mm_inputs.get("image_grid_thw"),
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=torch.tensor(types or [0] * ids.shape[1])[None],  # [1, N]
            **video,
        )
    return cache[key]


def forward_inputs(backbone: torch.nn.Module, batch: MicroBatch) -> dict:
    """The model's keyword inputs, on the model's device. Packed batches add their per-sample
    position ids and what keeps samples apart: a block-diagonal mask (sdpa) or the sample
    starts (flash varlen)."""
    device = next(backbone.parameters()).device
    inputs = batch.model_inputs()
    if batch.seq_lengths is not None:
        inputs["position_ids"] = position_ids(backbone, batch)
        if uses_varlen(backbone):
            del inputs["attention_mask"]
            inputs |= varlen_kwargs(batch.seq_lengths)
        else:
            inputs["attention_mask"] = block_causal_mask(batch.seq_lengths, device)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}  # lengths stay ints
