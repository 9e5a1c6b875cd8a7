"""A video file's frame size and length are read from its header (OpenCV's stream info) and
checked before any frame is decoded (data/video.py): a frame over PIL's image limit, or width x
height x frames over `data.video_max_decoded_pixels`, is refused; a header that understates the
length stops the counting pass at the same bound. The files are AVI headers written here (a few
hundred bytes: the frames are never decoded); OpenCV is a double unless it is installed."""

from __future__ import annotations

import json
import struct
import sys
import types

import numpy as np
import pytest

from vlrft.config import load_config
from vlrft.data.dataset import DataError, load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.data.video_file import decode_video_file


def chunk(fourcc: bytes, data: bytes) -> bytes:
    return fourcc + struct.pack("<I", len(data)) + data + b"\0" * (len(data) % 2)


def mjpg_avi(width: int, height: int, frames: int, fps: int = 10) -> bytes:
    """An AVI file whose header announces `frames` MJPG frames of width x height; each frame is
    an empty JPEG (start and end markers only)."""
    jpeg = b"\xff\xd8\xff\xd9"
    avih = struct.pack("<14I", 1_000_000 // fps, 0, 0, 0x10, frames, 0, 1, len(jpeg), width, height, 0, 0, 0, 0)
    strh = b"vidsMJPG" + struct.pack("<IHHIIIIIIiI4h", 0, 0, 0, 0, 1, fps, 0, frames, len(jpeg), -1, 0,
                                     0, 0, min(width, 32767), min(height, 32767))
    strf = struct.pack("<IiiHH4sIiiII", 40, width, height, 1, 24, b"MJPG", width * height * 3, 0, 0, 0, 0)
    stream_list = chunk(b"LIST", b"strl" + chunk(b"strh", strh) + chunk(b"strf", strf))
    header = chunk(b"LIST", b"hdrl" + chunk(b"avih", avih) + stream_list)
    movi = chunk(b"LIST", b"movi" + b"".join(chunk(b"00dc", jpeg) for _ in range(frames)))
    index = chunk(b"idx1", b"".join(struct.pack("<4sIII", b"00dc", 0x10, 4 + k * 12, len(jpeg)) for k in range(frames)))
    return chunk(b"RIFF", b"AVI " + header + movi + index)


def opencv_double(monkeypatch, width: int, height: int, frames: int, actual_frames: int | None = None):
    """A `cv2` whose captures report `frames` frames of width x height at 10 per second (and hold
    `actual_frames`, default the same). Returns its record: `decoded`, a number per decoded
    frame (`grab`), and `opened`, the names the captures were given."""
    calls = types.SimpleNamespace(decoded=[], opened=[])
    held = frames if actual_frames is None else actual_frames

    class Capture:
        def __init__(self, path, backend):
            calls.opened.append(path)
            self.position = 0

        def isOpened(self):
            return True

        def get(self, prop):
            return {"width": width, "height": height, "count": frames, "fps": 10.0}[prop]

        def grab(self):
            if self.position == held:
                return False
            self.position += 1
            calls.decoded.append(self.position)
            return True

        def retrieve(self):
            return True, np.zeros((height, width, 3), np.uint8)

        def release(self):
            pass

    monkeypatch.setitem(sys.modules, "cv2", types.SimpleNamespace(
        VideoCapture=Capture, CAP_FFMPEG=1900, CAP_PROP_FRAME_WIDTH="width", CAP_PROP_FRAME_HEIGHT="height",
        CAP_PROP_FRAME_COUNT="count", CAP_PROP_FPS="fps", COLOR_BGR2RGB=None, cvtColor=lambda frame, code: frame))
    return calls


class InProcess:
    """Stands for the encoder's decoding worker (vlrft.workers.Worker): its calls run here."""

    def call(self, fn, args, timeout_s):
        return fn(*args)


def video_row(path: str) -> dict:
    return {"id": "clip", "answer": "a", "messages": [{"role": "user", "content": [
        {"type": "video", "video": path, "fps": 10.0}, {"type": "text", "text": "what happens?"}]}]}


def test_a_10000_square_mjpg_is_refused_before_decoding(tmp_path, monkeypatch):
    path = tmp_path / "huge.avi"
    path.write_bytes(mjpg_avi(10000, 10000, 2))
    assert path.stat().st_size < 1000
    calls = opencv_double(monkeypatch, 10000, 10000, 2)
    with pytest.raises(ValueError, match=r"^10000x10000 frames, over 89478485 pixels a frame .*refused before decoding$"):
        decode_video_file(str(path), 2.0, 8)
    assert calls.decoded == []


def test_a_10000_square_mjpg_is_refused_before_opencv_decodes_it(tmp_path, monkeypatch):
    cv2 = pytest.importorskip("cv2", reason="the real decoder: OpenCV comes with the vllm extras")
    path = tmp_path / "huge.avi"
    path.write_bytes(mjpg_avi(10000, 10000, 2))
    grabbed = []
    real = cv2.VideoCapture

    class Watched:  # the real capture, its grabs (decodes) counted
        def __init__(self, *args):
            self.capture = real(*args)

        def grab(self):
            grabbed.append(1)
            return self.capture.grab()

        def __getattr__(self, name):
            return getattr(self.capture, name)

    monkeypatch.setattr(cv2, "VideoCapture", Watched)
    with pytest.raises(ValueError, match="refused before decoding"):
        decode_video_file(str(path), 2.0, 8)
    assert grabbed == []


def test_video_max_decoded_pixels_bounds_width_height_and_frames(tmp_path, monkeypatch, tiny_vl):
    """64 x 48 x 10 frames = 30720 pixels: refused under a budget one pixel smaller, before any
    frame is decoded; encoded under that budget exactly (the config key reaches the encoder)."""
    (tmp_path / "clip.avi").write_bytes(mjpg_avi(64, 48, 10))
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps(video_row("clip.avi")) + "\n")
    row = load_rows(train)[0]
    calls = opencv_double(monkeypatch, 64, 48, 10)
    for budget in (30719, 30720):
        cfg = load_config(None, [f"model.path={tiny_vl}", f"data.train_path={train}",
                                 f"data.video_max_decoded_pixels={budget}"])
        encoder = PromptEncoder.for_config(cfg)
        encoder.video_files.worker = InProcess()  # where the OpenCV double is
        if budget < 30720:
            message = (f"row id 'clip': cannot read video {tmp_path / 'clip.avi'} (64x48 pixels x 10 frames is over "
                       "data.video_max_decoded_pixels=30719; refused before decoding)")
            with pytest.raises(DataError) as err:
                encoder.encode(row, 0)
            assert str(err.value) == message and calls.decoded == []
        else:
            assert int(encoder.encode(row, 0).mm_inputs["video_grid_thw"][0][0]) >= 1 and calls.decoded
    assert calls.opened and all(name.startswith("/proc/self/fd/") for name in calls.opened)  # the opened descriptor, not the name


def test_a_header_that_understates_the_length_stops_at_the_budget(tmp_path, monkeypatch):
    (tmp_path / "long.avi").write_bytes(mjpg_avi(64, 48, 2))
    calls = opencv_double(monkeypatch, 64, 48, 2, actual_frames=1000)
    with pytest.raises(ValueError, match=r"^more than 10 frames of 64x48 .*data\.video_max_decoded_pixels=30720\)$"):
        decode_video_file(str(tmp_path / "long.avi"), 2.0, 8, max_decoded_pixels=30720)
    assert len(calls.decoded) == 11  # the one over the bound, then it stopped


def test_video_max_decoded_pixels_must_be_positive(tiny_vl, tmp_path):
    from vlrft.config import ConfigError

    (tmp_path / "t.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"^config key 'data.video_max_decoded_pixels' must be >= 1, got 0$"):
        load_config(None, [f"model.path={tiny_vl}", f"data.train_path={tmp_path / 't.jsonl'}",
                           "data.video_max_decoded_pixels=0"])
