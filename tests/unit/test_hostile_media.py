"""Media files are decoded with the work bounded and the formats allowed (data/images.py,
data/video_file.py): images only as PNG, JPEG or WEBP, a JPEG of too many scans refused before
decoding, a video only in MP4/MOV, Matroska/WebM or AVI through FFmpeg (no demuxer that opens
other files), and each video file decoded in a worker process killed at
`data.video_decode_timeout_s`, its memory capped. The hostile files are built here, a few
hundred KiB at most. Tests of the real decoder skip without OpenCV; the others give the worker
an OpenCV double (a `cv2` module on its path) whose behaviour the video file names."""

from __future__ import annotations

import gzip
import io
import json
import os
import struct
import sys
import time
import types

import numpy as np
import pytest
from PIL import Image

from vlrft.config import ConfigError, load_config
from vlrft.data.dataset import DataError, load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.data.image_headers import MAX_JPEG_SCANS, jpeg_without_metadata
from vlrft.data.images import IMAGE_FORMATS, load_rgb_image
from vlrft.data.video_file import CAPTURE_OPTIONS, CAPTURE_OPTIONS_VARIABLE, decode_video_file


def media_row(kind: str, name: str) -> dict:
    return {"id": "m", "answer": "a", "messages": [{"role": "user", "content": [
        {"type": kind, kind: name}, {"type": "text", "text": "what is it?"}]}]}


def encode_one(encoder: PromptEncoder, tmp_path, kind: str, name: str):
    (tmp_path / "train.jsonl").write_text(json.dumps(media_row(kind, name)) + "\n")
    return encoder.encode(load_rows(tmp_path / "train.jsonl")[0], 0)


# ---- images

def fits_gzip(side: int) -> bytes:
    """A FITS image compressed with GZIP_1 (Pillow decodes it pixel by pixel in Python)."""
    def card(key, value):
        return f"{key:<8}= {value:>20}".ljust(80).encode()

    def unit(cards):
        data = b"".join(cards) + b"END".ljust(80)
        return data + b" " * (-len(data) % 2880)

    primary = unit([card("SIMPLE", "T"), card("BITPIX", "8"), card("NAXIS", "0")])
    table = unit([card("XTENSION", "'BINTABLE'"), card("BITPIX", "8"), card("NAXIS", "2"), card("NAXIS1", "0"),
                  card("NAXIS2", "0"), card("ZIMAGE", "T"), card("ZCMPTYPE", "'GZIP_1  '"), card("ZBITPIX", "8"),
                  card("ZNAXIS", "2"), card("ZNAXIS1", str(side)), card("ZNAXIS2", str(side))])
    return primary + table + gzip.compress(bytes(side * side * 4))


def gif() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 0, 0)).save(buffer, "GIF")
    return buffer.getvalue()


@pytest.mark.parametrize("name, content", [("image.png", fits_gzip), ("image.gif", gif)])
def test_an_image_in_a_format_not_read_is_a_bad_prompt(tmp_path, tiny_vl, name, content):
    data = content(256) if content is fits_gzip else content()
    Image.open(io.BytesIO(data)).load()  # Pillow itself reads it
    (tmp_path / name).write_bytes(data)
    encoder = PromptEncoder(tiny_vl, 56 * 56, 112 * 112, 512)
    message = (f"row id 'm': cannot read image {tmp_path / name} "
               "(cannot identify image file as PNG, JPEG or WEBP, the image formats read)")
    with pytest.raises(DataError) as err:
        encode_one(encoder, tmp_path, "image", name)
    assert str(err.value) == message


def test_a_file_name_that_forges_log_lines_is_shown_escaped_on_one_line(tmp_path, tiny_vl):
    name = "ok\nINFO forged log line: all rows valid\n.png"
    (tmp_path / name).write_bytes(b"not an image")
    with pytest.raises(DataError) as err:
        encode_one(PromptEncoder(tiny_vl, 56 * 56, 112 * 112, 512), tmp_path, "image", name)
    assert "\n" not in str(err.value) and "ok\\nINFO forged" in str(err.value), str(err.value)


