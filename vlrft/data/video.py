"""Video prompt parts: frames from a list of images or a video file, turned into Qwen-VL's
`pixel_values_videos` / `video_grid_thw` and the prompt's video placeholder tokens.

HF's video processors need torchvision, which these CPU machines lack, so the pixels are made
from the checkpoint's image processor instead: each frame is resized and normalised as an image
(the same smart-resize rule), then consecutive frames are joined along the temporal axis of a
patch, which is what the video processors compute (a lone image is its frame repeated). A part
looks like {"type": "video", "video": "clip.mp4" or [frame paths or bytes], "fps": 2.0}: a file
is sampled at `fps` frames per second; a list is frames already sampled at `fps`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image

from vlrft.data.video_file import decode_video_file, spaced

DEFAULT_FPS = 2.0  # frames per second sampled from a video file (Qwen-VL's default)
VIDEO_PAD = "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


@dataclass
class Clip:
    frames: list[Image.Image]  # RGB, all of one size
    indices: list[int]  # each frame's index in the source at `fps` frames per second
    fps: float


def read_clip(part: dict, max_frames: int, load_image, read_file=decode_video_file) -> Clip:
    """The frames of a video part: at most `max_frames`, evenly spaced over the source.
    `load_image` reads one frame given as a path or bytes; `read_file(path, fps, max_frames)`
    a video file (data/video_file.py: in this process by default, the encoder's worker in
    training)."""
    source = part["video"]
    fps = float(part.get("fps", DEFAULT_FPS))
    if isinstance(source, list):
        indices = spaced(len(source), max_frames)
        frames = [load_image(source[i]) for i in indices]
    else:
        frames, indices, fps = read_file(source, fps, max_frames)
    if not frames:
        raise ValueError("no frames")
    if len({f.size for f in frames}) > 1:
        raise ValueError(f"frames differ in size ({sorted({f.size for f in frames})})")
    return Clip(frames, indices, fps)


def video_pixels(clip: Clip, image_processor, size: dict) -> dict[str, torch.Tensor]:
    """`pixel_values_videos` [patches, C·t·p·p] and `video_grid_thw` [1, 3] of one clip, in the
    layout of the Qwen-VL video processors: temporal groups of `temporal_patch_size` frames
    (the last frame repeated to fill the last group), each group's patches in the image order."""
    per_frame = image_processor(images=clip.frames, size=size, return_tensors="pt")
    t = image_processor.temporal_patch_size
    p = image_processor.patch_size
    grid = per_frame["image_grid_thw"][0]  # every frame has the same [1, h, w]
    patches = int(grid[1] * grid[2])
    # Each frame's patches hold the frame `t` times along the temporal axis: keep one copy.
    frames = per_frame["pixel_values"].view(len(clip.frames), patches, 3, t, p, p)[:, :, :, 0]  # [F, N, C, p, p]
    groups = -(-len(clip.frames) // t)
    frames = torch.cat([frames, frames[-1:].expand(groups * t - len(clip.frames), -1, -1, -1, -1)])  # [groups·t, N, C, p, p]
    grouped = frames.view(groups, t, patches, 3, p, p).permute(0, 2, 3, 1, 4, 5)  # [groups, N, C, t, p, p]
    return {
        "pixel_values_videos": grouped.reshape(groups * patches, 3 * t * p * p),
        "video_grid_thw": torch.tensor([[groups, int(grid[1]), int(grid[2])]]),
    }


def group_timestamps(clip: Clip, temporal_patch_size: int) -> list[float]:
    """Seconds at the middle of each temporal group (Qwen3-VL writes them into the prompt)."""
    indices = clip.indices + [clip.indices[-1]] * (-len(clip.indices) % temporal_patch_size)
    seconds = [i / clip.fps for i in indices]
    return [(seconds[g] + seconds[g + temporal_patch_size - 1]) / 2 for g in range(0, len(seconds), temporal_patch_size)]


def video_placeholder(grid_thw: torch.Tensor, merge_size: int, timestamps: list[float] | None) -> str:
    """The tokens that stand for one video inside its <|vision_start|>..<|vision_end|>: one pad
    per merged patch; with `timestamps` (Qwen3-VL), each temporal group as
    "<t seconds><|vision_start|>pads<|vision_end|>", as Qwen3-VL's processor writes it."""
    groups, h, w = (int(v) for v in grid_thw)
    per_group = h * w // merge_size**2
    if timestamps is None:
        return VIDEO_PAD * (groups * per_group)
    return "".join(f"<{t:.1f} seconds>{VISION_START}{VIDEO_PAD * per_group}{VISION_END}" for t in timestamps)

