"""Reading a video file's frames with OpenCV's FFmpeg backend, the work bounded (docs/datasets.md,
"Video prompts").

A data set's video file is a stranger's file, and FFmpeg a large decoder:
- Containers. FFmpeg picks a demuxer by probing the file's content, and some demuxers open the
  files a file names (concat, HLS, ...), relative to the name opened: /proc/self/fd/N, so any
  descriptor of the process. Only VIDEO_DEMUXERS, over FFmpeg's `file` protocol, are allowed
  (its `format_whitelist` and `protocol_whitelist`). OpenCV passes FFmpeg options only from the
  environment variable OPENCV_FFMPEG_CAPTURE_OPTIONS, read as each capture opens, so it is set
  around each open, under a lock, and restored. Only the FFmpeg backend is asked: OpenCV's others
  (its own MJPEG reader, image sequences) would open a file FFmpeg refused.
- Size. The header's frame size and count are checked before a frame is decoded
  (`frames_allowed`). A header can lie, and OpenCV reports the header's size for every frame
  it returns, whatever size the decoder met, so a lie cannot be caught frame by frame. The bound
  that holds is outside the decoder: `VideoFiles` decodes each file in a worker process
  (vlrft.workers), killed at `data.video_decode_timeout_s`, its memory capped at
  DECODE_MEMORY_BYTES; a decoder crash ends the worker, not the trainer.
"""

from __future__ import annotations

import math
import os
import threading
from contextlib import contextmanager

import numpy as np
from PIL import Image

from vlrft.data.images import shrunk
from vlrft.data.media import open_media
from vlrft.workers import CallFailed, CallTimedOut, Worker, limit_data_memory

# Source frames a video file may have: the counting pass reads every frame, and a crafted file
# can claim an endless stream. 108,000 is an hour at 30 frames per second.
MAX_SOURCE_FRAMES = 108_000
# Width x height x source frames a video file may have (data.video_max_decoded_pixels): the
# frames are decoded in full, so this bounds the work; 2**33 is about 2.3 minutes of 1080p at 30
# frames per second.
VIDEO_MAX_DECODED_PIXELS = 2**33
# Seconds one video file may take to decode (data.video_decode_timeout_s): a file at the default
# budget decodes in about 20 s on two cores (MPEG-4 Part 2, 1080p, both passes).
VIDEO_DECODE_TIMEOUT_S = 60.0
# FFmpeg's demuxers for MP4/MOV/M4V/3GP, Matroska/WebM and AVI (a demuxer's name lists its
# formats, "mov,mp4,m4a,3gp,3g2,mj2": one of them matches).
VIDEO_DEMUXERS = ("mov", "matroska", "avi")
FORMATS_SHOWN = "MP4/MOV, Matroska/WebM or AVI"
CAPTURE_OPTIONS_VARIABLE = "OPENCV_FFMPEG_CAPTURE_OPTIONS"
CAPTURE_OPTIONS = f"format_whitelist;{','.join(VIDEO_DEMUXERS)}|protocol_whitelist;file"  # key;value|key;value
# A worker's data memory (RLIMIT_DATA): a file of the largest frames allowed (PIL's image limit,
# 89.5 MP) peaks at 1.4 GB (measured: 9400x9400 MJPEG; FFmpeg's planes, OpenCV's BGR copy, PIL's
# RGB one); the rest is room for FFmpeg's frame threads. A decoder asking for more fails its
# allocation: the file is bad input.
DECODE_MEMORY_BYTES = 4 << 30

_options_lock = threading.Lock()


def spaced(count: int, keep: int) -> list[int]:
    """`keep` indices evenly spaced over range(count), first and last included (all if fewer)."""
    if count <= keep:
        return list(range(count))
    return np.linspace(0, count - 1, keep).round().astype(int).tolist()


def header_number(value: float) -> int:
    """A size or count OpenCV read from a stream's header; 0 when unknown (negative, NaN, infinite)."""
    return int(value) if 0 < value < math.inf else 0