def test_a_row_whose_images_alone_overflow_the_prompt_is_refused_from_their_headers(tmp_path, tiny_vl, monkeypatch):
    """One small PNG named 80 times: each part decodes to a large image (80 of a 1990-pixel
    square held 5.7 GiB), so the row is refused once its images' tokens, counted from their
    headers, pass data.max_prompt_tokens, before the rest are decoded. A row within the limit
    encodes, with the tokens the header count predicted. Each file is read once: its header
    counted, then its pixels decoded from the same bytes."""
    from vlrft.data import images

    Image.new("RGB", (600, 600), (200, 0, 0)).save(tmp_path / "big.png")  # resized to max_pixels: 112 x 112
    decoded, reads = [], []
    decode, read = images.rgb_image, images.read_image_file
    monkeypatch.setattr(images, "rgb_image", lambda *a: decoded.append(1) or decode(*a))
    monkeypatch.setattr(images, "read_image_file", lambda *a: reads.append(1) or read(*a))
    encoder = PromptEncoder(tiny_vl, 56 * 56, 112 * 112, 512)

    def row(parts: int) -> dict:
        images = [{"type": "image", "image": "big.png"}] * parts
        (tmp_path / "train.jsonl").write_text(json.dumps({"id": "many", "answer": "a", "messages": [
            {"role": "user", "content": [*images, {"type": "text", "text": "?"}]}]}) + "\n")
        return load_rows(tmp_path / "train.jsonl")[0]

    with images.header_then_pixels(tmp_path / "big.png", encoder.max_pixels) as (size, _):
        each = encoder.image_tokens(*size)
    reads.clear()
    over = 512 // each + 1  # the first image past the limit
    assert each >= 4 and over < 80
    with pytest.raises(DataError, match=rf"^row id 'many': its first {over} images alone take {over * each} tokens > "
                                        r"data.max_prompt_tokens=512 \(refused before decoding them\)$"):
        encoder.encode(row(80), 0)
    assert len(decoded) == over - 1 and len(reads) == over  # the last one's header only
    within = over // 2  # images and text within the limit: encoded, with the tokens the headers said
    prompt = encoder.encode(row(within), 0)
    assert int(prompt.mm_inputs["image_grid_thw"].prod(-1).sum()) // 4 == within * each


def test_the_reward_server_reads_the_same_image_formats():
    from vlrft.rewards import wire

    assert wire.IMAGE_FORMATS is IMAGE_FORMATS


def progressive_jpeg(scans: int) -> bytes:
    """A 64x64 grey progressive JPEG of `scans` scans: Pillow's 6, then copies of its shortest
    AC scan (each another pass over the image) before the end marker."""
    buffer = io.BytesIO()
    Image.new("L", (64, 64), 128).save(buffer, "JPEG", progressive=True)
    data = buffer.getvalue()
    found, i = [], 2
    while data[i + 1] != 0xD9:  # marker segments, then each scan's data up to the next marker
        length = struct.unpack(">H", data[i + 2:i + 4])[0]
        end = i + 2 + length
        if data[i + 1] == 0xDA:
            while not (data[end] == 0xFF and data[end + 1] != 0 and not 0xD0 <= data[end + 1] <= 0xD7):
                end += 1
            if data[i + 4 + length - 5] > 0:  # spectral start above 0: an AC scan
                found.append(data[i:end])
        i = end
    base = data.count(b"\xff\xda")
    return data[:-2] + min(found, key=len) * (scans - base) + b"\xff\xd9"


def test_a_jpeg_of_too_many_scans_is_refused_before_decoding():
    at_limit, over = progressive_jpeg(MAX_JPEG_SCANS), progressive_jpeg(MAX_JPEG_SCANS + 1)
    assert at_limit.count(b"\xff\xda") == MAX_JPEG_SCANS and len(over) < 10_000
    assert load_rgb_image(io.BytesIO(at_limit)).size == (64, 64)
    with pytest.raises(ValueError, match=f"^a JPEG of more than {MAX_JPEG_SCANS} scans, each a pass over the whole "
                                         "image; refused before decoding$"):
        load_rgb_image(io.BytesIO(over))


