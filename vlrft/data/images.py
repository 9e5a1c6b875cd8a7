"""Decoding an image from a data set: the formats read, and the work one file may cost.

An image in a data set is a stranger's file, decoded at every draw of its prompt. Pillow reads
some thirty formats, a few of them with slow decoders (FITS's gzip runs a Python loop per
pixel); only IMAGE_FORMATS are opened, the formats data sets use. The reward server takes the
same list (rewards/wire.py). A decoder's work then follows the image's pixels, which PIL's
`Image.MAX_IMAGE_PIXELS` bounds, except where a file's own structure says how much to do
(its size, progressive JPEG scans, a JPEG header of junk, metadata Pillow parses or inflates):
a file is read as bytes and cut down to its pixels before Pillow opens it
(vlrft.data.image_headers).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import warnings

from PIL import Image, UnidentifiedImageError

from vlrft.data.image_headers import read_image_file, sanitized

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # Pillow's names; fewer decoders, less to attack


def load_rgb_image(source, max_pixels: int | None = None) -> Image.Image:
    """An RGB PIL image from a path or a binary file object (fully read, file closed).

    Only IMAGE_FORMATS are read; a file whose structure costs too much (image_headers) and an
    image over PIL's decompression-bomb limit (`Image.MAX_IMAGE_PIXELS`) raise instead of
    decoding. The image keeps no metadata (`info`: text, ICC profile, EXIF). With
    `max_pixels`, an image of 4x that or more is first shrunk by an integer box filter to
    between 1x and 2.25x `max_pixels`, so the image processor (which resizes into
    `[min_pixels, max_pixels]` anyway) never holds a full-size float copy of a huge photo.
    """
    with opened(source) as img:
        return rgb_image(img, max_pixels)


def rgb_image(img: Image.Image, max_pixels: int | None) -> Image.Image:
    """An opened image decoded as `load_rgb_image` returns it."""
    rgb = img.convert("RGB")  # first: `reduce` does not take every mode (palette, 1-bit)
    rgb.info.clear()  # (`convert` copies it: kept, a PNG's text would live as long as its prompt)
    return shrunk(rgb, max_pixels)


def shrunk(rgb: Image.Image, max_pixels: int | None) -> Image.Image:
    """`rgb` reduced by `reduction`'s factor."""
    factor = reduction(*rgb.size, max_pixels)
    return rgb.reduce(factor) if factor >= 2 else rgb


def reduced_size(width: int, height: int, max_pixels: int | None) -> tuple[int, int]:
    """The size `shrunk` leaves an image of `width` x `height`."""
    factor = reduction(width, height, max_pixels)
    return (-(-width // factor), -(-height // factor)) if factor >= 2 else (width, height)  # reduce rounds up


@contextlib.contextmanager
def header_then_pixels(source, max_pixels: int | None = None):
    """The image read once: yields (the size `load_rgb_image` would return, from the header
    alone; a function that decodes it as `load_rgb_image` does), for a caller that checks the
    size before paying for the pixels."""
    with opened(source) as img:
        yield reduced_size(*img.size, max_pixels), lambda: rgb_image(img, max_pixels)


@contextlib.contextmanager
def opened(source):
    """The image (a path or a binary file object), read whole within image_headers' limits, cut
    down to its pixels and opened lazily (its header read) if it is of IMAGE_FORMATS and within
    PIL's decompression-bomb limit; closed after."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as file:
            raw = read_image_file(file)
    else:
        raw = read_image_file(source)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(sanitized(raw)[0]), formats=IMAGE_FORMATS)
        except UnidentifiedImageError:
            raise UnidentifiedImageError(f"cannot identify image file as {', '.join(IMAGE_FORMATS[:-1])} or "
                                         f"{IMAGE_FORMATS[-1]}, the image formats read") from None
        with img:
            yield img


def reduction(width: int, height: int, max_pixels: int | None) -> int:
    """The integer factor an image of 4x `max_pixels` or more is reduced by, to between 1x and
    2.25x `max_pixels`; 1 (none) below that."""
    return math.isqrt(width * height // max_pixels) if max_pixels else 1
