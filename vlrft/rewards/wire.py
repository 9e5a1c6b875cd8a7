"""The reward server's JSON wire format: samples with PIL images <-> JSON-safe dicts."""

from __future__ import annotations

import base64
import io

from PIL import Image

from vlrft.data.encoding import load_rgb_image

# Fields a remote recipe receives; the rest of a sample (tensors, internal state) stays local.
SAMPLE_FIELDS = ("id", "answer", "data_source", "meta", "messages", "prompt", "images",
                 "response_ids", "response_length", "truncated", "turns", "environment_reward")


def encode_samples(samples: list[dict]) -> list[dict]:
    """JSON-safe copies; each image becomes {"png_base64": ...}."""
    out = []
    for sample in samples:
        item = {k: sample[k] for k in SAMPLE_FIELDS if k in sample}
        if "images" in item:
            item["images"] = [{"png_base64": _png(img)} for img in item["images"]]
        out.append(item)
    return out


def decode_samples(samples: list[dict]) -> list[dict]:
    """The inverse of encode_samples: images back to PIL."""
    out = []
    for sample in samples:
        item = dict(sample)
        if "images" in item:
            item["images"] = [_image(img) for img in item["images"]]
        out.append(item)
    return out


def _png(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _image(encoded: dict) -> Image.Image:
    return load_rgb_image(io.BytesIO(base64.b64decode(encoded["png_base64"])))
