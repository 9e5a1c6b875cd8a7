"""Prompt encoding: chat messages (with image parts) -> chat template -> token ids + pixel inputs.

Only this module and the model loader know the model family's conventions. Images are loaded
with PIL (or qwen-vl-utils where it imports) and turned into `pixel_values`/`image_grid_thw`
by the checkpoint's own HF image processor, which applies the min/max-pixel resize rule. The
tokenizer + image processor are used directly (not an AutoProcessor) because processor
classes that insist on a video processor need torchvision.
"""

from __future__ import annotations

import io
import math
import warnings
from pathlib import Path

from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer

from vlrft.data.dataset import DataError, image_sources
from vlrft.types import Prompt

IMAGE_PAD = "<|image_pad|>"


def load_rgb_image(source, max_pixels: int | None = None) -> Image.Image:
    """An RGB PIL image from a path or a binary file object (fully read, file closed).

    An image over PIL's decompression-bomb limit (`Image.MAX_IMAGE_PIXELS`) raises instead of
    only warning. With `max_pixels`, an image of 4x that or more is first shrunk by an integer
    box filter to between 1x and 2.25x `max_pixels`, so the image processor (which resizes into
    `[min_pixels, max_pixels]` anyway) never holds a full-size float copy of a huge photo.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(source) as img:
            rgb = img.convert("RGB")  # first: `reduce` does not take every mode (palette, 1-bit)
    factor = math.isqrt(rgb.width * rgb.height // max_pixels) if max_pixels else 1
    return rgb.reduce(factor) if factor >= 2 else rgb


try:  # qwen-vl-utils imports torchvision at import time; use it only where that works.
    from qwen_vl_utils import fetch_image as _qwen_fetch_image
except Exception:  # noqa: BLE001 - any import failure means "not usable here"
    _qwen_fetch_image = None


def json_safe(messages: list[dict]) -> list[dict]:
    """The messages with each image given as bytes replaced by "<image k>" (its place among
    the row's images): recipes and the reward server's JSON see the text, `images` the pixels."""
    k = 0
    out = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            parts = []
            for part in content:
                if part["type"] == "image":
                    if isinstance(part.get("image"), bytes):
                        part = {**part, "image": f"<image {k}>"}
                    k += 1
                parts.append(part)
            content = parts
        out.append({**message, "content": content})
    return out


class PromptEncoder:
    def __init__(self, model_path: str, min_pixels: int, max_pixels: int, max_prompt_tokens: int):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        has_vision = (Path(model_path) / "preprocessor_config.json").is_file()
        self.image_processor = AutoImageProcessor.from_pretrained(model_path) if has_vision else None
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.max_prompt_tokens = max_prompt_tokens

    def load_image(self, source: str | bytes) -> Image.Image:
        """An image from its path or its encoded bytes (parquet and HF data sets)."""
        if isinstance(source, bytes):
            source = load_rgb_image(io.BytesIO(source), max_pixels=self.max_pixels)
            if _qwen_fetch_image is None:
                return source
        if _qwen_fetch_image is not None:
            return _qwen_fetch_image({"image": source, "min_pixels": self.min_pixels, "max_pixels": self.max_pixels})
        return load_rgb_image(source, max_pixels=self.max_pixels)

    def encode(self, row: dict, index: int) -> Prompt:
        """A canonical dataset row -> Prompt (its image parts' files are loaded here)."""
        where = f"row id {row['id']!r}"
        sources = image_sources(row)
        if sources and self.image_processor is None:
            raise DataError(f"{where} has images but the model checkpoint has no image processor")
        images = []
        for k, source in enumerate(sources):
            try:
                images.append(self.load_image(source))
            except Exception as err:  # noqa: BLE001 - PIL's decoders raise many types (OSError,
                # SyntaxError, ValueError, EOFError, DecompressionBomb*) for a corrupt user file
                name = source if isinstance(source, str) else f"{k} ({len(source)} bytes)"
                raise DataError(f"{where}: cannot read image {name} ({err})") from None
        return self.encode_with_images(row, images, index)

    def encode_with_images(self, row: dict, images: list[Image.Image], index: int) -> Prompt:
        """A row whose image parts are already loaded as `images` (in order) -> Prompt."""
        where = f"row id {row['id']!r}"
        messages = json_safe(row["messages"])
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        mm_inputs = {}
        if images:
            if self.image_processor is None:
                raise DataError(f"{where} has images but the model checkpoint has no image processor")
            size = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
            try:
                mm_inputs = dict(self.image_processor(images=images, size=size, return_tensors="pt"))
            except ValueError as err:  # e.g. smart_resize: "absolute aspect ratio must be smaller than 200"
                raise DataError(f"{where}: cannot use its image ({err})") from None
        expanded = self._expand_image_pads(text, mm_inputs, where, len(images))
        ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        image_pad = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        token_types = [int(t == image_pad) for t in ids] if self.image_processor is not None else []
        if len(ids) > self.max_prompt_tokens:
            raise DataError(f"{where}: prompt has {len(ids)} tokens > data.max_prompt_tokens={self.max_prompt_tokens}")
        return Prompt(
            id=str(row["id"]),
            data_source=row["data_source"],
            answer=row["answer"],
            meta=row["meta"],
            prompt_text=text,
            prompt_ids=ids,
            images=images,
            mm_inputs=mm_inputs,
            mm_token_types=token_types,
            index=index,
            messages=messages,
        )

    def _expand_image_pads(self, text: str, mm_inputs: dict, where: str, n_images: int) -> str:
        """Replace each image's single pad token with one pad per merged patch."""
        pieces = text.split(IMAGE_PAD)
        if len(pieces) - 1 != n_images:
            raise DataError(f"{where}: chat template produced {len(pieces) - 1} image slots for {n_images} images")
        if not n_images:
            return text
        merge = self.image_processor.merge_size**2
        counts = [int(thw.prod()) // merge for thw in mm_inputs["image_grid_thw"]]
        out = pieces[0]
        for count, piece in zip(counts, pieces[1:]):
            out += IMAGE_PAD * count + piece
        return out
