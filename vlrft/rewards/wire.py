"""The reward server's JSON wire format: samples with PIL images <-> JSON-safe dicts."""

from __future__ import annotations

import base64
import binascii
import io
import warnings

from PIL import Image, UnidentifiedImageError

# What a sender may put under "png_base64": our client sends PNG; fewer decoders, less to attack.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


class WireError(ValueError):
    """A sample the server cannot decode; one line naming the sample and image."""


class PixelLimitError(WireError):
    """An image, or a request's images together, over a pixel limit."""

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


def decode_samples(samples: list[dict], max_image_pixels: int | None = None,
                   max_request_pixels: int | None = None) -> list[dict]:
    """The inverse of encode_samples: images back to RGB PIL images. Every image's size is read
    from its header first, so an image (or all of them together) over a pixel limit is refused
    before any is decoded: a 78 KB PNG can declare a quarter of a gigabyte of pixels."""
    opened, total = [], 0
    for i, sample in enumerate(samples):
        images = sample.get("images", [])
        if not isinstance(images, list):
            raise WireError(f"sample {i}: 'images' must be a list")
        headers = [_open(img, f"sample {i} image {k}", max_image_pixels) for k, img in enumerate(images)]
        total += sum(img.width * img.height for img in headers)
        if max_request_pixels is not None and total > max_request_pixels:
            raise PixelLimitError(f"the request's images hold over {max_request_pixels} pixels "
                                  f"(--max-request-pixels), {total} by sample {i}")
        opened.append(headers)
    out = []
    for i, (sample, headers) in enumerate(zip(samples, opened)):
        item = dict(sample)
        if "images" in item:
            item["images"] = [_decode(img, f"sample {i} image {k}") for k, img in enumerate(headers)]
        out.append(item)
    return out


def _png(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _open(encoded, where: str, max_pixels: int | None) -> Image.Image:
    """The image with only its header read, its size checked."""
    if not isinstance(encoded, dict) or not isinstance(encoded.get("png_base64"), str):
        raise WireError(f"{where}: must be {{'png_base64': str}}")
    try:
        raw = base64.b64decode(encoded["png_base64"], validate=True)
    except binascii.Error as err:
        raise WireError(f"{where}: png_base64 is not valid base64 ({err})") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise PixelLimitError(f"{where}: {err}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise WireError(f"{where}: not a {'/'.join(IMAGE_FORMATS)} image ({err})") from None
    if max_pixels is not None and image.width * image.height > max_pixels:
        raise PixelLimitError(f"{where}: {image.width}x{image.height} is over the limit of "
                              f"{max_pixels} pixels (--max-image-pixels)")
    return image


def _decode(image: Image.Image, where: str) -> Image.Image:
    try:
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as err:  # truncated or corrupt pixel data
        raise WireError(f"{where}: cannot decode ({err})") from None