def frames_allowed(width: int, height: int, claimed_frames: int, max_decoded_pixels: int) -> int:
    """How many source frames of `width` x `height` may be decoded, from the stream's header
    alone (no frame decoded yet). Raises ValueError when a frame is over PIL's image limit (the
    rule for images), when the header claims more than fits the budget, or gives no frame size."""
    if width <= 0 or height <= 0:
        raise ValueError("its header gives no frame size")
    if width * height > Image.MAX_IMAGE_PIXELS:
        raise ValueError(f"{width}x{height} frames, over {Image.MAX_IMAGE_PIXELS} pixels a frame "
                         "(PIL.Image.MAX_IMAGE_PIXELS, the limit for images); refused before decoding")
    if claimed_frames > MAX_SOURCE_FRAMES:
        raise ValueError(f"longer than {MAX_SOURCE_FRAMES} frames ({claimed_frames}); refused before decoding")
    if width * height * claimed_frames > max_decoded_pixels:
        raise ValueError(f"{width}x{height} pixels x {claimed_frames} frames is over "
                         f"data.video_max_decoded_pixels={max_decoded_pixels}; refused before decoding")
    return min(MAX_SOURCE_FRAMES, max_decoded_pixels // (width * height))


@contextmanager
def ffmpeg_restricted():
    """OPENCV_FFMPEG_CAPTURE_OPTIONS set to CAPTURE_OPTIONS while a capture opens (OpenCV takes
    FFmpeg options from nowhere else), under a lock so that no other open in this process sees
    a half-set value; any earlier value is put back after."""
    with _options_lock:
        before = os.environ.get(CAPTURE_OPTIONS_VARIABLE)
        os.environ[CAPTURE_OPTIONS_VARIABLE] = CAPTURE_OPTIONS
        try:
            yield
        finally:
            if before is None:
                del os.environ[CAPTURE_OPTIONS_VARIABLE]
            else:
                os.environ[CAPTURE_OPTIONS_VARIABLE] = before


def open_capture(cv2, name: str):
    """An OpenCV capture of `name` by FFmpeg alone, restricted to VIDEO_DEMUXERS and local files;
    ValueError when FFmpeg cannot open it as one of them."""
    with ffmpeg_restricted():
        capture = cv2.VideoCapture(name, cv2.CAP_FFMPEG)
    if not capture.isOpened():
        capture.release()
        raise ValueError(f"cannot open it as a video (the formats read: {FORMATS_SHOWN})")
    return capture


def decode_video_file(path: str, fps: float, max_frames: int, max_decoded_pixels: int = VIDEO_MAX_DECODED_PIXELS,
                      max_pixels: int | None = None) -> tuple[list[Image.Image], list[int], float]:
    """Frames of a video file sampled at `fps` (at most `max_frames`, evenly spaced), with their
    indices at that rate; each frame shrunk as `images.shrunk` does for `max_pixels`. Decoded
    with OpenCV (installed with the vllm extras) from the descriptor `open_media` opened
    (beneath its root, no symlinks). Before any frame is decoded the stream's header (frame size
    and count) is checked against `frames_allowed`; a first pass then counts frames (`grab`,
    which decodes them but converts nothing) up to that bound, the second converts just the
    kept ones. In this process, without a time limit: the encoder runs it in `VideoFiles`."""
    try:
        import cv2
    except ImportError:
        raise ValueError("reading a video file needs OpenCV (pip install opencv-python-headless); "
                         "or give the video as a list of frame images") from None
    with open_media(path) as file:
        # The descriptor's own file, not the path: whatever is at the path now is never read.
        opened = f"/proc/self/fd/{file.fileno()}"
        capture = open_capture(cv2, opened)
        try:
            native_fps = capture.get(cv2.CAP_PROP_FPS) or 0.0
            width, height, claimed = (header_number(capture.get(prop)) for prop in (
                cv2.CAP_PROP_FRAME_WIDTH, cv2.CAP_PROP_FRAME_HEIGHT, cv2.CAP_PROP_FRAME_COUNT))
            limit = frames_allowed(width, height, claimed, max_decoded_pixels)
            count = 0
            while capture.grab():
                count += 1
                if count > limit:  # the header understated the length
                    raise ValueError(f"more than {limit} frames of {width}x{height} (at most {MAX_SOURCE_FRAMES} frames "
                                     f"and data.video_max_decoded_pixels={max_decoded_pixels})")
            if not count or not native_fps > 0:  # also a NaN frame rate
                raise ValueError("cannot decode it (no frames or no frame rate)")
            step = max(native_fps / fps, 1.0)  # source frames per sampled frame
            at_rate = [int(k * step) for k in range(int(count / step))] or [0]
            kept = spaced(len(at_rate), max_frames)
            wanted = {at_rate[k] for k in kept}
            capture.release()
            capture = open_capture(cv2, opened)  # from the start again (seeking is inexact in some codecs)
            frames = []
            for source_index in range(max(wanted) + 1):
                if not capture.grab():
                    raise ValueError(f"cannot decode it (frame {source_index} of {count})")
                if source_index in wanted:
                    ok, bgr = capture.retrieve()
                    if not ok:
                        raise ValueError(f"cannot decode it (frame {source_index} of {count})")
                    frames.append(shrunk(Image.fromarray(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)), max_pixels))
        finally:
            capture.release()
    return frames, kept, native_fps / step


class VideoFiles:
    """Decodes video files (`decode_video_file`) in a worker process of its own: killed at
    `timeout_s`, its data memory capped at DECODE_MEMORY_BYTES, started again for the next file.
    One file at a time; the worker starts at the first file."""

    def __init__(self, timeout_s: float, max_decoded_pixels: int = VIDEO_MAX_DECODED_PIXELS,
                 max_pixels: int | None = None):
        self.timeout_s, self.max_decoded_pixels, self.max_pixels = timeout_s, max_decoded_pixels, max_pixels
        self.worker = Worker(prepare=(limit_data_memory, (DECODE_MEMORY_BYTES,)))

    def read(self, path: str, fps: float, max_frames: int) -> tuple[list[Image.Image], list[int], float]:
        """As `decode_video_file`; ValueError (a one-line reason) for a file it refuses, a
        decoder that ran past the timeout, or one that died."""
        try:
            decoded, value = self.worker.call(
                decode_or_refuse, (path, fps, max_frames, self.max_decoded_pixels, self.max_pixels), self.timeout_s)
        except CallTimedOut:
            raise ValueError(f"decoding it took over data.video_decode_timeout_s={self.timeout_s:g}s; stopped") from None
        except CallFailed as err:
            raise ValueError(f"its decoder failed: {err}") from None
        if not decoded:
            raise ValueError(value)
        return value


# ---- the worker's side

def decode_or_refuse(*args) -> tuple[bool, object]:
    """(True, what `decode_video_file(*args)` returned) or (False, why it refused the file), so
    that a refusal comes back as its own words, not as a worker failure."""
    try:
        return True, decode_video_file(*args)
    except MemoryError:
        return False, f"it needs more than the {DECODE_MEMORY_BYTES >> 30} GiB a video decoder may take"
    except Exception as err:  # noqa: BLE001 - as for images, decoders raise many types
        return False, str(err) or type(err).__name__
