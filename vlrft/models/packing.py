"""Packing: a micro-batch's sequences concatenated into one row of segments, isolated from each
other by a block causal attention mask (sdpa) or by the varlen kernels' segment starts, with
per-sample position ids (3-D M-RoPE for Qwen-VL).

Shared prompts (`train.share_prompts`): the responses of one prompt follow a single copy of it
(prompt, response 1, response 2, ...); each response attends to the prompt and to itself, so its
logprobs, entropies and values, and the gradients, are those of the unshared layout, while the
prompt's tokens and images go through the model once per micro-batch instead of once per
response.

No padding is processed; pixel inputs travel with their segment, in row order. `micro_batches`
is the one way the experience pass, the update and the critic cut their samples into micro-batches.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate

import torch

from vlrft.distributed import all_gather_objects, all_reduce_max_int
from vlrft.models.attention import block_causal_mask, check_shared_prefix_support, uses_varlen, varlen_kwargs
from vlrft.models.collate import concat_mm_inputs, rollout_of
from vlrft.models.sequence_parallel import run_shard
from vlrft.types import Experience, MicroBatch, Prompt, Rollout, Segment


def prompt_key(sample) -> tuple | None:
    """What identifies a sample's prompt for sharing: its place in the run's prompt stream and
    its tokens. None for a prompt outside the stream (index < 0), which is never shared."""
    prompt = rollout_of(sample).prompt
    return (prompt.index, tuple(prompt.prompt_ids)) if prompt.index >= 0 else None


def same_pixels(a: Prompt, b: Prompt) -> bool:
    """Whether two prompts hold the same pixel inputs (after a move between ranks a group's
    prompts are equal copies, no longer one object)."""
    return a is b or (a.mm_inputs.keys() == b.mm_inputs.keys()
                      and all(torch.equal(a.mm_inputs[k], b.mm_inputs[k]) for k in a.mm_inputs))


def prompt_groups(samples: list, share: bool) -> list[list[int]]:
    """Indices of the samples that share one prompt: groups in order of first appearance, each
    in input order. Without `share` every sample is a group of its own."""
    groups: dict = {}
    for i, sample in enumerate(samples):
        key = prompt_key(sample) if share else None
        first = groups.get(key, [None])[0]
        if key is None or (first is not None and not same_pixels(rollout_of(samples[first]).prompt, rollout_of(sample).prompt)):
            key = ("alone", i)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def packed_length(samples: list) -> int:
    """Tokens that samples of one prompt take in a micro-batch together: the prompt once, then
    every response (one sample: its whole sequence)."""
    return len(rollout_of(samples[0]).prompt.prompt_ids) + sum(len(rollout_of(s).response_ids) for s in samples)


def split_by_token_budget(samples: list, micro_batch_tokens: int, share: bool = False) -> list[list]:
    """Samples cut into micro-batches of at most `micro_batch_tokens` tokens (a lone longer
    sample forms its own), each keeping its samples in their input order. With `share`, a
    group's prompt counts once (`pack`); a group over the budget is cut into runs that each
    carry the prompt. Then first-fit decreasing: runs longest first, each into the first
    micro-batch with room for it: fewer, fuller micro-batches than a consecutive split when
    lengths are skewed."""
    units: list[list[int]] = []  # runs of samples that go into one micro-batch together
    for group in prompt_groups(samples, share):
        run: list[int] = []
        for i in group:
            if run and packed_length([samples[j] for j in run + [i]]) > micro_batch_tokens:
                units.append(run)
                run = []
            run.append(i)
        units.append(run)
    costs = [packed_length([samples[i] for i in unit]) for unit in units]
    batches: list[list[int]] = []
    room: list[int] = []  # tokens left in each micro-batch
    for u in sorted(range(len(units)), key=lambda u: -costs[u]):
        fits = next((b for b, free in enumerate(room) if costs[u] <= free), None)
        if fits is None:
            batches.append(list(units[u]))
            room.append(micro_batch_tokens - costs[u])
        else:
            batches[fits] += units[u]
            room[fits] -= costs[u]
    return [[samples[i] for i in sorted(batch)] for batch in batches]


def empty_response(prompt: Prompt) -> Experience:
    """An experience that runs the model on `prompt` with an empty response and adds nothing:
    no response tokens, out of the loss and its denominators, never scored or logged."""
    rollout = Rollout(prompt=prompt, group_id=-1, response_ids=[], response_text="", truncated=False)
    empty = torch.zeros(0)
    return Experience(
        rollout, 0.0, {}, old_logprobs=empty, ref_logprobs=empty, teacher_logprobs=empty, advantages=empty, values=empty, returns=empty,
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


def micro_batches(samples: list, micro_batch_tokens: int, placeholder=None, share: bool = False) -> list[MicroBatch]:
    """The one micro-batch path of the experience pass, the update and the critic: this rank's
    samples split by the token budget and packed (`share`: each group's prompt once, `pack`),
    then as many micro-batches on every rank (a
    collective): ZeRO-3 gathers parameters inside each forward and ZeRO-2 reduces gradients
    inside each backward, so a rank with fewer micro-batches than its peers would hang them. A
    rank short of the count adds dummy micro-batches (`dummy_sample`; run, never counted).
    `placeholder` (a sample) makes the dummy when this rank has no samples. [] when no rank has
    any sample. With sequence parallelism (`run_shard`) the ranks of a group run every one of
    their micro-batches together, each its shard of the tokens: each rank gets the group's
    micro-batches, its own `owned`."""
    shard = run_shard()
    if shard is not None:  # the budget counts a rank's shard of each micro-batch
        micro_batch_tokens *= shard.size
    batches = [pack(group, share=share) for group in split_by_token_budget(samples, micro_batch_tokens, share)]
    if shard is not None:
        batches = group_micro_batches(batches, shard)
        samples = [s for batch in batches for s in batch.samples]  # the group's: its ranks make one dummy
    count = all_reduce_max_int(len(batches))
    if len(batches) == count:
        return batches
    pool = samples or ([placeholder] if placeholder is not None else [])
    if not pool:
        raise ValueError("a rank without samples needs a placeholder to join its peers' micro-batches")
    return batches + [pack([dummy_sample(pool)], dummy=True) for _ in range(count - len(batches))]


def group_micro_batches(batches: list[MicroBatch], shard) -> list[MicroBatch]:
    """The micro-batches of every rank of the sequence-parallel group, in rank order: this
    rank's own (the same objects: what the passes store in its samples stays), then copies of
    its peers' (`owned` False)."""
    everyone = all_gather_objects(batches, group=shard.group)
    return [batch if member == shard.index else replace(batch, owned=False)
            for member, theirs in enumerate(everyone) for batch in (batches if member == shard.index else theirs)]


def pack(samples: list, dummy: bool = False, share: bool = False) -> MicroBatch:
    """The samples in one row of segments. Each sample is one segment (its prompt, then its
    response), or with `share` the samples of one prompt (`prompt_groups`) are its prompt once,
    then each response on its own: a response attends to the prompt and to itself, never to a
    sibling, and its positions continue the prompt's, so every response sees exactly what it
    would alone. `samples` of the batch are then in row order (groups together)."""
    ordered, segments = [], []
    for group in prompt_groups(samples, share):
        members = [samples[i] for i in group]
        ordered += members
        if len(members) == 1:
            segments.append(Segment(members[0], prompt=True, response=True))
            continue
        parent = len(segments)
        segments.append(Segment(members[0], prompt=True, response=False))
        segments += [Segment(m, prompt=False, response=True, parent=parent) for m in members if rollout_of(m).response_ids]
    parts = [segment_tokens(segment) for segment in segments]
    lengths = [len(ids) for ids, _, _ in parts]
    input_ids = torch.tensor([t for ids, _, _ in parts for t in ids])[None]  # [1, T]
    response_mask = torch.tensor([flag for segment in segments for flag in segment_flags(segment)])[None]  # [1, T]
    mm_inputs = concat_mm_inputs([mm for _, _, mm in parts])
    if any(types for _, types, _ in parts):
        mm_inputs["mm_token_type_ids"] = torch.tensor([t for ids, types, _ in parts for t in types or [0] * len(ids)])[None]  # [1, T]
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=None,  # built per attention implementation by forward_inputs
        response_mask=response_mask,
        mm_inputs=mm_inputs,
        samples=ordered,
        dummy=dummy,
        seq_lengths=lengths,
        segments=segments,
    )


