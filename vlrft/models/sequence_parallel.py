"""Sequence parallelism: N ranks share one packed micro-batch, each holding 1/N of its tokens
through the decoder (Ulysses: before attention an all-to-all trades the local tokens of every
head for every token of H/N heads, and back after it), so the decoder's activations per rank
fall by about N.

What each rank of the group does with a micro-batch every rank of the group holds whole:

- positions (M-RoPE's three axes, shared prompts' continued positions), the segment starts and
  shared prompts' key lists are computed on the whole packed row, before the split: attention
  over the exchanged heads sees the whole row, exactly as without sequence parallelism;
- the row is padded to a multiple of N by a segment of its own (attends to itself, never
  scored), then cut into N equal contiguous shards;
- the vision tower runs once per group: each rank encodes a contiguous share of the images (and
  of the videos), and the embeddings are gathered into every rank's token embeddings;
- after the decoder, the last hidden states are gathered (a response token's predictor may sit
  on another shard), and each rank scores the response tokens of its own shard only: logprobs,
  entropies and values are zero at the others' tokens, and each token's loss is computed once in
  the group. The gathers' backward sums every rank's gradient into the owner's piece.

DeepSpeed's `UlyssesSPAttentionHF` (0.19) was not used: it takes padded [batch, seq] inputs with
an attention mask and shards inside its own data loader, where vlrft's micro-batches are packed
rows with segment starts, shared-prompt key lists and M-RoPE positions computed before the split.
"""

from __future__ import annotations

import torch

from vlrft.distributed import gather_pieces, sum_over
from vlrft.models.attention import varlen_kwargs
from vlrft.models.sdpa_segments import SDPA_SEGMENTS
from vlrft.models.torch_varlen import TORCH_VARLEN
from vlrft.models.ulysses import SequenceShard
from vlrft.models.vision_calls import MODALITIES, encode_vision
from vlrft.types import MicroBatch


_RUN_SHARD: SequenceShard | None = None  # this rank's, set once by the trainer (train.sequence_parallel)


def set_run_shard(shard: SequenceShard | None) -> None:
    """The run's sequence parallelism: micro-batches are cut and shared by its group
    (packing.micro_batches), losses and sums count this rank's shard's tokens."""
    global _RUN_SHARD
    _RUN_SHARD = shard


def run_shard() -> SequenceShard | None:
    return _RUN_SHARD


def sequence_shard_of(model: torch.nn.Module) -> SequenceShard | None:
    return getattr(model, "sequence_shard", None)


def shard_model(model: torch.nn.Module, shard: SequenceShard | None) -> None:
    """Make `model` (a causal LM, or a value model) run its micro-batches sharded by `shard`."""
    model.sequence_shard = shard


def heads_problem(text_config, size: int) -> str:
    """Why the model's attention cannot be split over `size` ranks ("" when it can)."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % size or kv_heads % size:
        return (f"config key 'train.sequence_parallel' {size}: the model's {heads} attention heads and "
                f"{kv_heads} key/value heads must each divide by it")
    return ""


def local_tokens(length: int, shard: SequenceShard | None, device) -> torch.Tensor:
    """[length] True at the positions this rank scores: all of them without a shard."""
    if shard is None:
        return torch.ones(length, dtype=torch.bool, device=device)
    lo, hi = shard.bounds(length + (-length) % shard.size)
    return (torch.arange(length, device=device) >= lo) & (torch.arange(length, device=device) < hi)


def combine(values: torch.Tensor) -> torch.Tensor:
    """Per-token values ([B, L], each rank's nonzero at its own tokens only) made whole on every
    rank of the run's sequence-parallel group, with no gradient (the experience pass's
    logprobs, entropies, values); `values` itself without sequence parallelism."""
    return values if _RUN_SHARD is None else sum_over(values, _RUN_SHARD.group)


def decoder_hidden(backbone: torch.nn.Module, shard: SequenceShard | None, batch: MicroBatch, inputs: dict, extra: dict):
    """The backbone's last hidden states [B, L, H] (the vision tower included, its zero term
    added) and its output, for the policy's forward and the critic's alike. `inputs`:
    `packing.forward_inputs` of `batch`. With a shard, the whole row's, this rank having run
    its shard (`sharded_decoder`)."""
    if shard is not None:
        return sharded_decoder(backbone, batch, inputs, shard, extra)
    vision_zero = encode_vision(backbone, inputs)  # same vision calls on every rank
    base = backbone(**inputs, use_cache=False, **extra)
    hidden = base.last_hidden_state if vision_zero is None else base.last_hidden_state + vision_zero
    return hidden, base


def sharded_decoder(backbone: torch.nn.Module, batch: MicroBatch, inputs: dict, shard: SequenceShard, extra: dict):
    """The decoder's last hidden states [1, T, H] of the whole row on every rank (the vision
    tower included, its zero term added) and the decoder's output for this rank's shard.
    `inputs`: `packing.forward_inputs` of the packed micro-batch `batch`, on the model's device."""
    if backbone.config._attn_implementation not in (SDPA_SEGMENTS, TORCH_VARLEN):
        raise ValueError(f"train.sequence_parallel runs attention sdpa_segments or torch_varlen (they exchange heads "
                         f"for tokens), not {backbone.config._attn_implementation}")
    ids = inputs["input_ids"]  # [1, T]
    length = ids.shape[1]
    pad = (-length) % shard.size
    embeds, vision_zero, deepstack = _token_embeddings(backbone, inputs, shard)  # [1, T, H]
    positions = inputs["position_ids"]  # [1, T] or [3, 1, T]
    lengths, parents = list(batch.seq_lengths), [segment.parent for segment in batch.segments]
    if pad:
        embeds = torch.cat([embeds, embeds.new_zeros(1, pad, embeds.shape[-1])], dim=1)
        tail = torch.arange(pad, device=positions.device).expand(*positions.shape[:-1], pad)
        positions = torch.cat([positions, tail], dim=-1)
    varlen = {k: v.to(ids.device) if isinstance(v, torch.Tensor) else v
              for k, v in varlen_kwargs(lengths + [pad] * bool(pad), parents + [-1] * bool(pad)).items()}
    lo, hi = shard.bounds(length + pad)
    if deepstack is not None:  # Qwen3-VL adds them to the hidden states of its visual tokens in early layers
        visual, levels = deepstack
        visual = torch.nn.functional.pad(visual, (0, pad))[:, lo:hi]  # [1, T/N]
        extra = extra | {"visual_pos_masks": visual,
                         "deepstack_visual_embeds": [torch.nn.functional.pad(level, (0, 0, 0, pad))[lo:hi][visual[0]]
                                                     for level in levels]}
    decoder = getattr(backbone, "language_model", backbone)  # a vision-language model's, its embeddings done here
    base = decoder(inputs_embeds=embeds[:, lo:hi], position_ids=positions[..., lo:hi], use_cache=False,
                   sequence_shard=shard, **varlen, **extra)
    hidden = gather_pieces(base.last_hidden_state[0], [hi - lo] * shard.size, shard.group)[None, :length]  # [1, T, H]
    return (hidden if vision_zero is None else hidden + vision_zero), base


