"""Seeded synthetic tasks written in the canonical vlrft dataset schema.

A JSONL row looks like::

    {"id": "color_shapes-train-00000",
     "messages": [{"role": "user", "content": [
         {"type": "image", "image": "images/train_00000.png"},
         {"type": "text", "text": COLOUR_QUESTION}]}],
     "answer": "red", "data_source": "color_shapes", "meta": {...}}

Image paths are relative to the directory holding the JSONL file, so a dataset
directory can be moved or copied as a unit.

Six tasks:
  * ``colors``   - "what colour is the shape?" on a rendered image (needs vision;
                   chance = 1/len(COLOURS) = 25%).
  * ``left_right`` - two shapes of different colours side by side; "what colour is the shape
                   on the left?" (or right). Needs the spatial relation and the question: a
                   policy that answers any colour in the image is right half the time.
  * ``bigger``   - two shapes of different colours and clearly different sizes, the big one on
                   either side; "what colour is the bigger shape?" (a size relation; again 0.5
                   for a policy that answers any colour in the image).
  * ``addition`` - small addition (operands 0..4, sums balanced), text only (a cheap sanity
                   task; chance = 1/9).
  * ``zoom``     - a 7 x 7 grid of coloured blocks with a small mark at the centre; "what
                   colour is the centre mark?". Shrunk to the example's 28 x 28 pixels the
                   mark is lost: the policy asks the environment for a crop (multi-turn;
                   examples/zoom).
  * ``product``  - "what is 37 * 52?" over two-digit operands, text only; test pairs are not
                   train pairs. A tiny policy answers it with the calculator tool (multi-turn;
                   examples/calculator).

CLI::

    python -m data_tools.synth_shapes --task colors|left_right|bigger|addition|zoom|product --out DIR \
        [--n-train 2000] [--n-test 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLOURS = ("red", "green", "blue", "yellow")
SHAPES = ("circle", "square", "triangle")
COLOUR_QUESTION = "What colour is the shape? Answer as <answer>colour</answer>."

COLOR_SOURCE = "color_shapes"
LEFT_RIGHT_SOURCE = "left_right"
BIGGER_SOURCE = "bigger_shape"
BIGGER_QUESTION = "What colour is the bigger shape? Answer as <answer>colour</answer>."
SIDES = ("left", "right")
ADDITION_SOURCE = "addition"

# Base RGB per colour. Jitter (below) stays well inside the "obviously this colour"
# region so the label is never ambiguous, even after the mild background noise.
_BASE_RGB = {
    "red": (215, 40, 40),
    "green": (40, 165, 60),
    "blue": (40, 70, 215),
    "yellow": (230, 205, 35),
}
_COLOUR_JITTER = 15


def addition_question(a: int, b: int) -> str:
    return f"What is {a} + {b}? Answer as <answer>number</answer>."


def format_answer(x) -> str:
    """The answer format every task (and the tiny model's warm-up) uses."""
    return f"<answer>{x}</answer>"


# --------------------------------------------------------------------------- images


def render_shape(colour: str, shape: str, rng: np.random.Generator, size: int = 56, side: int | None = None) -> Image.Image:
    """One filled ``shape`` in ``colour`` on a noisy light-grey background (RGB, size x size).

    Position, size, exact RGB and background shading are random (drawn from ``rng``)
    so a policy cannot memorise pixels, but the colour is always unambiguous. ``side`` fixes
    the shape's side length in pixels instead of drawing it.
    """
    if colour not in _BASE_RGB:
        raise ValueError(f"unknown colour {colour!r}; expected one of {COLOURS}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")

    # Background: light grey with a random linear shade plus per-pixel noise.
    grey = rng.uniform(195, 225)
    ramp = np.linspace(-1.0, 1.0, size)
    gx, gy = rng.uniform(-8, 8, size=2)
    shade = grey + gx * ramp[None, :] + gy * ramp[:, None]
    bg = shade[:, :, None] + rng.normal(0.0, 4.0, size=(size, size, 3))
    img = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8), "RGB")

    # Shape: 40-70% of the image side, placed fully inside with a small margin.
    if side is None:
        side = int(rng.integers(int(0.4 * size), int(0.7 * size) + 1))
    margin = 2
    x0 = int(rng.integers(margin, size - side - margin + 1))
    y0 = int(rng.integers(margin, size - side - margin + 1))
    box = (x0, y0, x0 + side - 1, y0 + side - 1)
    fill = tuple(
        int(np.clip(c + rng.integers(-_COLOUR_JITTER, _COLOUR_JITTER + 1), 0, 255)) for c in _BASE_RGB[colour]
    )

    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:  # triangle, apex up
        draw.polygon([(x0 + side / 2, y0), (x0, y0 + side - 1), (x0 + side - 1, y0 + side - 1)], fill=fill)
    return img


