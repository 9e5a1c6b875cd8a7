"""The reward server's JSON wire format: samples with PIL images <-> JSON-safe dicts."""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

# What a sender may put under "png_base64" (our client sends PNG): the formats data sets' images
# are read in, one list for both.
from vlrft.data.image_headers import sanitized
from vlrft.data.images import IMAGE_FORMATS

# Each image counts at least this many pixels toward a request's pixel limit: a request of
# thousands of 1x1 images costs memory per image object, not per pixel. Each step of its
# structure walked (a PNG chunk, a JPEG segment: vlrft.data.image_headers) counts this many
# more: a small image of 16,000 empty chunks costs its walks, not its pixels.
MIN_IMAGE_PIXELS = 64 * 64
STRUCTURE_STEP_PIXELS = 256


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
            item["images"] = [encode_image(img) for img in item["images"]]
        out.append(item)
    return out


def decode_samples(samples: list[dict], max_image_pixels: int | None = None,
                   max_request_pixels: int | None = None) -> list[dict]:
    """The inverse of encode_samples: images back to RGB PIL images (check_samples, then
    decode_checked)."""
    return decode_checked(check_samples(samples, max_image_pixels, max_request_pixels))


def check_samples(samples: list[dict], max_image_pixels: int | None = None,
                  max_request_pixels: int | None = None) -> list[dict]:
    """The samples with each image's header read and checked, none of them decoded: each image
    becomes a CheckedImage (its bytes and size), by `check_images`."""
    for i, sample in enumerate(samples):
        if not isinstance(sample.get("images", []), list):
            raise WireError(f"sample {i}: 'images' must be a list")
    checked = check_images([(f"sample {i}", s.get("images", [])) for i, s in enumerate(samples)],
                           max_image_pixels, max_request_pixels)
    return [{**s, "images": images} if "images" in s else dict(s) for s, images in zip(samples, checked)]


def check_images(groups: list[tuple[str, list]], max_image_pixels: int | None = None,
                 max_request_pixels: int | None = None) -> list[list[CheckedImage]]:
    """Each (name, encoded images) group's images as CheckedImages, in order: the header of
    each read and checked, none decoded. An image (or all of them together) over a pixel limit
    is refused before any is decoded: a 78 KB PNG can declare a quarter of a gigabyte of
    pixels. Each image counts at least MIN_IMAGE_PIXELS (and STRUCTURE_STEP_PIXELS a step of
    its structure), and the request's total is checked at each image. Each image is cut down to
    its pixels before Pillow opens it (a PNG's metadata chunks, a JPEG's APPn segments left
    out), and one whose structure would cost too much is refused (vlrft.data.image_headers).
    Errors name the group and image ("sample 3 image 1")."""
    out, total = [], 0
    for name, images in groups:
        checked = []
        for k, image in enumerate(images):
            checked.append(_open(image, f"{name} image {k}", max_image_pixels))
            total += checked[-1].cost
            if max_request_pixels is not None and total > max_request_pixels:
                raise PixelLimitError(f"the request's images hold over {max_request_pixels} pixels "
                                      f"(--max-request-pixels), {total} by {name} image {k}")
        out.append(checked)
    return out


def decode_checked(samples: list[dict]) -> list[dict]:
    """check_samples' output with every image decoded to RGB (WireError for pixel data that
    does not decode). The server runs this where its recipe runs: in a worker process that its
    timeout kills, so a slow decode costs only its own request."""
    out = []
    for i, sample in enumerate(samples):
        item = dict(sample)
        if "images" in item:
            item["images"] = decode_images(item["images"], f"sample {i}")
        out.append(item)
    return out


def decode_images(images: list[CheckedImage], name: str) -> list[Image.Image]:
    """`check_images`' images of group `name`, decoded to RGB (WireError naming the image)."""
    return [_decode(img, f"{name} image {k}") for k, img in enumerate(images)]


def encode_image(image: Image.Image) -> dict:
    """An image as the wire carries it: {"png_base64": ...} (lossless: the same pixels arrive)."""
    return {"png_base64": _png(image)}


def _png(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@dataclass(frozen=True)
class CheckedImage:
    """An image whose header passed the checks: its bytes and size (the parsed image is not
    kept: its metadata, inflated, is dropped with it)."""

    raw: bytes  # cut down to its pixels (image_headers.sanitized)
    width: int
    height: int
    steps: int = 0  # of its structure, walked

    @property
    def cost(self) -> int:
        """What it counts toward a request's pixel limit."""
        return max(self.width * self.height, MIN_IMAGE_PIXELS) + self.steps * STRUCTURE_STEP_PIXELS


def _open(encoded, where: str, max_pixels: int | None) -> CheckedImage:
    """The image's header read and its size checked; nothing of it kept but its bytes."""
    if not isinstance(encoded, dict) or not isinstance(encoded.get("png_base64"), str):
        raise WireError(f"{where}: must be {{'png_base64': str}}")
    try:
        raw = base64.b64decode(encoded["png_base64"], validate=True)
    except (binascii.Error, ValueError) as err:  # (non-ASCII text is a ValueError)
        raise WireError(f"{where}: png_base64 is not valid base64 ({err})") from None
    try:
        raw, steps = sanitized(raw)
    except ValueError as err:  # a structure that would cost more than its pixels
        raise PixelLimitError(f"{where}: {err}") from None
    with _opened(raw, where) as image:
        width, height = image.width, image.height
    if max_pixels is not None and width * height > max_pixels:
        raise PixelLimitError(f"{where}: {width}x{height} is over the limit of {max_pixels} pixels (--max-image-pixels)")
    return CheckedImage(raw, width, height, steps)


def _opened(raw: bytes, where: str) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise PixelLimitError(f"{where}: {err}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise WireError(f"{where}: not a {'/'.join(IMAGE_FORMATS)} image ({err})") from None


def _decode(checked: CheckedImage, where: str) -> Image.Image:
    with _opened(checked.raw, where) as image:
        try:
            rgb = image.convert("RGB")
        except (OSError, ValueError, SyntaxError) as err:  # truncated or corrupt pixel data
            raise WireError(f"{where}: cannot decode ({err})") from None
    rgb.info.clear()  # metadata (a JPEG's APP segments): not kept with the pixels
    return rgb