def segment_flags(segment: Segment) -> list[int]:
    """Per token of the segment: 1 on response tokens (scored), 0 on prompt tokens."""
    rollout = rollout_of(segment.sample)
    return [0] * len(rollout.prompt.prompt_ids) * segment.prompt + [1] * len(rollout.response_ids) * segment.response


def segment_tokens(segment: Segment) -> tuple[list[int], list[int], dict]:
    """A segment's token ids, modality ids ([] for text-only models) and pixel inputs."""
    rollout = rollout_of(segment.sample)
    prompt = rollout.prompt
    if segment.prompt and segment.response:
        return prompt.prompt_ids + rollout.response_ids, rollout.mm_token_types(), rollout.mm_inputs()
    if segment.prompt:
        return list(prompt.prompt_ids), list(prompt.mm_token_types), prompt.mm_inputs
    types = rollout.mm_token_types()[len(prompt.prompt_ids):]
    return list(rollout.response_ids), types, rollout.observation_mm_inputs


def predictor_rows(batch: MicroBatch) -> torch.Tensor:
    """[B, L]: for each token, the position whose hidden state predicts it: the one before it,
    or for the first token of a response that continues a shared prompt, the prompt's last (0
    at a row's first token, which nothing predicts)."""
    rows = (torch.arange(batch.input_ids.shape[1]) - 1).clamp(min=0).expand(batch.input_ids.shape[0], -1).clone()
    if batch.shares_prompts():
        ends = list(accumulate(batch.seq_lengths))
        for i, segment in enumerate(batch.segments):
            if segment.parent >= 0:
                rows[0, ends[i] - batch.seq_lengths[i]] = ends[segment.parent] - 1
    return rows