# --------------------------------------------------------------------------- rows


def colour_row(row_id: str, image_path: str, colour: str, shape: str) -> dict:
    """A colour-question row; ``image_path`` must be relative to the JSONL's directory."""
    return {
        "id": row_id,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": image_path},
                    {"type": "text", "text": COLOUR_QUESTION},
                ],
            }
        ],
        "answer": colour,
        "data_source": COLOR_SOURCE,
        "meta": {"colour": colour, "shape": shape},
    }


def side_question(side: str) -> str:
    return f"What colour is the shape on the {side}? Answer as <answer>colour</answer>."


def render_pair(left: str, right: str, rng: np.random.Generator, size: int = 56) -> Image.Image:
    """Two shapes side by side (a ``2 size`` x ``size`` image): ``left`` in the left half,
    ``right`` in the right half, each a random shape placed at random inside its half."""
    image = Image.new("RGB", (2 * size, size))
    for slot, colour in enumerate((left, right)):
        image.paste(render_shape(colour, SHAPES[int(rng.integers(len(SHAPES)))], rng, size), (slot * size, 0))
    return image


def render_big_small(big: str, small: str, big_left: bool, rng: np.random.Generator, size: int = 56) -> Image.Image:
    """A ``2 size`` x ``size`` image: a big shape (80-90% of the half's side) and a small one
    (30-40%) of other colours, the big one in the half ``big_left`` says."""
    image = Image.new("RGB", (2 * size, size))
    sides = {big: int(rng.integers(int(0.8 * size), int(0.9 * size) + 1)), small: int(rng.integers(int(0.3 * size), int(0.4 * size) + 1))}
    for slot, colour in enumerate((big, small) if big_left else (small, big)):
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        image.paste(render_shape(colour, shape, rng, size, side=sides[colour]), (slot * size, 0))
    return image


def image_question_row(row_id: str, image_path: str, question: str, answer: str, source: str, meta: dict) -> dict:
    return {
        "id": row_id,
        "messages": [{"role": "user", "content": [
            {"type": "image", "image": image_path}, {"type": "text", "text": question}]}],
        "answer": answer,
        "data_source": source,
        "meta": meta,
    }


def left_right_row(row_id: str, image_path: str, side: str, left: str, right: str) -> dict:
    answer = left if side == "left" else right
    meta = {"side": side, "left": left, "right": right}
    return image_question_row(row_id, image_path, side_question(side), answer, LEFT_RIGHT_SOURCE, meta)


# Operands 0..4: sums 0..8 are single tokens, so a tiny model's RL signal is dense enough to
# learn from in minutes on a CPU (with 0..9, 5% of random answers are right and 150 steps
# of GRPO did not move the tiny model off predicting the most common sum).
ADDITION_OPERANDS = range(5)
ADDITION_ANSWERS = tuple(range(2 * ADDITION_OPERANDS[-1] + 1))


def addition_row(row_id: str, a: int, b: int) -> dict:
    return {
        "id": row_id,
        "messages": [{"role": "user", "content": [{"type": "text", "text": addition_question(a, b)}]}],
        "answer": str(a + b),
        "data_source": ADDITION_SOURCE,
        "meta": {"a": a, "b": b},
    }


