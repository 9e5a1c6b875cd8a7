"""Images sent to the reward server (vlrft/rewards/wire.py): what a small body may not make the
server do. Compressed chunks a PNG carries (zTXt, iTXt, iCCP) are inflated by Pillow as it opens
the file, up to 1 MiB each; a progressive JPEG's scans are each a pass over the whole image; a
thousand 1x1 images cost memory per image, not per pixel."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image, JpegImagePlugin, PngImagePlugin

from vlrft.data.image_headers import (
    MAX_IMAGE_FILE_BYTES,
    MAX_JPEG_HEADER_STEPS,
    MAX_JPEG_SCANS,
    MAX_JPEG_SEGMENTS,
    MAX_PNG_CHUNKS,
    jpeg_without_metadata,
)
from vlrft.data.images import header_then_pixels, load_rgb_image
from vlrft.rewards.wire import MIN_IMAGE_PIXELS, STRUCTURE_STEP_PIXELS, PixelLimitError, check_samples, decode_samples



def header_size(source) -> tuple[int, int]:
    """The size an image's header gives, nothing decoded."""
    with header_then_pixels(source) as (size, _):
        return size

def png_bytes(size=(1, 1)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def with_text_chunks(png: bytes, chunks: int, inflated_bytes: int, kind: bytes = b"zTXt", key: bytes = b"k") -> bytes:
    """`png` with `chunks` chunks of `kind` (zTXt or iCCP, before its pixels), each inflating to
    `inflated_bytes`."""
    payload = zlib.compress(b"A" * inflated_bytes, 9)
    extra = b""
    for i in range(chunks):
        data = (key + b"%d" % i if key else b"") + b"\x00\x00" + payload
        extra += struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    end_of_header = 8 + 25  # signature, IHDR
    return png[:end_of_header] + extra + png[end_of_header:]


def sample(*images: bytes) -> dict:
    return {"id": "s", "images": [{"png_base64": base64.b64encode(raw).decode()} for raw in images]}


@pytest.mark.parametrize("kind, key", [(b"zTXt", b"k"), (b"zTXt", b""), (b"iCCP", b"icc")])
def test_png_metadata_is_never_inflated(kind, key, tmp_path, monkeypatch):
    """Pillow inflates each compressed chunk on opening, 1 MiB at most, and caps neither ICC
    profiles nor text without a key: 150 images of 60 such chunks would be 9 GB to inflate. An
    image loses its metadata chunks before Pillow opens it, in a request and in a data set; its
    pixels are the same."""
    inflated = []
    real = PngImagePlugin._safe_zlib_decompress
    monkeypatch.setattr(PngImagePlugin, "_safe_zlib_decompress", lambda data: inflated.append(1) or real(data))
    plain = png_bytes((3, 2))
    bomb = with_text_chunks(plain, chunks=60, inflated_bytes=2**20 - 1, kind=kind, key=key)
    assert len(bomb) < 80_000
    decoded = decode_samples([sample(*[bomb] * 150)])[0]["images"]
    assert len(decoded) == 150 and decoded[0].info == {}
    assert decoded[0].tobytes() == Image.open(io.BytesIO(plain)).convert("RGB").tobytes()
    path = tmp_path / "bomb.png"
    path.write_bytes(bomb)
    image = load_rgb_image(str(path))
    assert image.tobytes() == decoded[0].tobytes() and image.info == {} and header_size(path) == (3, 2)
    assert inflated == []
    Image.open(io.BytesIO(bomb)).load()
    assert inflated  # (Pillow itself would have)


def test_a_png_of_too_many_chunks_is_refused_and_its_chunks_count_toward_the_request():
    """A PNG of 16,000 empty chunks is a few hundred KB: each costs Pillow a step in Python."""
    chunk = struct.pack(">I", 0) + b"prIv" + struct.pack(">I", zlib.crc32(b"prIv"))
    plain = png_bytes()
    many = lambda count: plain[:33] + chunk * count + plain[33:]  # (after the signature and IHDR)
    assert decode_samples([sample(many(1000))])[0]["images"][0].size == (1, 1)
    with pytest.raises(PixelLimitError, match=f"a PNG of more than {MAX_PNG_CHUNKS} chunks; refused before decoding"):
        check_samples([sample(many(MAX_PNG_CHUNKS))])
    steps = 1000 + 3  # its chunks: IHDR, IDAT, IEND and the 1000
    limit = MIN_IMAGE_PIXELS + steps * STRUCTURE_STEP_PIXELS
    check_samples([sample(many(1000))], max_request_pixels=limit)
    with pytest.raises(PixelLimitError, match="--max-request-pixels"):
        check_samples([sample(many(1001))], max_request_pixels=limit)


def test_an_image_file_over_the_size_limit_is_refused_unread(tmp_path):
    """Pillow reads a whole PNG chunk or WebP file, however large (sparse here: no disk used)."""
    path = tmp_path / "huge.png"
    with open(path, "wb") as file:
        file.write(png_bytes())
        file.truncate(MAX_IMAGE_FILE_BYTES + 1)
    for read in (load_rgb_image, header_size):
        with pytest.raises(ValueError, match=f"^an image file of over {MAX_IMAGE_FILE_BYTES >> 20} MiB; refused"):
            read(str(path))


def jpeg_bytes(size=(16, 16), **options) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 0, 0)).save(buffer, format="JPEG", **options)
    return buffer.getvalue()


