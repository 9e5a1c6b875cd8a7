"""The tiny VL model of the zoom example (examples/zoom): the colour-format checkpoint of
``make_tiny_model``, then a format warm-up on the zoom conversation.

On a zoom question it learns to ask "<zoom>" (ASK_RATE of the time) or answer
"<answer>colour</answer>", and after a crop to answer "<answer>colour</answer>". Every label is drawn
independently of the images, so it learns the turn format only: reading the crop, and when to
ask for it, are left to RL. The after-crop prompts are the conversation the multi-turn rollout
builds (question, "<zoom>", the crop as a user turn), rendered by the same chat template.

CLI::

    python -m data_tools.zoom_warmup --out DIR [--base artifacts/tiny-vl] [--steps 200] [--seed 0]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForImageTextToText

from data_tools.make_tiny_model import MAX_PROMPT_TOKENS, build_vl_model
from data_tools.synth_shapes import COLOURS, format_answer, render_blocks, zoom_box, zoom_row
from data_tools.tiny_warmup import copy_base, parse_answer, sft_batch, warm_up_and_save, warmup_cli
from vlrft.data.encoding import PromptEncoder

ZOOM = "<zoom>"
ZOOMED = "Zoomed in on the centre mark."  # the example environment's observation text
PIXELS = 28 * 28  # the example's data.min_pixels = data.max_pixels: one image token
# Mostly asking: with half and half, chance drift took the policy to answering at once
# (equally rewarded, 25%) within 10 steps, before it could learn to read a crop.
ASK_RATE = 0.8


def zoom_prompts(encoder, rng: np.random.Generator, n: int, image_dir: Path) -> tuple[list, list]:
    """``n`` first-turn prompts and ``n`` after-crop prompts on fresh random images."""
    first, after = [], []
    for i in range(n):
        colour = COLOURS[int(rng.integers(len(COLOURS)))]
        full, crop = image_dir / f"{i}.png", image_dir / f"{i}-crop.png"
        image = render_blocks(colour, rng)
        image.save(full, compress_level=0)
        image.crop(zoom_box()).save(crop, compress_level=0)
        row = zoom_row(f"zoom-warmup-{i}", str(full), colour, str(full))
        first.append(encoder.encode(row, i))
        row["messages"] += [{"role": "assistant", "content": ZOOM},
                            {"role": "user", "content": [{"type": "image", "image": str(crop)}, {"type": "text", "text": ZOOMED}]}]
        after.append(encoder.encode(row, i))
    return first, after


def random_answers(rng: np.random.Generator, n: int) -> list[str]:
    return [format_answer(COLOURS[int(k)]) for k in rng.integers(len(COLOURS), size=n)]


@torch.no_grad()
def turn_rates(model, tokenizer, first: list, after: list) -> dict:
    """Greedy-free check of the format: sampled first turns that ask / answer, and sampled
    after-crop turns that answer."""
    def sample(prompts):
        inputs = sft_batch(tokenizer, prompts)
        out = model.generate(**inputs, max_new_tokens=8, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    torch.manual_seed(0)
    first_turns, after_turns = sample(first), sample(after)
    return {"first_asks": sum(t.strip() == ZOOM for t in first_turns) / len(first),
            "first_answers": sum(parse_answer(t) in COLOURS for t in first_turns) / len(first),
            "after_answers": sum(parse_answer(t) in COLOURS for t in after_turns) / len(after)}


def build_zoom_model(out_dir, base=None, steps: int = 200, seed: int = 0, batch_size: int = 32, lr: float = 2e-3) -> Path:
    out_dir = copy_base(out_dir, base, build_vl_model, seed)
    encoder = PromptEncoder(str(out_dir), PIXELS, PIXELS, MAX_PROMPT_TOKENS)
    model = AutoModelForImageTextToText.from_pretrained(out_dir, dtype=torch.float32)
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="zoom_warmup_") as tmp:

        def make_batch() -> dict:
            first, after = zoom_prompts(encoder, rng, batch_size // 2, Path(tmp))
            asks = [ZOOM if ask else answer for ask, answer in zip(rng.random(len(first)) < ASK_RATE, random_answers(rng, len(first)))]
            return sft_batch(encoder.tokenizer, first + after, asks + random_answers(rng, len(after)))

        def check() -> dict:
            return turn_rates(model, encoder.tokenizer, *zoom_prompts(encoder, np.random.default_rng(seed + 1), 64, Path(tmp)))

        return warm_up_and_save(model, make_batch, steps, lr, seed, check, "zoom", out_dir)


def main(argv=None) -> None:
    warmup_cli(argv, __doc__.split("\n")[0], build_zoom_model, 200, "VL")


if __name__ == "__main__":
    main()
