"""Shared-prompt micro-batches (`train.share_prompts`) against the unshared layout, same samples.

    python bench/shared_prefix.py                    # both shapes on the tiny model, Geo3K on the wide one
    python bench/shared_prefix.py --models tiny      # seconds, not minutes
    python bench/shared_prefix.py --device cuda --compute-dtype bfloat16 --models wide --layers 36   # a GPU, full depth

Shapes (GRPO groups; token-mean policy-gradient loss, micro-batches as the trainer cuts them):
- demo: the colour demo's step on one of its 2 ranks: 32 prompts (a 56-112 px image, ~40
  tokens) x 8 responses of 2-8 tokens, `micro_batch_tokens` 2048.
- geo3k: a Geo3K-like group: one 448 x 448 image (1,024 patches, 256 image tokens) and ~100
  text tokens, n = 8 responses of 256 tokens, `micro_batch_tokens` 4096.

Models: `tiny` is the demo's checkpoint (artifacts/tiny-vl, built if missing); `wide` is a
randomly initialised Qwen2.5-VL-3B-shaped model with its real widths (hidden 2048, MLP 11008,
16 heads / 2 KV heads, vocabulary 151,936; vision tower 1280 wide, MLP 3420, 16 heads) and
`--layers` decoder and vision layers (default 2). fp32 on the CPU by default; `--device cuda
--compute-dtype bfloat16` runs bf16 autocast with the attention `auto` picks there.

For each: tokens through the decoder, patches through the vision tower, and seconds (best of
`--repeats`) of the update (forward + backward) and of a no-grad pass (old / reference logprobs).
The update's speed-up is bounded by the work removed; the linear layers' FLOPs of both layouts
are printed for the model as run and projected to its full depth (36 decoder and 32 vision
layers for the 3B shape), with the LM head (run on the responses only, the same both ways).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vlrft.data.dataset import load_rows  # noqa: E402
from vlrft.data.encoding import PromptEncoder  # noqa: E402
from vlrft.models.attention import resolve_attention  # noqa: E402
from vlrft.models.forward import policy_forward  # noqa: E402
from vlrft.models.loader import load_model  # noqa: E402
from vlrft.models.packing import micro_batches  # noqa: E402
from vlrft.models.patch_conv import use_patchwise_conv3d  # noqa: E402
from vlrft.types import Rollout  # noqa: E402

TINY = REPO / "artifacts" / "tiny-vl"
WIDE = dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2, vocab_size=151936)
WIDE_VISION = dict(hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048)
FULL_DEPTH = (36, 32)  # Qwen2.5-VL-3B: decoder layers, vision layers


def tiny_model_path() -> Path:
    if not (TINY / "config.json").is_file():
        from data_tools.make_tiny_model import build_vl_model

        build_vl_model(TINY)
    return TINY


def wide_model(layers: int, compute_dtype: str, device: str) -> torch.nn.Module:
    """The 3B-wide random model, initialised on `device` (at full depth: 3.8B parameters, a
    long random initialisation on a CPU)."""
    config = AutoConfig.from_pretrained(tiny_model_path())  # the tiny tokenizer's special-token ids
    for key, value in WIDE.items():
        setattr(config.text_config, key, value)
    config.text_config.num_hidden_layers = layers
    config.text_config.layer_types = ["full_attention"] * layers
    config.text_config.rope_parameters["mrope_section"] = [16, 24, 24]  # head dim 128, as Qwen2.5-VL
    for key, value in WIDE_VISION.items():
        setattr(config.vision_config, key, value)
    config.vision_config.depth = layers
    config.vision_config.fullatt_block_indexes = [layers - 1]
    config.tie_word_embeddings = True  # as the 3B checkpoint
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, attn_implementation=resolve_attention("auto", compute_dtype))
    model.config.use_cache = False
    model.compute_dtype = getattr(torch, compute_dtype)
    use_patchwise_conv3d(model)
    return model.eval()


def group_rollouts(shape: str, tmp: Path, vocab: int) -> tuple[list[Rollout], int]:
    """The shape's rollouts (grouped by prompt, as the engine returns them) and its token budget."""
    g = torch.Generator().manual_seed(0)
    if shape == "demo":
        colours = REPO / "artifacts" / "colors"
        if not (colours / "train.jsonl").is_file():
            from data_tools.synth_shapes import main as synth

            synth(["--task", "colors", "--out", str(colours)])
        encoder = PromptEncoder(str(tiny_model_path()), 3136, 12544, 1024)
        rows = load_rows(colours / "train.jsonl")[:32]
        lengths = lambda: int(torch.randint(2, 9, (1,), generator=g))  # noqa: E731
        prompts, n, budget = [encoder.encode(r, i) for i, r in enumerate(rows)], 8, 2048
    else:
        Image.new("RGB", (448, 448), (30, 120, 200)).save(tmp / "figure.png")
        question = "In the figure, triangle ABC has AB = AC and angle A = 40 degrees. Find angle B. " * 2
        row = {"id": "geo", "answer": "70", "messages": [{"role": "user", "content": [
            {"type": "image", "image": str(tmp / "figure.png")}, {"type": "text", "text": question}]}]}
        (tmp / "rows.jsonl").write_text(json.dumps(row) + "\n")
        encoder = PromptEncoder(str(tiny_model_path()), 448 * 448, 448 * 448, 4096)
        prompts = [encoder.encode(load_rows(tmp / "rows.jsonl")[0], 0)]
        lengths, n, budget = (lambda: 256), 8, 4096
    rollouts = [Rollout(p, p.index, torch.randint(10, min(vocab, 600), (lengths(),), generator=g).tolist(), "", False)
                for p in prompts for _ in range(n)]
    return rollouts, budget