def balanced_colours(n: int, rng: np.random.Generator) -> list[str]:
    """``n`` colours, each appearing n // 4 or n // 4 + 1 times, in random order."""
    colours = [COLOURS[i % len(COLOURS)] for i in range(n)]
    order = rng.permutation(n)
    return [colours[i] for i in order]


def balanced_sum_pairs(n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """``n`` operand pairs whose sums are balanced over ADDITION_ANSWERS (each n // 9 or
    n // 9 + 1 times), in random order. Uniform operands would make the sum triangular, with 4
    right for 20% of the prompts: a tiny policy that ignores the operands and always says 4 then
    beats every other guess and GRPO settles there (measured: held-out accuracy 0.22 -> 0.18
    over 150 steps). With balanced sums no constant answer pays, and the same example run
    reaches 0.9-1.0 (examples/addition)."""
    top = ADDITION_OPERANDS[-1]
    sums = [ADDITION_ANSWERS[i % len(ADDITION_ANSWERS)] for i in rng.permutation(n)]
    firsts = [int(rng.integers(max(0, s - top), min(top, s) + 1)) for s in sums]
    return [(a, s - a) for a, s in zip(firsts, sums)]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _split_rngs(seed: int) -> dict[str, np.random.Generator]:
    # Independent streams per split: changing n_train does not change the test set.
    train, test = np.random.SeedSequence(seed).spawn(2)
    return {"train": np.random.default_rng(train), "test": np.random.default_rng(test)}


def _write_image_task(out_dir, n_train: int, n_test: int, seed: int, make_row) -> Path:
    """``train.jsonl``, ``test.jsonl`` and ``images/*.png`` under ``out_dir``: row i of a split
    is ``make_row(row_id, image_path, answer, rng)`` with answers balanced over COLOURS; it saves
    its image at ``out_dir / image_path``."""
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rngs = _split_rngs(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        rng = rngs[split]
        rows = [
            make_row(f"{split}-{i:05d}", f"images/{split}_{i:05d}.png", colour, rng)
            for i, colour in enumerate(balanced_colours(n, rng))
        ]
        _write_jsonl(out_dir / f"{split}.jsonl", rows)
    return out_dir


def write_colour_task(out_dir, n_train: int = 2000, n_test: int = 200, seed: int = 0) -> Path:
    """The colour task: one random shape per image, 56 x 56."""
    out_dir = Path(out_dir)

    def make_row(row_id: str, rel: str, colour: str, rng: np.random.Generator) -> dict:
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        render_shape(colour, shape, rng).save(out_dir / rel)
        return colour_row(f"{COLOR_SOURCE}-{row_id}", rel, colour, shape)

    return _write_image_task(out_dir, n_train, n_test, seed, make_row)


def write_left_right_task(out_dir, n_train: int = 2000, n_test: int = 200, seed: int = 0) -> Path:
    """The two-shape relation task: answers balanced over colours, sides alternating, the other
    shape always another colour; images 112 x 56 (within the demo's pixel bounds, no resize)."""
    out_dir = Path(out_dir)
    sides = iter(SIDES * (n_train + n_test))  # alternates through both splits: balanced sides

    def make_row(row_id: str, rel: str, answer: str, rng: np.random.Generator) -> dict:
        side = next(sides)
        other = [c for c in COLOURS if c != answer][int(rng.integers(len(COLOURS) - 1))]
        left, right = (answer, other) if side == "left" else (other, answer)
        render_pair(left, right, rng).save(out_dir / rel)
        return left_right_row(f"{LEFT_RIGHT_SOURCE}-{row_id}", rel, side, left, right)

    return _write_image_task(out_dir, n_train, n_test, seed, make_row)


def write_bigger_task(out_dir, n_train: int = 2000, n_test: int = 200, seed: int = 0) -> Path:
    """The size-relation task: answers balanced over colours, the big shape on either side at
    random, the small one another colour; images 112 x 56."""
    out_dir = Path(out_dir)

    def make_row(row_id: str, rel: str, answer: str, rng: np.random.Generator) -> dict:
        small = [c for c in COLOURS if c != answer][int(rng.integers(len(COLOURS) - 1))]
        big_left = bool(rng.integers(2))
        render_big_small(answer, small, big_left, rng).save(out_dir / rel)
        meta = {"big": answer, "small": small, "big_side": "left" if big_left else "right"}
        return image_question_row(f"{BIGGER_SOURCE}-{row_id}", rel, BIGGER_QUESTION, answer, BIGGER_SOURCE, meta)

    return _write_image_task(out_dir, n_train, n_test, seed, make_row)


def write_addition_task(out_dir, n_train: int = 2000, n_test: int = 200, seed: int = 0) -> Path:
    """Small addition (a, b in ADDITION_OPERANDS, sums balanced, answer str(a + b)); text only."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rngs = _split_rngs(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        rng = rngs[split]
        pairs = balanced_sum_pairs(n, rng)
        rows = [addition_row(f"{ADDITION_SOURCE}-{split}-{i:05d}", a, b) for i, (a, b) in enumerate(pairs)]
        _write_jsonl(out_dir / f"{split}.jsonl", rows)
    return out_dir


PRODUCT_SOURCE = "product"
PRODUCT_OPERANDS = range(10, 100)


def product_question(a: int, b: int) -> str:
    return f"What is {a} * {b}? Call the calculator, or answer as <answer>number</answer>."


def product_row(row_id: str, a: int, b: int) -> dict:
    return {
        "id": row_id,
        "messages": [{"role": "user", "content": [{"type": "text", "text": product_question(a, b)}]}],
        "answer": str(a * b),
        "data_source": PRODUCT_SOURCE,
        "meta": {"a": a, "b": b},
    }


def write_product_task(out_dir, n_train: int = 2000, n_test: int = 200, seed: int = 0) -> Path:
    """Products of two-digit numbers (examples/calculator), text only; no test pair is a train
    pair, so a policy cannot answer held-out rows from memory."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pairs = [(a, b) for a in PRODUCT_OPERANDS for b in PRODUCT_OPERANDS]
    if n_train + n_test > len(pairs):
        raise ValueError(f"the product task has {len(pairs)} operand pairs; asked for {n_train} + {n_test} rows")
    order = np.random.default_rng(seed).permutation(len(pairs))
    for split, picked in (("test", order[:n_test]), ("train", order[n_test : n_test + n_train])):
        rows = [product_row(f"{PRODUCT_SOURCE}-{split}-{i:05d}", *pairs[k]) for i, k in enumerate(picked)]
        _write_jsonl(out_dir / f"{split}.jsonl", rows)
    return out_dir


ZOOM_SOURCE = "zoom"
ZOOM_QUESTION = "What colour is the centre mark? Say <zoom> to see it closer, or answer as <answer>colour</answer>."
ZOOM_GRID, ZOOM_BLOCK, ZOOM_MARK = 7, 32, 8  # 224 x 224 images: 7 x 7 blocks, an 8-pixel mark at the centre


def render_blocks(mark: str, rng: np.random.Generator) -> Image.Image:
    """A ZOOM_GRID x ZOOM_GRID grid of blocks of random COLOURS (jittered RGB) with a small
    square mark of colour ``mark`` at the centre. Shrunk 8 times (28 x 28 pixels) the mark is a
    quarter of four pixels, one in the corner of each of the four patches; cropped
    (``zoom_box``) it fills the image."""
    img = Image.new("RGB", (ZOOM_GRID * ZOOM_BLOCK,) * 2)
    draw = ImageDraw.Draw(img)

    def fill(colour: str) -> tuple:
        return tuple(int(np.clip(c + rng.integers(-_COLOUR_JITTER, _COLOUR_JITTER + 1), 0, 255)) for c in _BASE_RGB[colour])

    for row in range(ZOOM_GRID):
        for col in range(ZOOM_GRID):
            box = (col * ZOOM_BLOCK, row * ZOOM_BLOCK, (col + 1) * ZOOM_BLOCK - 1, (row + 1) * ZOOM_BLOCK - 1)
            draw.rectangle(box, fill=fill(COLOURS[int(rng.integers(len(COLOURS)))]))
    left, top, right, bottom = zoom_box()
    draw.rectangle((left, top, right - 1, bottom - 1), fill=fill(mark))
    return img


def zoom_box() -> tuple[int, int, int, int]:
    """The centre mark's (left, top, right, bottom) in a ``render_blocks`` image."""
    start = (ZOOM_GRID * ZOOM_BLOCK - ZOOM_MARK) // 2
    return (start, start, start + ZOOM_MARK, start + ZOOM_MARK)


def zoom_row(row_id: str, image_path: str, colour: str, full_image: str) -> dict:
    """A centre-mark question; ``meta.full_image`` is the image's absolute path (the zoom
    environment crops the full-resolution file, not the shrunk prompt image)."""
    row = colour_row(row_id, image_path, colour, "square")
    row["messages"][0]["content"][1]["text"] = ZOOM_QUESTION
    return row | {"data_source": ZOOM_SOURCE, "meta": {"colour": colour, "full_image": full_image, "zoom_box": list(zoom_box())}}


def write_zoom_task(out_dir, n_train: int = 2000, n_test: int = 200, seed: int = 0) -> Path:
    """The zoom task (examples/zoom): the centre mark's colour, readable only in a crop."""
    out_dir = Path(out_dir).resolve()

    def make_row(row_id: str, rel: str, colour: str, rng: np.random.Generator) -> dict:
        render_blocks(colour, rng).save(out_dir / rel)
        return zoom_row(f"{ZOOM_SOURCE}-{row_id}", rel, colour, str(out_dir / rel))

    return _write_image_task(out_dir, n_train, n_test, seed, make_row)


LONG_VIDEO_SOURCE = "long_video"
LONG_VIDEO_FRAMES = 48  # 224 x 224 each: 24 frame pairs x 64 tokens = 1,536 video tokens a prompt
LONG_VIDEO_QUESTION = "What colour is the shape in the last frame? Answer as <answer>colour</answer>."


def write_long_video_task(out_dir, n_train: int = 2000, n_test: int = 200, seed: int = 0) -> Path:
    """The long-video task (examples/long_video): a clip of LONG_VIDEO_FRAMES frames, each one
    shape of some colour; the answer is the last frame's colour. Thousands of tokens a sample:
    the sequence-parallel example. The frames come from a pool of 8 per colour
    (``frames/COLOUR_K.png``), so the data set stays small on disk."""
    out_dir = Path(out_dir)
    (out_dir / "frames").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pool = {colour: [f"frames/{colour}_{k}.png" for k in range(8)] for colour in COLOURS}
    for colour, paths in pool.items():
        for rel in paths:
            render_shape(colour, SHAPES[int(rng.integers(len(SHAPES)))], rng, size=224).save(out_dir / rel)
    rngs = _split_rngs(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        split_rng = rngs[split]
        rows = []
        for i, colour in enumerate(balanced_colours(n, split_rng)):
            earlier = [COLOURS[int(split_rng.integers(len(COLOURS)))] for _ in range(LONG_VIDEO_FRAMES - 1)]
            frames = [pool[c][int(split_rng.integers(8))] for c in earlier + [colour]]
            rows.append({"id": f"{LONG_VIDEO_SOURCE}-{split}-{i:05d}", "answer": colour, "data_source": LONG_VIDEO_SOURCE,
                         "meta": {"colour": colour}, "messages": [{"role": "user", "content": [
                             {"type": "video", "video": frames, "fps": 2.0}, {"type": "text", "text": LONG_VIDEO_QUESTION}]}]})
        _write_jsonl(out_dir / f"{split}.jsonl", rows)
    return out_dir


TASKS = {
    "colors": write_colour_task,
    "long_video": write_long_video_task,
    "zoom": write_zoom_task,
    "left_right": write_left_right_task,
    "bigger": write_bigger_task,
    "addition": write_addition_task,
    "product": write_product_task,
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), required=True)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-test", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = TASKS[args.task](args.out, args.n_train, args.n_test, args.seed)
    print(f"wrote {args.task}: {args.n_train} train / {args.n_test} test rows to {out}")


if __name__ == "__main__":
    main()
