"""Images sent to the reward server (vlrft/rewards/wire.py): what a small body may not make the
server do. Text chunks a PNG carries are inflated by Pillow as it reads the header (up to 64 MiB
an image); a progressive JPEG's scans are each a pass over the whole image; a thousand 1x1
images cost memory per image, not per pixel."""

from __future__ import annotations

import base64
import io
import struct
import tracemalloc
import zlib

import pytest
from PIL import Image

from vlrft.data.images import MAX_JPEG_SCANS
from vlrft.rewards.wire import MIN_IMAGE_PIXELS, PixelLimitError, decode_samples


def png_bytes(size=(1, 1)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def with_text_chunks(png: bytes, chunks: int, inflated_bytes: int) -> bytes:
    """`png` with `chunks` zTXt chunks (before its pixels), each inflating to `inflated_bytes`."""
    payload = zlib.compress(b"A" * inflated_bytes, 9)
    extra = b""
    for i in range(chunks):
        data = b"k%d\x00\x00" % i + payload
        extra += struct.pack(">I", len(data)) + b"zTXt" + data + struct.pack(">I", zlib.crc32(b"zTXt" + data))
    end_of_header = 8 + 25  # signature, IHDR
    return png[:end_of_header] + extra + png[end_of_header:]


def sample(*images: bytes) -> dict:
    return {"id": "s", "images": [{"png_base64": base64.b64encode(raw).decode()} for raw in images]}


def test_text_chunks_are_dropped_as_each_image_is_read():
    """Ten images of ten 1 MiB text chunks each: kept, they would be 100 MiB at once."""
    bomb = with_text_chunks(png_bytes(), chunks=10, inflated_bytes=2**20 - 1)
    assert len(bomb) < 20_000
    tracemalloc.start()
    try:
        decoded = decode_samples([sample(*[bomb] * 10)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    image = decoded[0]["images"][0]
    assert image.size == (1, 1) and image.info == {}
    assert peak < 40 * 2**20, f"{peak / 2**20:.0f} MiB at the peak"


def test_a_jpeg_of_too_many_scans_is_refused_before_decoding():
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 0, 0)).save(buffer, format="JPEG", progressive=True)
    good = buffer.getvalue()
    decode_samples([sample(good)])  # a progressive JPEG as encoders write it: some ten scans
    bomb = good[:-2] + b"\xff\xda" * (MAX_JPEG_SCANS + 1) + good[-2:]  # scan starts before the end marker
    with pytest.raises(PixelLimitError, match=f"more than {MAX_JPEG_SCANS} scans"):
        decode_samples([sample(bomb)])


def test_each_image_counts_at_least_its_floor_of_pixels():
    tiny = png_bytes()
    limit = 100 * MIN_IMAGE_PIXELS
    decode_samples([sample(*[tiny] * 100)], max_request_pixels=limit)
    with pytest.raises(PixelLimitError, match="--max-request-pixels"):
        decode_samples([sample(*[tiny] * 101)], max_request_pixels=limit)


def test_pixel_data_that_does_not_decode_is_reported_from_the_worker():
    """The server decodes images where the recipe runs (its worker, under the call's limit);
    pixel data that does not decode comes back as a wire error, which the server answers 422."""
    from vlrft.rewards.server_pool import decode_and_run
    from vlrft.rewards.wire import check_samples

    noise = Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48)
    buffer = io.BytesIO()
    noise.save(buffer, format="PNG")
    raw = buffer.getvalue()
    checked = check_samples([sample(raw[: len(raw) // 2])])  # the header reads; the pixels do not
    kind, message = decode_and_run("exact_match", ["<answer>x</answer>"], [{**checked[0], "answer": "x"}], {})
    assert kind == "wire" and "sample 0 image 0: cannot decode" in message
    checked = check_samples([{**sample(raw), "answer": "x"}])
    assert decode_and_run("exact_match", ["<answer>x</answer>"], checked, {}) == ("scores", [1.0])