def _token_embeddings(backbone: torch.nn.Module, inputs: dict, shard: SequenceShard):
    """The row's input embeddings [1, T, H] with every image's and video's embeddings in place,
    each rank of the group encoding a contiguous share of them; the vision zero term; and for
    Qwen3-VL the deepstack features, each level's [T, H] (zero at text tokens) with the mask of
    the visual tokens [1, T] (else None)."""
    ids = inputs["input_ids"]
    embeds = backbone.get_input_embeddings()(ids)  # [1, T, H]
    vision = getattr(backbone.config, "vision_config", None)
    if vision is None or not hasattr(backbone, "get_image_features"):
        return embeds, None, None
    local, shares = {}, {}
    for pixel_key, grid_key, _, name in MODALITIES:
        if pixel_key not in inputs:
            continue
        grid = inputs[grid_key]  # [n, 3]
        patches = grid.prod(dim=-1).tolist()
        runs = _cut(patches, shard.size)
        first, last = runs[shard.index]
        start, end = sum(patches[:first]), sum(patches[:last])
        shares[name] = [sum(patches[a:b]) // vision.spatial_merge_size**2 for a, b in runs]  # each rank's embeddings
        if last > first:
            local[pixel_key], local[grid_key] = inputs[pixel_key][start:end], grid[first:last]
    vision_zero = encode_vision(backbone, local)
    encoded = local.get("mm_encoder_outputs", {})
    levels = len(getattr(vision, "deepstack_visual_indexes", None) or [])
    deepstack = [embeds.new_zeros(embeds.shape[1:]) for _ in range(levels)]  # [T, H] each
    visual = torch.zeros_like(ids, dtype=torch.bool)  # [1, T]
    for name, counts in shares.items():
        out = encoded.get(name)
        pieces = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])] if out is not None else [None] * (1 + levels)
        gathered = [gather_pieces(torch.cat(piece).to(embeds.dtype) if piece is not None else embeds[0, :0], counts, shard.group)
                    for piece in pieces]  # [tokens, H] each: the embeddings, then each deepstack level
        mask = backbone.get_placeholder_mask(ids, inputs_embeds=embeds, **{f"{name}_features": gathered[0]})[
            0 if name == "image" else 1]  # [1, T, H]
        embeds = embeds.masked_scatter(mask, gathered[0])
        deepstack = [level.masked_scatter(mask[0], features) for level, features in zip(deepstack, gathered[1:])]
        visual |= mask[..., 0]
    return embeds, vision_zero, (visual, deepstack) if levels and shares else None


def _cut(patches: list[int], size: int) -> list[tuple[int, int]]:
    """`size` contiguous runs of items covering them all, each run's patches near 1/size of the
    total (an item goes to the run its middle falls in)."""
    total = sum(patches)
    runs, start, done = [], 0, 0
    for k in range(1, size + 1):
        end = start
        while end < len(patches) and (done + patches[end] / 2) * size <= total * k:
            done += patches[end]
            end += 1
        runs.append((start, end))
        start = end
    return runs