def test_scans_are_counted_between_the_first_scan_and_the_end_marker():
    """Scan markers in metadata (an ICC profile's bytes) or after the image (a motion photo's
    video) are not scans: the walk skips segments by their length and stops at the end marker."""
    picture = progressive_jpeg(MAX_JPEG_SCANS)
    fake_scans = b"\xff\xda" * 1000
    app2 = b"\xff\xe2" + (len(fake_scans) + 2).to_bytes(2, "big") + fake_scans  # an APP2 segment full of FF DA
    photo = picture[:2] + app2 + picture[2:] + fake_scans * 7  # and a trailer after the end marker
    kept, _ = jpeg_without_metadata(photo)
    assert kept.count(b"\xff\xda") == MAX_JPEG_SCANS and kept.endswith(b"\xff\xd9") and len(kept) <= len(picture)
    assert load_rgb_image(io.BytesIO(photo)).tobytes() == load_rgb_image(io.BytesIO(picture)).tobytes()


# ---- video files: the FFmpeg restriction, with an in-process double

def test_ffmpeg_is_asked_alone_with_the_allowed_demuxers_and_the_environment_is_restored(tmp_path, monkeypatch):
    seen = []

    class Capture:
        def __init__(self, name, backend):
            seen.append((backend, os.environ.get(CAPTURE_OPTIONS_VARIABLE)))

        def isOpened(self):
            return False

        def release(self):
            pass

    monkeypatch.setitem(sys.modules, "cv2", types.SimpleNamespace(VideoCapture=Capture, CAP_FFMPEG=1900))
    monkeypatch.setenv(CAPTURE_OPTIONS_VARIABLE, "rtsp_transport;tcp")  # a user's own setting
    (tmp_path / "clip.avi").write_bytes(b"refused by the double")
    with pytest.raises(ValueError, match=r"^cannot open it as a video \(the formats read: MP4/MOV, Matroska/WebM or AVI\)$"):
        decode_video_file(str(tmp_path / "clip.avi"), 2.0, 8)
    assert seen == [(1900, "format_whitelist;mov,matroska,avi|protocol_whitelist;file")] == [(1900, CAPTURE_OPTIONS)]
    assert os.environ[CAPTURE_OPTIONS_VARIABLE] == "rtsp_transport;tcp"


# ---- video files: the worker, with an OpenCV double on its path

FAKE_CV2 = '''
import os, signal, time
import numpy as np
CAP_FFMPEG, CAP_PROP_FRAME_WIDTH, CAP_PROP_FRAME_HEIGHT, CAP_PROP_FRAME_COUNT, CAP_PROP_FPS, COLOR_BGR2RGB = range(6)


class VideoCapture:
    """10 frames of 64x48 at 10 a second; what the file says happens at the first grab."""

    def __init__(self, name, backend=None):
        with open(name) as f:
            self.action, self.left = f.read().split(), 10

    def isOpened(self):
        return True

    def get(self, prop):
        return {CAP_PROP_FRAME_WIDTH: 64, CAP_PROP_FRAME_HEIGHT: 48, CAP_PROP_FRAME_COUNT: 10, CAP_PROP_FPS: 10.0}[prop]

    def grab(self):
        action, self.action = self.action, []
        if action[:1] == ["sleep"]:
            time.sleep(float(action[1]))
        elif action == ["crash"]:
            os.kill(os.getpid(), signal.SIGSEGV)
        elif action == ["allocate"]:
            bytearray(5 << 30)
        self.left -= 1
        return self.left >= 0

    def retrieve(self):
        return True, np.zeros((48, 64, 3), np.uint8)

    def release(self):
        pass


def cvtColor(frame, code):
    return frame
'''


@pytest.fixture
def fake_cv2(tmp_path, monkeypatch):
    """A `cv2` double first on sys.path, which the decoding worker copies."""
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "cv2.py").write_text(FAKE_CV2)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.delitem(sys.modules, "cv2", raising=False)


