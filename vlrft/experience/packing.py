"""Packing: a micro-batch's sequences concatenated into one row, isolated from each other by a
block-diagonal causal attention mask (sdpa) or by the varlen kernel's sample starts (flash-
attention), with per-sample position ids (3-D M-RoPE for Qwen-VL).

No padding is processed; a sample's pixel inputs travel with it in sample order.
"""

from __future__ import annotations

import torch

from vlrft.experience.collate import concat_mm_inputs, rollout_of, sequence_length
from vlrft.models.attention import block_causal_mask, uses_varlen, varlen_kwargs
from vlrft.types import MicroBatch


def split_by_token_budget(samples: list, micro_batch_tokens: int) -> list[list]:
    """Greedy consecutive split so each group's total length fits the budget (a lone longer
    sample forms its own group)."""
    groups, current, total = [], [], 0
    for sample in samples:
        length = sequence_length(sample)
        if current and total + length > micro_batch_tokens:
            groups.append(current)
            current, total = [], 0
        current.append(sample)
        total += length
    if current:
        groups.append(current)
    return groups


def pack(samples: list, dummy: bool = False) -> MicroBatch:
    rollouts = [rollout_of(s) for s in samples]
    lengths = [len(r.prompt.prompt_ids) + len(r.response_ids) for r in rollouts]
    input_ids = torch.tensor([t for r in rollouts for t in r.prompt.prompt_ids + r.response_ids])[None]  # [1, T]
    response_mask = torch.tensor(
        [flag for r in rollouts for flag in [0] * len(r.prompt.prompt_ids) + [1] * len(r.response_ids)]
    )[None]  # [1, T]
    mm_inputs = concat_mm_inputs([r.prompt.mm_inputs for r in rollouts])
    if any(r.prompt.mm_token_types for r in rollouts):
        types = []
        for r, length in zip(rollouts, lengths):
            types += r.prompt.mm_token_types + [0] * (length - len(r.prompt.mm_token_types))
        mm_inputs["mm_token_type_ids"] = torch.tensor(types)[None]  # [1, T]
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
    index (Qwen-VL's M-RoPE) that model's [3, 1, T] ids computed sample by sample."""
    rope_index = getattr(backbone, "get_rope_index", None)
    if rope_index is None:
        return torch.cat([torch.arange(length) for length in batch.seq_lengths])[None]
    types = batch.mm_inputs.get("mm_token_type_ids", torch.zeros_like(batch.input_ids))
    grids = batch.mm_inputs.get("image_grid_thw")
    parts, start, image = [], 0, 0
    for sample, length in zip(batch.samples, batch.seq_lengths):
        n_images = rollout_of(sample).prompt.mm_inputs.get("image_grid_thw", torch.zeros(0, 3)).shape[0]
        ids = batch.input_ids[:, start : start + length]
        positions, _ = rope_index(
            ids,
            image_grid_thw=grids[image : image + n_images] if n_images else None,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=types[:, start : start + length],
        )  # [3, 1, L_i]
        parts.append(positions)
        start, image = start + length, image + n_images
    return torch.cat(parts, dim=-1)  # [3, 1, T]


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
