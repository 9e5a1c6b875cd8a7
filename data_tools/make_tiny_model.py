"""Build tiny, fully offline Qwen-style checkpoints for tests and CPU RL experiments.

The checkpoints are saved with ``save_pretrained`` and load with ``from_pretrained(path)``
exactly like real Qwen2.5-VL / Qwen2 checkpoints (config, safetensors weights, tokenizer,
chat template, image processor, generation config), so RL code paths are exercised
unchanged while a full build + warm-up stays well under a minute on 2 CPU cores.

The optional warm-up (``tiny_warmup``) only teaches the answer *format*: labels are drawn
independently of the input, so afterwards the VL model answers ``<answer>colour</answer>``
with each colour ~25% of the time and has to learn to look at the image through RL.

CLI::

    python -m data_tools.make_tiny_model --kind vl|text --out DIR [--family F] [--warmup-steps N] [--seed S]

``--family`` picks the architecture: for ``--kind vl`` ``qwen2.5-vl`` (default), ``qwen2-vl`` or
``qwen3-vl`` (Qwen3-VL's deepstack visual features and interleaved M-RoPE included); for
``--kind text`` ``qwen2`` (default) or ``qwen3`` (per-head q/k norms).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

from data_tools.tiny_tokenizer import build_tokenizer, special_token_ids
from data_tools.tiny_warmup import IMAGE_SIZE, run_warmup
from vlrft.data.encoding import PromptEncoder

# Image processor resize bounds (also what the warm-up's PromptEncoder uses): the
# warm-up's 56x56 images keep their size.
MIN_PIXELS = IMAGE_SIZE * IMAGE_SIZE
MAX_PIXELS = 112 * 112
MAX_PROMPT_TOKENS = 512  # warm-up prompts are ~25 tokens

# --------------------------------------------------------------------------- image processor


def build_image_processor(patch_size: int = 14) -> Qwen2VLImageProcessorPil:
    # PIL backend: works without torchvision. Saved as "Qwen2VLImageProcessor", so
    # AutoImageProcessor picks whichever backend the loading machine has. Qwen3-VL uses the
    # same processor with 16-pixel patches.
    return Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )


# --------------------------------------------------------------------------- configs

TEXT_DIMS = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 32
    num_key_value_heads=2,
    intermediate_size=256,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    hidden_act="silu",
)


def _token_ids(tokenizer) -> dict:
    ids = special_token_ids(tokenizer)
    return dict(
        bos_token_id=ids["<|endoftext|>"],  # like Qwen: bos id exists but is never prepended
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


VL_FAMILIES = ("qwen2.5-vl", "qwen2-vl", "qwen3-vl")


def vl_config(tokenizer, family: str = "qwen2.5-vl"):
    """A tiny config of `family` (VL_FAMILIES): 2 text + 2 vision layers, width 128."""
    ids = special_token_ids(tokenizer)
    # M-RoPE: (temporal, height, width) sections of head_dim / 2 = 16 frequencies.
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]}
    text = dict(TEXT_DIMS, vocab_size=len(tokenizer), rope_parameters=rope, **_token_ids(tokenizer))
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,  # v5 reads tying from the outer config
    )
    width = TEXT_DIMS["hidden_size"]
    if family == "qwen2.5-vl":
        vision = dict(
            depth=2, hidden_size=128, num_heads=4, intermediate_size=256,
            out_hidden_size=width,  # merger projects straight into the LM width
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            window_size=112, fullatt_block_indexes=[1], tokens_per_second=2,
        )
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
    if family == "qwen2-vl":
        vision = dict(depth=2, embed_dim=128, hidden_size=width, num_heads=4, mlp_ratio=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **common)
    if family == "qwen3-vl":
        text = dict(text, head_dim=TEXT_DIMS["hidden_size"] // TEXT_DIMS["num_attention_heads"],
                    rope_parameters=dict(rope, mrope_interleaved=True))
        vision = dict(
            depth=2, hidden_size=128, num_heads=4, intermediate_size=256, out_hidden_size=width,
            patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
            num_position_embeddings=64,  # an 8x8 grid of learned positions, interpolated per image
            deepstack_visual_indexes=[0, 1],  # both vision layers feed the first two LM layers
        )
        return Qwen3VLConfig(text_config=text, vision_config=vision, **common)
    raise ValueError(f"unknown VL family {family!r}; choose from {', '.join(VL_FAMILIES)}")


VL_MODEL_CLASSES = {
    "qwen2.5-vl": Qwen2_5_VLForConditionalGeneration,
    "qwen2-vl": Qwen2VLForConditionalGeneration,
    "qwen3-vl": Qwen3VLForConditionalGeneration,
}


TEXT_FAMILIES = ("qwen2", "qwen3")


def text_config(tokenizer, family: str = "qwen2"):
    """A tiny causal-LM config of `family` (TEXT_FAMILIES), same dims as the VL decoder."""
    common = dict(
        TEXT_DIMS,
        vocab_size=len(tokenizer),
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        **_token_ids(tokenizer),
    )
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=TEXT_DIMS["hidden_size"] // TEXT_DIMS["num_attention_heads"])
    raise ValueError(f"unknown text family {family!r}; choose from {', '.join(TEXT_FAMILIES)}")


TEXT_MODEL_CLASSES = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}


# --------------------------------------------------------------------------- builders


def _build(out_dir, kind: str, warmup_steps: int, seed: int, batch_size: int, lr: float, family: str) -> Path:
    """Save tokenizer (+ image processor) first, so the warm-up encodes its prompts with
    vlrft's ``PromptEncoder`` from ``out_dir`` exactly as training will; then warm up,
    check and save the model, its generation config and ``tiny_model_report.json``."""
    t0 = time.time()
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    if kind == "vl":
        config = vl_config(tokenizer, family)
        image_processor = build_image_processor(config.vision_config.patch_size)
        model = VL_MODEL_CLASSES[family](config).eval()
    else:
        image_processor = None
        model = TEXT_MODEL_CLASSES[family](text_config(tokenizer, family)).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    if image_processor is not None:
        image_processor.save_pretrained(out_dir)
    model.config.save_pretrained(out_dir)  # the encoder reads the family's video conventions from it
    report = {"kind": kind, "family": family, "seed": seed, "warmup_steps": warmup_steps, "token_ids": special_token_ids(tokenizer)}

    if warmup_steps > 0:
        encoder = PromptEncoder(str(out_dir), MIN_PIXELS, MAX_PIXELS, MAX_PROMPT_TOKENS)
        report.update(run_warmup(model, encoder, kind, warmup_steps, seed, batch_size, lr))

    model.generation_config = GenerationConfig(**_token_ids(tokenizer))
    model.save_pretrained(out_dir)
    # How the checkpoint was made, for humans and tests.
    (out_dir / "tiny_model_report.json").write_text(json.dumps(report, indent=2))
    print(f"saved tiny {'VL' if kind == 'vl' else 'text'} model to {out_dir} in {time.time() - t0:.1f}s")
    return out_dir


def build_vl_model(
    out_dir, warmup_steps: int = 100, seed: int = 0, batch_size: int = 32, lr: float = 3e-3, family: str = "qwen2.5-vl"
) -> Path:
    """Tiny VL checkpoint of `family` (default Qwen2.5-VL) in ``out_dir`` (optionally format-warmed-up)."""
    return _build(out_dir, "vl", warmup_steps, seed, batch_size, lr, family)


def build_text_model(
    out_dir, warmup_steps: int = 100, seed: int = 0, batch_size: int = 32, lr: float = 3e-3, family: str = "qwen2"
) -> Path:
    """Tiny causal-LM checkpoint of `family` (default Qwen2) in ``out_dir`` (same text dims and tokenizer)."""
    return _build(out_dir, "text", warmup_steps, seed, batch_size, lr, family)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Build a tiny offline Qwen-style checkpoint.")
    p.add_argument("--kind", choices=["vl", "text"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=VL_FAMILIES + TEXT_FAMILIES, help="architecture (default qwen2.5-vl / qwen2)")
    args = p.parse_args(argv)
    family = args.family or ("qwen2.5-vl" if args.kind == "vl" else "qwen2")
    if family not in (VL_FAMILIES if args.kind == "vl" else TEXT_FAMILIES):
        p.error(f"--family {family} is not a {args.kind} family")
    # One thread: the matrices are tiny, so 2 threads gain only ~25% on an idle 2-core box but
    # run ~2x slower when other jobs share it (spinning intra-op threads); and a fixed thread
    # count keeps the saved weights bit-identical from run to run (reduction order).
    torch.set_num_threads(1)
    if not torch.cuda.is_available():  # saving pulls in DeepSpeed, which warns when it finds no GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    build = build_vl_model if args.kind == "vl" else build_text_model
    build(args.out, warmup_steps=args.warmup_steps, seed=args.seed, family=family)


if __name__ == "__main__":
    main()