def test_video_decode_timeout_s_stops_a_slow_decode_and_the_next_file_decodes(tmp_path, tiny_vl, fake_cv2):
    """Each pass's first frame takes 2 s: refused under a 1 s limit (the worker killed), encoded
    under 60 s; then a file that decodes at once, in a fresh worker."""
    (tmp_path / "slow.avi").write_text("sleep 2")
    (tmp_path / "quick.avi").write_text("")
    for timeout, refused in ((1, True), (60, False)):
        cfg = load_config(None, [f"model.path={tiny_vl}", f"data.train_path={tmp_path / 'train.jsonl'}",
                                 f"data.video_decode_timeout_s={timeout}"])
        encoder = PromptEncoder.for_config(cfg)
        start = time.monotonic()
        if refused:
            with pytest.raises(DataError) as err:
                encode_one(encoder, tmp_path, "video", "slow.avi")
            assert str(err.value) == (f"row id 'm': cannot read video {tmp_path / 'slow.avi'} "
                                      "(decoding it took over data.video_decode_timeout_s=1s; stopped)")
            assert time.monotonic() - start < 30 and not encoder.video_files.worker.running
        else:
            assert encode_one(encoder, tmp_path, "video", "slow.avi").mm_inputs["video_grid_thw"].tolist() == [[1, 4, 4]]
        assert encode_one(encoder, tmp_path, "video", "quick.avi").mm_inputs["video_grid_thw"].tolist() == [[1, 4, 4]]
        encoder.video_files.worker.stop()


def test_a_decoder_that_crashes_or_takes_too_much_memory_is_a_bad_prompt(tmp_path, tiny_vl, fake_cv2):
    (tmp_path / "crash.avi").write_text("crash")
    (tmp_path / "greedy.avi").write_text("allocate")
    encoder = PromptEncoder(tiny_vl, 56 * 56, 112 * 112, 512)
    with pytest.raises(DataError) as err:
        encode_one(encoder, tmp_path, "video", "crash.avi")
    assert str(err.value) == (f"row id 'm': cannot read video {tmp_path / 'crash.avi'} "
                              "(its decoder failed: its worker process died (killed by SIGSEGV))")
    with pytest.raises(DataError) as err:  # 5 GiB asked for, over the worker's 4 GiB
        encode_one(encoder, tmp_path, "video", "greedy.avi")
    assert str(err.value) == (f"row id 'm': cannot read video {tmp_path / 'greedy.avi'} "
                              "(it needs more than the 4 GiB a video decoder may take)")
    encoder.video_files.worker.stop()


def test_video_decode_timeout_s_must_be_positive(tiny_vl, tmp_path):
    with pytest.raises(ConfigError, match=r"^config key 'data.video_decode_timeout_s' must be a finite number > 0, got 0.0$"):
        load_config(None, [f"model.path={tiny_vl}", f"data.train_path={tmp_path / 't.jsonl'}",
                           "data.video_decode_timeout_s=0"])


# ---- video files: the real decoder

def riff(fourcc: bytes, data: bytes) -> bytes:
    return fourcc + struct.pack("<I", len(data)) + data + b"\0" * (len(data) % 2)


def lying_avi(small: bytes, big: bytes, entries: int) -> bytes:
    """An MJPG AVI whose headers say one 64x64 frame; its index names the big JPEG `entries`
    times (alternating with the small one: FFmpeg drops an entry equal to the one before; two
    equal entries first make it read by the index)."""
    avih = struct.pack("<14I", 40000, 0, 0, 0x10, 1, 0, 1, 0, 64, 64, 0, 0, 0, 0)
    strh = b"vidsMJPG" + struct.pack("<IHHIIIIIIIIhhhh", 0, 0, 0, 0, 1, 25, 0, 1, 0, 0xFFFFFFFF, 0, 0, 0, 64, 64)
    strf = struct.pack("<IiiHH4sIiiII", 40, 64, 64, 1, 24, b"MJPG", 64 * 64 * 3, 0, 0, 0, 0)
    header = riff(b"LIST", b"hdrl" + riff(b"avih", avih) + riff(b"LIST", b"strl" + riff(b"strh", strh) + riff(b"strf", strf)))
    first, second = riff(b"00dc", small), riff(b"00dc", big)
    movi = riff(b"LIST", b"movi" + first + second + first)

    def entry(offset, size):
        return struct.pack("<4sIII", b"00dc", 0x10, offset, size)

    to_big, to_small = entry(4 + len(first), len(big)), entry(4 + len(first) + len(second), len(small))
    index = entry(4, len(small)) + to_big * 2 + (to_big + to_small) * entries
    return riff(b"RIFF", b"AVI " + header + movi + riff(b"idx1", index))