def with_after_app0(jpeg: bytes, insert: bytes) -> bytes:
    after_app0 = 4 + int.from_bytes(jpeg[4:6], "big")  # SOI, then APP0's marker and its length
    return jpeg[:after_app0] + insert + jpeg[after_app0:]


@pytest.mark.parametrize("junk, limit, message", [
    (b"\xff\xe3\x00\x02", MAX_JPEG_SEGMENTS, "APPn and COM segments"),  # empty APP3
    (b"\xff\xfe\x00\x02", MAX_JPEG_SEGMENTS, "APPn and COM segments"),  # empty COM
    (b"\xff\x00", MAX_JPEG_HEADER_STEPS, "header takes more than"),  # escaped FF, each a step of Pillow's walk
])
def test_a_jpeg_header_of_junk_is_refused_before_pillow_walks_it(junk, limit, message, tmp_path, monkeypatch):
    """Pillow walks a JPEG's header in Python, keeping every APPn segment: 47 MiB of empty APP3
    markers took it 14.5 s and 1.6 GB."""
    good = jpeg_bytes()
    walked = []
    real = JpegImagePlugin.JpegImageFile._open
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "_open", lambda image: walked.append(1) or real(image))
    bomb = with_after_app0(good, junk * 500_000)
    with pytest.raises(PixelLimitError, match=f"sample 0 image 0: a JPEG .*{message}"):
        check_samples([sample(bomb)])
    (tmp_path / "bomb.jpg").write_bytes(bomb)
    with pytest.raises(ValueError, match=message):
        header_size(str(tmp_path / "bomb.jpg"))
    assert walked == []
    allowed = with_after_app0(good, junk * (limit // 2))
    assert decode_samples([sample(allowed)])[0]["images"][0].tobytes() == Image.open(io.BytesIO(good)).convert("RGB").tobytes()
    assert walked


@pytest.mark.parametrize("junk", [b"\xff", b"\x00", b"\x12\x34"])
def test_padding_and_stray_bytes_in_a_jpeg_header_are_left_out(junk):
    """Pillow skips them a byte at a time (12 MiB of FF padding: 3.6 s); they are dropped as
    runs, whatever their length, and the pixels are the same."""
    good = jpeg_bytes()
    kept, steps = jpeg_without_metadata(with_after_app0(good, junk * 2_000_000))
    assert kept == jpeg_without_metadata(good)[0] and steps <= jpeg_without_metadata(good)[1] + 1


def test_a_jpegs_metadata_is_never_parsed():
    """A 1x1 JPEG whose EXIF holds a million-value resolution cost Pillow 2.5 s and 330 MB per
    open; its APPn segments are left out before Pillow sees them (APP14 kept: CMYK needs it)."""
    exif = b"Exif\x00\x00" + b"\x00" * 60_000
    app1 = b"\xff\xe1" + (len(exif) + 2).to_bytes(2, "big") + exif
    adobe = b"Adobe" + b"\x00\x64" + b"\x00" * 4 + b"\x01"  # version 100, flags, transform 1: YCbCr, as encoded
    app14 = b"\xff\xee" + (len(adobe) + 2).to_bytes(2, "big") + adobe
    good = jpeg_bytes()
    photo = with_after_app0(good, app1 * 100 + app14)
    kept, _ = jpeg_without_metadata(photo)
    assert b"Exif" not in kept and kept.count(b"Adobe") == 1
    assert kept[2:20] == b"\xff\xe0\x00\x10JFIF\x00" + good[11:18] + b"\x00\x00"  # JFIF's fixed part: libjpeg reads it
    decoded = decode_samples([sample(photo)])[0]["images"][0]
    assert decoded.tobytes() == Image.open(io.BytesIO(good)).convert("RGB").tobytes()


@pytest.mark.parametrize("hidden", [b"\xff\x01", b"\xff\x02\x00\x02"])
def test_a_marker_libjpeg_reads_without_a_length_cannot_hide_scans(hidden):
    """TEM (FF 01) has no length for libjpeg, and a restart marker it resynchronises past is
    skipped alone: a walk that read a length after either jumped over thousands of scans that
    libjpeg then decoded (9.4 s for a 263 KB 4096x4096 JPEG). Among the scans, only the markers
    libjpeg reads as segments are allowed."""
    good = jpeg_bytes(progressive=True)
    end = good.rindex(b"\xff\xd9")
    bomb = good[:end] + hidden + b"\xff\xda\x00\x02" * 100 + good[end:]
    with pytest.raises(PixelLimitError, match=f"a JPEG with marker FF{hidden[1]:02X} among its scans"):
        check_samples([sample(bomb)])


def test_an_mpo_of_too_many_scans_is_refused_like_a_jpeg():
    """A JPEG with an MPF segment of two pictures opens as MPO; its first picture's scans count
    as a JPEG's, and only that picture is kept."""
    first, second = (Image.new("RGB", (64, 64), colour) for colour in ((200, 0, 0), (0, 0, 200)))
    buffer = io.BytesIO()
    first.save(buffer, format="MPO", save_all=True, append_images=[second], progressive=True)
    mpo = buffer.getvalue()
    assert Image.open(io.BytesIO(mpo)).format == "MPO"
    assert decode_samples([sample(mpo)])[0]["images"][0].getpixel((5, 5))[0] > 150  # the first picture: red
    end_of_first = mpo.index(b"\xff\xd9") + 2
    bomb = mpo[:end_of_first - 2] + b"\xff\xda\x00\x02" * (MAX_JPEG_SCANS + 1) + mpo[end_of_first - 2:]
    with pytest.raises(PixelLimitError, match=f"more than {MAX_JPEG_SCANS} scans"):
        check_samples([sample(bomb)])


def test_a_jpeg_of_too_many_scans_is_refused_before_decoding():
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 0, 0)).save(buffer, format="JPEG", progressive=True)
    good = buffer.getvalue()
    decode_samples([sample(good)])  # a progressive JPEG as encoders write it: some ten scans
    bomb = good[:-2] + b"\xff\xda\x00\x02" * (MAX_JPEG_SCANS + 1) + good[-2:]  # scan starts before the end marker
    with pytest.raises(PixelLimitError, match=f"more than {MAX_JPEG_SCANS} scans"):
        decode_samples([sample(bomb)])


def test_each_image_counts_at_least_its_floor_of_pixels():
    tiny = png_bytes()
    cost = MIN_IMAGE_PIXELS + 3 * STRUCTURE_STEP_PIXELS  # 1x1, and its three chunks (IHDR, IDAT, IEND)
    assert check_samples([sample(tiny)])[0]["images"][0].cost == cost
    limit = 100 * cost
    decode_samples([sample(*[tiny] * 100)], max_request_pixels=limit)
    with pytest.raises(PixelLimitError, match="--max-request-pixels.*by sample 0 image 100$"):  # (at the image past it)
        decode_samples([sample(*[tiny] * 1000)], max_request_pixels=limit)


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
