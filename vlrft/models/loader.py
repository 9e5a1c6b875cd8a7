"""Load policy / reference models from local HF checkpoints (from_pretrained, never a hub)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from vlrft.models.attention import COMPUTE_DTYPES
from vlrft.models.patch_conv import use_patchwise_conv3d

# Tokens that only the prompt encoder may place: a generated one would break the next forward
# ("image features and image tokens do not match"), so engines can never sample them.
VISION_SPECIAL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")


def is_vision_language(model_path: str) -> bool:
    return hasattr(AutoConfig.from_pretrained(model_path), "vision_config")


def _model_class(model_path: str):
    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(f"no HF checkpoint (config.json) in {model_path}")
    return AutoModelForImageTextToText if is_vision_language(model_path) else AutoModelForCausalLM


def load_model(
    model_path: str, attention: str = "sdpa", compute_dtype: str = "float32", weights_dtype: str = "float32"
) -> torch.nn.Module:
    """A causal LM or an image-text-to-text model, chosen from the checkpoint's config, with
    `weights_dtype` weights (fp32 for anything an optimizer updates: its master copy).
    `attention` is a transformers attn_implementation (models/attention.py); `compute_dtype` is
    what `decoder_autocast` runs the decoder in."""
    model = _model_class(model_path).from_pretrained(
        model_path, dtype=COMPUTE_DTYPES[weights_dtype], attn_implementation=attention
    )
    model.config.use_cache = False  # training forwards never want a KV cache
    model.compute_dtype = COMPUTE_DTYPES[compute_dtype]
    use_patchwise_conv3d(model)  # the vision patch embedding as a matmul (models/patch_conv.py)
    return model


def enable_gradient_checkpointing(model: torch.nn.Module) -> int:
    """Recompute decoder (and vision) layers in backward: transformers' own switch,
    non-reentrant (works with ZeRO-3's gathered parameters and inputs that need no grad).
    Returns the number of checkpointed layers.

    transformers checkpoints a layer only while that layer is in training mode, and vlrft keeps
    its models in eval mode (no dropout anywhere: rollout-time and update logprobs must be the
    same function). So only the checkpointed layers themselves are marked as training, not
    their submodules: recomputation is on, dropout stays off."""
    # transformers 5.23 renamed the switch (the old name warns); 5.19 has only the old one.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no layers transformers can checkpoint")
    for layer in layers:
        layer.training = True  # this module only (not .train(), which would recurse)
    return len(layers)


def tied_parameter_aliases(model_path: str) -> dict[str, list[str]]:
    """Parameter name -> the other checkpoint names of the same tensor (tied embeddings:
    `lm_head.weight` for `model.embed_tokens.weight`). `named_parameters()` lists a tied tensor
    once, a checkpoint (state_dict) under every name; loaders that expect the checkpoint need
    all of them. Read from a weightless (meta-device) instance of the architecture."""
    with torch.device("meta"):
        model = _model_class(model_path).from_config(AutoConfig.from_pretrained(model_path))
    param_names = {id(p): name for name, p in model.named_parameters()}
    aliases: dict[str, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        owner = param_names.get(id(tensor))
        if owner is not None and owner != name:
            aliases.setdefault(owner, []).append(name)
    return aliases


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder module (by attribute, not by parameter-name prefix), or None."""
    inner = getattr(model, "model", model)
    return getattr(inner, "visual", None) or getattr(model, "visual", None)


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop gradients into the vision tower, found by module attribute (never by a parameter-
    name prefix, which changes across transformers versions). Returns the frozen count."""
    tower = vision_tower(model)
    if tower is None:
        raise ValueError("the model has no vision tower to freeze")
    tower.requires_grad_(False)
    frozen = sum(p.numel() for p in tower.parameters())
    assert frozen > 0 and all(not p.requires_grad for p in tower.parameters())
    return frozen


def banned_token_ids(tokenizer) -> list[int]:
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in VISION_SPECIAL_TOKENS if t in vocab]


def stop_token_ids(tokenizer) -> list[int]:
    """End-of-turn and end-of-text tokens: a response ends at the first of these."""
    vocab = tokenizer.get_vocab()
    ids = {tokenizer.eos_token_id} | {vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab}
    return sorted(i for i in ids if i is not None)