def linear_flops(config, tokens: int, patches: int, responses: int, layers: tuple[int, int] | None = None) -> float:
    """Forward FLOPs of the linear layers (2 per multiply-add): decoder layers on every token,
    vision layers and merger on every patch, the LM head on the response tokens."""
    text, vision = config.text_config, config.vision_config
    d, kv = text.hidden_size, text.num_key_value_heads * (text.hidden_size // text.num_attention_heads)
    per_token = 2 * d * d + 2 * d * kv + 3 * d * text.intermediate_size
    v = vision.hidden_size
    per_patch = 4 * v * v + 3 * v * vision.intermediate_size
    merger = ((v * 4) ** 2 + v * 4 * vision.out_hidden_size) / 4  # per patch (4 patches merge into a token)
    text_layers, vision_layers = layers or (text.num_hidden_layers, vision.depth)
    return 2 * (tokens * text_layers * per_token + patches * (vision_layers * per_patch + merger) + responses * d * text.vocab_size)


def timed(model, batches, grad: bool, repeats: int) -> float:
    tokens = float(sum(int(b.response_mask.sum()) for b in batches))
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        with torch.set_grad_enabled(grad):
            for batch in batches:
                logp = policy_forward(model, batch, 1.0).logp
                if grad:
                    (-logp.sum() / tokens).backward()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=["tiny", "wide"], default=["tiny", "wide"])
    p.add_argument("--shapes", nargs="+", choices=["demo", "geo3k"], default=["demo", "geo3k"])
    p.add_argument("--layers", type=int, default=2, help="decoder and vision layers of the wide model")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="shared-prefix-"))
    print(f"torch {torch.__version__}, {args.threads} threads, {args.compute_dtype} on {args.device}, best of {args.repeats}")
    header = f"{'model':6} {'shape':6} {'layout':9} {'tokens':>7} {'patches':>8} {'update s':>9} {'no-grad s':>10} {'GFLOP':>8} {'full-depth TFLOP':>17}"
    for name in args.models:
        if name == "tiny":
            model = load_model(str(tiny_model_path()), resolve_attention("auto", args.compute_dtype), args.compute_dtype).eval()
        else:
            model = wide_model(args.layers, args.compute_dtype, args.device)
        model.to(args.device)
        for shape in args.shapes:
            if name == "wide" and shape == "demo":
                continue  # the demo runs the tiny model
            rollouts, budget = group_rollouts(shape, tmp, model.config.text_config.vocab_size)
            print(f"\n{header}")
            rows = {}
            for share in (False, True):
                batches = micro_batches(rollouts, budget, share=share)
                tokens = sum(sum(b.seq_lengths) for b in batches)
                patches = sum(int(b.mm_inputs["pixel_values"].shape[0]) for b in batches if "pixel_values" in b.mm_inputs)
                responses = sum(len(r.response_ids) for r in rollouts)
                update = timed(model, batches, True, args.repeats)
                no_grad = timed(model, batches, False, args.repeats)
                flops = linear_flops(model.config, tokens, patches, responses)
                full = linear_flops(model.config, tokens, patches, responses, FULL_DEPTH if name == "wide" else None)
                rows[share] = (tokens, patches, update, no_grad, flops, full)
                layout = "shared" if share else "unshared"
                projected = f"{full / 1e12:17.2f}" if name == "wide" else f"{'-':>17}"
                print(f"{name:6} {shape:6} {layout:9} {tokens:7d} {patches:8d} {update:9.3f} {no_grad:10.3f} {flops / 1e9:8.1f} {projected}")
            (t0, p0, u0, n0, f0, full0), (t1, p1, u1, n1, f1, full1) = rows[False], rows[True]
            print(f"{name:6} {shape:6} {'ratio':9} {t0 / t1:6.2f}x {p0 / max(p1, 1):7.2f}x {u0 / u1:8.2f}x {n0 / n1:9.2f}x "
                  f"{f0 / f1:7.2f}x {full0 / full1:16.2f}x   (unshared / shared)")


if __name__ == "__main__":
    main()