def jpeg(side: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (side, side), 128).save(buffer, "JPEG", quality=1)
    return buffer.getvalue()


def test_a_video_whose_header_lies_about_its_frames_is_stopped_at_the_timeout(tmp_path, tiny_vl):
    pytest.importorskip("cv2", reason="the real decoder: OpenCV comes with the vllm extras")
    (tmp_path / "lie.avi").write_bytes(lying_avi(jpeg(64), jpeg(4000), 5_000))  # 16 MP frames, each decoded
    assert (tmp_path / "lie.avi").stat().st_size < 400_000
    (tmp_path / "fine.avi").write_bytes(lying_avi(jpeg(64), jpeg(64), 3))
    encoder = PromptEncoder(tiny_vl, 56 * 56, 112 * 112, 512, video_decode_timeout_s=3)
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        encode_one(encoder, tmp_path, "video", "lie.avi")
    assert str(err.value) == (f"row id 'm': cannot read video {tmp_path / 'lie.avi'} "
                              "(decoding it took over data.video_decode_timeout_s=3s; stopped)")
    assert time.monotonic() - start < 60
    assert encode_one(encoder, tmp_path, "video", "fine.avi").mm_inputs["video_grid_thw"][0][0] >= 1
    encoder.video_files.worker.stop()


def test_a_concat_list_cannot_reach_the_trainers_descriptors(tmp_path):
    """FFmpeg's concat demuxer opens the files a list names relative to the name opened,
    /proc/self/fd/N: `file 7` would read descriptor 7, a file outside the data set."""
    cv2 = pytest.importorskip("cv2", reason="the real decoder: OpenCV comes with the vllm extras")
    outside = tmp_path / "outside.avi"
    writer = cv2.VideoWriter(str(outside), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (64, 48))
    for _ in range(4):
        writer.write(np.full((48, 64, 3), (0, 0, 200), np.uint8))
    writer.release()
    held = os.open(outside, os.O_RDONLY)
    try:
        data = tmp_path / "data"
        data.mkdir()
        for name, listed in (("other.avi", held), ("itself.avi", None)):
            listed = listed if listed is not None else os.open(os.devnull, os.O_RDONLY)  # the number it will get
            if name == "itself.avi":
                os.close(listed)
            (data / name).write_text(f"ffconcat version 1.0\nfile {listed}\n")
            with pytest.raises(ValueError, match=r"^cannot open it as a video \(the formats read"):
                decode_video_file(str(data / name), 2.0, 8)
    finally:
        os.close(held)
    assert len(decode_video_file(str(outside), 2.0, 8)[0]) == 1  # the file itself is a video FFmpeg reads


def test_the_allowed_containers_decode_and_a_bare_jpeg_stream_does_not(tmp_path):
    cv2 = pytest.importorskip("cv2", reason="the real decoder: OpenCV comes with the vllm extras")
    for name, codec in (("clip.mp4", "mp4v"), ("clip.webm", "VP80"), ("clip.avi", "MJPG")):
        writer = cv2.VideoWriter(str(tmp_path / name), cv2.VideoWriter_fourcc(*codec), 10.0, (64, 48))
        for k in range(10):
            writer.write(np.full((48, 64, 3), 20 * k, np.uint8))
        writer.release()
        frames, kept, fps = decode_video_file(str(tmp_path / name), 2.0, 8)
        assert (len(frames), frames[0].size, fps) == (2, (64, 48), 2.0), name
    (tmp_path / "stream.mp4").write_bytes(jpeg(64) * 3)  # FFmpeg would read it as jpeg_pipe
    with pytest.raises(ValueError, match=r"^cannot open it as a video"):
        decode_video_file(str(tmp_path / "stream.mp4"), 2.0, 8)
