"""Decoding an image from a data set: the formats read, and the work one file may cost.

An image in a data set is a stranger's file, decoded at every draw of its prompt. Pillow reads
some thirty formats, a few of them with slow decoders (FITS's gzip runs a Python loop per
pixel); only IMAGE_FORMATS are opened, the formats data sets use. The reward server takes the
same list (rewards/wire.py). A decoder's work then follows the image's pixels, which PIL's
`Image.MAX_IMAGE_PIXELS` bounds, but for progressive JPEG: each scan is another pass over the
whole image, and a scan can be a few bytes, so a file of a few hundred KiB can make the decoder
walk a 64-megapixel image thousands of times. A JPEG with more than MAX_JPEG_SCANS scans is
refused before its pixels are decoded.
"""

from __future__ import annotations

import contextlib
import math
import warnings

from PIL import Image, UnidentifiedImageError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # Pillow's names; fewer decoders, less to attack
# Encoders write 10 scans for a colour progressive JPEG (libjpeg's and mozjpeg's default
# scripts; 6 for grey), 3 or 4 for baseline with separate components; libjpeg-turbo's own tools
# refuse over 500. 100 is ten times what encoders write and keeps the worst case near twice a
# baseline decode (docs/datasets.md, "Images").
MAX_JPEG_SCANS = 100
_READ_BYTES = 1 << 20
SOS = b"\xff\xda"  # a scan's start marker


def load_rgb_image(source, max_pixels: int | None = None) -> Image.Image:
    """An RGB PIL image from a path or a binary file object (fully read, file closed).

    Only IMAGE_FORMATS are read; a JPEG of more than MAX_JPEG_SCANS scans and an image over
    PIL's decompression-bomb limit (`Image.MAX_IMAGE_PIXELS`) raise instead of decoding. With
    `max_pixels`, an image of 4x that or more is first shrunk by an integer box filter to
    between 1x and 2.25x `max_pixels`, so the image processor (which resizes into
    `[min_pixels, max_pixels]` anyway) never holds a full-size float copy of a huge photo.
    """
    with opened(source) as img:
        if img.format in ("JPEG", "MPO"):  # MPO: a JPEG holding more pictures (cameras' stereo shots)
            scans = jpeg_scans(img.fp)
            if scans > MAX_JPEG_SCANS:
                raise ValueError(f"a JPEG of {scans} scans, over {MAX_JPEG_SCANS}; refused before decoding")
        rgb = img.convert("RGB")  # first: `reduce` does not take every mode (palette, 1-bit)
    return shrunk(rgb, max_pixels)


def shrunk(rgb: Image.Image, max_pixels: int | None) -> Image.Image:
    """`rgb` reduced by `reduction`'s factor."""
    factor = reduction(*rgb.size, max_pixels)
    return rgb.reduce(factor) if factor >= 2 else rgb


def loaded_size(source, max_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) of what `load_rgb_image(source, max_pixels)` returns, from the header
    alone: nothing decoded."""
    with opened(source) as img:
        width, height = img.size
    factor = reduction(width, height, max_pixels)
    return (-(-width // factor), -(-height // factor)) if factor >= 2 else (width, height)  # reduce rounds up


@contextlib.contextmanager
def opened(source):
    """The image, opened lazily (its header read) if it is of IMAGE_FORMATS and within PIL's
    decompression-bomb limit; closed after."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(source, formats=IMAGE_FORMATS)
        except UnidentifiedImageError:
            raise UnidentifiedImageError(f"cannot identify image file as {', '.join(IMAGE_FORMATS[:-1])} or "
                                         f"{IMAGE_FORMATS[-1]}, the image formats read") from None
        with img:
            yield img


def reduction(width: int, height: int, max_pixels: int | None) -> int:
    """The integer factor an image of 4x `max_pixels` or more is reduced by, to between 1x and
    2.25x `max_pixels`; 1 (none) below that."""
    return math.isqrt(width * height // max_pixels) if max_pixels else 1


def jpeg_scans(fp) -> int:
    """How many scans a JPEG file holds at most: its scan-start markers (FF DA), counted over
    the whole file. In the compressed data an FF byte is always followed by 00 or a marker, so
    every FF DA there starts a scan; one inside metadata (an EXIF thumbnail's own scan) only
    counts extra. The file's position is kept."""
    position = fp.tell()
    fp.seek(0)
    count, tail = 0, b""
    while chunk := fp.read(_READ_BYTES):
        block = tail + chunk
        count += block.count(SOS)
        tail = block[-1:]  # a marker split between two reads is counted in the next block
    fp.seek(position)
    return count
