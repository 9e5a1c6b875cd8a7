"""The vision tower runs the same calls on every rank: once for the micro-batch's images, then
once for its videos, before the decoder.

Under ZeRO-3 each module call gathers that module's parameters with a collective, so ranks
must call the same modules in the same order. A Qwen-VL model calls its vision tower only for
the modalities its inputs hold: one rank's micro-batch with images and another's with only text
(or with videos and no images) would issue different gathers, and the run crashes or hangs. So
the tower's outputs are computed here, in a fixed order, and handed to the model as
`mm_encoder_outputs`; a modality the micro-batch lacks runs on a one-token dummy whose outputs
enter the result as an exact zero (so its backward runs too, with zero gradients).

Only for the modalities the run's data can hold (`declare_modalities`, from the training rows):
a dummy costs a whole tower pass, forward and backward (Qwen2.5-VL's 32-layer tower launches
about as many GPU kernels as the 28-layer 1.5B decoder), and a modality no micro-batch of the
run holds needs no call on any rank. DeepSpeed treats the gradients such a tower never received as
zeros, so the update is the same to the bit.
"""

from __future__ import annotations

import torch

# (pixel input, grid input, the model's feature function, mm_encoder_outputs key), in call order
MODALITIES = (
    ("pixel_values", "image_grid_thw", "get_image_features", "image"),
    ("pixel_values_videos", "video_grid_thw", "get_video_features", "video"),
)


ALL_MODALITIES = tuple(name for *_, name in MODALITIES)


def declare_modalities(backbone: torch.nn.Module, modalities) -> None:
    """The modalities ("image", "video") this run's micro-batches can hold, the same on every
    rank: the tower is called for each of them in every micro-batch and for no other.
    Undeclared, a model is called for all of them."""
    backbone.vision_modalities = tuple(name for name in ALL_MODALITIES if name in modalities)


def encode_vision(backbone: torch.nn.Module, inputs: dict) -> torch.Tensor | None:
    """Replace `inputs`' pixel tensors by the vision tower's outputs (`mm_encoder_outputs`),
    calling the tower once per declared modality, present or not. Returns the zero to add to
    the model's output (it ties the dummy calls into the graph), or None for a model without
    vision or a micro-batch without dummies."""
    vision = getattr(backbone.config, "vision_config", None)
    if vision is None or not hasattr(backbone, "get_image_features"):
        return None
    declared = getattr(backbone, "vision_modalities", ALL_MODALITIES)
    encoded = {}
    zero = None
    for pixel_key, grid_key, function, name in MODALITIES:
        pixels = inputs.pop(pixel_key, None)
        if pixels is not None:
            if name not in declared:  # other ranks would not call the tower: a hang under ZeRO-3
                raise ValueError(f"a micro-batch holds {name} inputs, but this run declared its data holds only "
                                 f"{', '.join(declared) or 'text'} (vision_calls.declare_modalities)")
            encoded[name] = getattr(backbone, function)(pixels, inputs[grid_key], return_dict=True)
            continue
        if name not in declared:
            continue
        grid, dummy = dummy_pixels(vision, next(backbone.parameters()).device)
        out = getattr(backbone, function)(dummy, grid, return_dict=True)
        term = sum(t.sum() for t in out.pooler_output)
        for level in getattr(out, "deepstack_features", None) or []:  # Qwen3-VL's per-layer features
            term = term + sum(t.sum() for t in level)
        zero = term * 0.0 if zero is None else zero + term * 0.0
    if encoded:
        inputs["mm_encoder_outputs"] = encoded
    return zero


def dummy_pixels(vision, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One merged token's worth of zero patches: grid [[1, m, m]] and [m·m, C·t·p·p] pixels."""
    m = vision.spatial_merge_size
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return torch.tensor([[1, m, m]], device=device), torch.zeros(m * m, width, device=device)
