"""Collation of prompt+response sequences into right-padded micro-batches with pixel inputs."""

from __future__ import annotations

import torch

from vlrft.types import MicroBatch, Rollout


def concat_mm_inputs(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate samples' pixel inputs along dim 0 in sample order (the model's expectation)."""
    keys = {k for item in items for k in item}
    return {k: torch.cat([item[k] for item in items if k in item], dim=0) for k in sorted(keys)}


def rollout_of(sample) -> Rollout:
    return sample if isinstance(sample, Rollout) else sample.rollout


def sequence_length(sample) -> int:
    r = rollout_of(sample)
    return len(r.prompt.prompt_ids) + len(r.response_ids)


def mm_token_type_ids(rows: list[list[int]], width: int, left_pad: bool) -> dict[str, torch.Tensor]:
    """Qwen-VL's per-token modality ids ([B, L]) from each row's types (`Prompt.mm_token_types`,
    `Rollout.mm_token_types()`; padding is text = 0), or {} when no row has any.

    Without them the model silently falls back to 1-D positions instead of M-RoPE.
    """
    if not any(rows):
        return {}
    types = torch.zeros((len(rows), width), dtype=torch.long)  # [B, L]
    for row, kinds in enumerate(rows):
        start = width - len(kinds) if left_pad else 0
        types[row, start : start + len(kinds)] = torch.tensor(kinds, dtype=torch.long)
    return {"mm_token_type_ids": types}


def collate(samples: list, pad_id: int, dummy: bool = False) -> MicroBatch:
    """Right-pad prompt+response sequences; response_mask marks the scored response tokens."""
    width = max(sequence_length(s) for s in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros_like(input_ids)
    for row, sample in enumerate(samples):
        r = rollout_of(sample)
        seq = r.prompt.prompt_ids + r.response_ids
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attention_mask[row, : len(seq)] = 1
        response_mask[row, len(r.prompt.prompt_ids) : len(seq)] = 1
    rollouts = [rollout_of(s) for s in samples]
    mm_inputs = concat_mm_inputs([r.mm_inputs() for r in rollouts])
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        mm_inputs=mm_inputs | mm_token_type_ids([r.mm_token_types() for r in rollouts], width, left_pad=False),
        samples=list(samples),
        dummy=dummy,
    )


def gather_responses(batch: MicroBatch, per_token: torch.Tensor, device: torch.device | str | None = None) -> list[torch.Tensor]:
    """Each sample's response-token values from a per-token tensor of the batch, on `device`
    (default: where `per_token` is; one copy for the whole batch). list of [R_i].

    Response positions come in sample order in both layouts (padded rows, one packed row).
    """
    lengths = [len(rollout_of(s).response_ids) for s in batch.samples]
    selected = per_token[batch.response_mask.bool().to(per_token.device)]  # [sum R_i]
    return list(torch.split(selected.to(device) if device is not None else selected, lengths))


def scatter_responses(batch: MicroBatch, rows: list[torch.Tensor]) -> torch.Tensor:
    """`gather_responses` undone: each sample's [R_i, ...] values at its response tokens in the
    batch's layout, zeros elsewhere. [B, L, ...] on the rows' device, in their dtype."""
    whole = torch.cat(rows)  # [sum R_i, ...]
    out = whole.new_zeros(batch.response_mask.shape + whole.shape[1:])
    out[batch.response_mask.bool().to(whole.device)] = whole
    return out


def pad_rows(rows: list[torch.Tensor], width: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Left-aligned [R_i] (or [R_i, k]) tensors -> float32 [N, width] (or [N, width, k]) with
    zeros after each row, built where the rows are and then moved to `device` (default: the
    rows' device, so a GPU forward's rows stay on the GPU with their gradients). Rows must
    share one device."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    if not rows:
        return torch.zeros((0, width), dtype=torch.float32, device=device)
    padded = torch.nn.utils.rnn.pad_sequence([r.float() for r in rows], batch_first=True)  # [N, max R_i, ...]
    after = (0, 0) * (padded.dim() - 2)  # no padding of the trailing dims
    padded = torch.nn.functional.pad(padded, after + (0, width - padded.shape[1]))  # [N, width, ...]
    return padded.to(device) if device is not None else padded


def engine_logprob_rows(samples: list, width: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """The engine's logprob of each sampled response token, [N, width] (`pad_rows`); zeros for
    a sample whose engine reported none (a dummy's placeholder)."""
    rows = []
    for sample in samples:
        r = rollout_of(sample)
        rows.append(torch.tensor(r.logprobs if r.logprobs is not None else [0.0] * len(r.response_ids)))
    return pad_rows(rows, width, device)


def response_rows(batch: MicroBatch, per_token: torch.Tensor) -> torch.Tensor:
    """Per-token values of a micro-batch in the loss layout: one row per sample, its response
    tokens left-aligned ([S, R]), whatever the batch layout; on `per_token`'s device."""
    return pad_rows(gather_responses(batch, per_token), device=per_token.device)