def position_ids(backbone: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """Each packed sample's own positions: [1, T] from 0 at its first prompt token, or for
    models with a rope index (Qwen-VL's M-RoPE) that model's [3, 1, T] ids: the prompt's from
    the model's own function (once per prompt, shared by its responses), then the response,
    all text, continuing from the prompt's largest id + 1 on all three axes, as the function
    numbers text after the last image. A multi-turn response holding observation images is
    numbered by the function over the whole sequence instead. A response segment after a
    shared prompt gets the ids it would have after its own copy of the prompt."""
    rope_index = getattr(backbone, "get_rope_index", None)
    parts = []
    for segment, length in zip(batch.segments, batch.seq_lengths):
        rollout = rollout_of(segment.sample)
        prompt_length = len(rollout.prompt.prompt_ids)
        if rope_index is None:
            start = 0 if segment.prompt else prompt_length
            parts.append(torch.arange(start, start + length))
            continue
        if segment.response and rollout.observation_images:
            whole = rope_positions(rope_index, rollout.prompt.prompt_ids + rollout.response_ids,
                                   rollout.mm_token_types(), rollout.mm_inputs(), rollout.rope_positions)  # [3, 1, P + R]
            parts.append(whole if segment.prompt else whole[..., prompt_length:])
            continue
        prompt = prompt_positions(rope_index, rollout.prompt)  # [3, 1, P]
        if segment.prompt:
            parts.append(prompt)
        if segment.response:
            start = int(prompt.max()) + 1 if prompt.numel() else 0
            parts.append(torch.arange(start, start + len(rollout.response_ids)).expand(3, 1, -1))  # [3, 1, R]
    return torch.cat(parts, dim=-1)[None] if rope_index is None else torch.cat(parts, dim=-1)  # [1, T] or [3, 1, T]


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
    """The model's keyword inputs, on the model's device. Packed batches add their per-segment
    position ids and what keeps segments apart: a block mask (sdpa) or the segment starts and,
    for shared prompts, each segment's keys (varlen kernels, attention.varlen_kwargs)."""
    device = next(backbone.parameters()).device
    inputs = batch.model_inputs()
    if batch.seq_lengths is not None:
        parents = [segment.parent for segment in batch.segments]
        inputs["position_ids"] = position_ids(backbone, batch)
        check_shared_prefix_support(backbone, batch.shares_prompts())
        if uses_varlen(backbone):
            del inputs["attention_mask"]
            inputs |= varlen_kwargs(batch.seq_lengths, parents)
        else:
            inputs["attention_mask"] = block_causal_mask(batch.seq_lengths, device, parents)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}  # lengths stay ints
