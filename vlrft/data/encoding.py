"""Prompt encoding: chat messages (with image and video parts) -> chat template -> token ids +
pixel inputs.

Only this module, data/video.py and the model loader know the model family's conventions.
Images are loaded with PIL (or qwen-vl-utils where it imports) and turned into `pixel_values`/
`image_grid_thw` by the checkpoint's own HF image processor, which applies the min/max-pixel
resize rule; videos into `pixel_values_videos`/`video_grid_thw` from the same processor
(data/video.py). The tokenizer + image processor are used directly (not an AutoProcessor)
because processor classes that insist on a video processor need torchvision.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch
from jinja2 import TemplateError
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from vlrft.data.dataset import DataError, image_sources, parts_of
from vlrft.data.images import header_then_pixels, load_rgb_image
from vlrft.data.media import open_media, shown
from vlrft.data.video import VIDEO_PAD, Clip, group_timestamps, read_clip, video_placeholder, video_pixels
from vlrft.data.video_file import VIDEO_DECODE_TIMEOUT_S, VIDEO_MAX_DECODED_PIXELS, VideoFiles
from vlrft.types import Prompt

IMAGE_PAD = "<|image_pad|>"
# mm_token_type_ids: 0 text, 1 image, 2 video (the Qwen-VL models' numbering)
TOKEN_TYPES = {IMAGE_PAD: 1, VIDEO_PAD: 2}


try:  # qwen-vl-utils imports torchvision at import time; use it only where that works.
    from qwen_vl_utils import fetch_image as _qwen_fetch_image
except Exception:  # noqa: BLE001 - any import failure means "not usable here"
    _qwen_fetch_image = None


def json_safe(messages: list[dict]) -> list[dict]:
    """The messages with each image given as bytes replaced by "<image k>" (its place among
    the row's images): recipes and the reward server's JSON see the text, `images` the pixels."""
    k = 0
    out = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            parts = []
            for part in content:
                if part["type"] == "image":
                    if isinstance(part.get("image"), bytes):
                        part = {**part, "image": f"<image {k}>"}
                    k += 1
                elif part["type"] == "video" and isinstance(part["video"], list):
                    part = {**part, "video": [f if isinstance(f, str) else f"<frame {i}>" for i, f in enumerate(part["video"])]}
                parts.append(part)
            content = parts
        out.append({**message, "content": content})
    return out


class _Refused(Exception):
    """A row's image refused by its header (load_images): the DataError's text after the row."""


class PromptEncoder:
    def __init__(
        self, model_path: str, min_pixels: int, max_pixels: int, max_prompt_tokens: int,
        max_frames: int = 32, video_max_pixels: int = 128 * 28 * 28, video_refusal: str = "",
        video_max_decoded_pixels: int = VIDEO_MAX_DECODED_PIXELS, video_decode_timeout_s: float = VIDEO_DECODE_TIMEOUT_S,
    ):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        has_vision = (Path(model_path) / "preprocessor_config.json").is_file()
        self.image_processor = AutoImageProcessor.from_pretrained(model_path) if has_vision else None
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.max_prompt_tokens = max_prompt_tokens
        self.max_frames = max_frames  # frames per video, evenly spaced over the clip
        self.video_max_pixels = video_max_pixels  # per frame
        self.video_refusal = video_refusal  # why a video prompt cannot be used, or "" when it can
        # Video files: decoded in a worker process, killed at the timeout (data/video_file.py).
        self.video_files = VideoFiles(video_decode_timeout_s, video_max_decoded_pixels, video_max_pixels)
        has_config = (Path(model_path) / "config.json").is_file()  # not yet while a tiny model warms up
        family = AutoConfig.from_pretrained(model_path).model_type if has_vision and has_config else ""
        # Qwen3-VL writes each frame group's time into the prompt; Qwen2.5-VL takes the seconds
        # per temporal group as an input of its rope index instead (Qwen2-VL neither).
        self.video_timestamps = family.startswith("qwen3")
        self.seconds_per_grid = family == "qwen2_5_vl"

    @classmethod
    def for_config(cls, cfg) -> "PromptEncoder":
        """The encoder of a run's `model.path` and `data.*` settings."""
        data = cfg.data
        refusal = "" if cfg.rollout.engine == "hf" else f"video prompts need rollout.engine: hf (not {cfg.rollout.engine!r})"
        return cls(cfg.model.path, data.min_pixels, data.max_pixels, data.max_prompt_tokens, data.max_frames,
                   data.video_max_pixels, refusal, data.video_max_decoded_pixels, data.video_decode_timeout_s)

    def load_image(self, source: str | bytes) -> Image.Image:
        """An image from its path (opened by `open_media`: beneath its root, no symlinks) or its
        encoded bytes (parquet and HF data sets)."""
        return self._processed(self._read(source, self.max_pixels))

    def _processed(self, image: Image.Image) -> Image.Image:
        if _qwen_fetch_image is not None:  # given the pixels, never the path: it would open the file itself
            return _qwen_fetch_image({"image": image, "min_pixels": self.min_pixels, "max_pixels": self.max_pixels})
        return image

    @staticmethod
    def _read(source: str | bytes, max_pixels: int) -> Image.Image:
        if isinstance(source, bytes):
            return load_rgb_image(io.BytesIO(source), max_pixels=max_pixels)
        with open_media(source) as file:
            return load_rgb_image(file, max_pixels=max_pixels)

    @contextlib.contextmanager
    def _header_then_pixels(self, source: str | bytes):
        """(the size `load_image` hands the image processor, from the header; its decoder), the
        file read once (a path opened by `open_media`)."""
        if isinstance(source, bytes):
            with header_then_pixels(io.BytesIO(source), self.max_pixels) as opened:
                yield opened
            return
        with open_media(source) as file, header_then_pixels(file, self.max_pixels) as opened:
            yield opened

    def image_tokens(self, width: int, height: int) -> int:
        """The tokens an image of this size becomes, resized into [min_pixels, max_pixels], as the
        image processor counts them; 0 where it cannot tell (the prompt's length is then checked
        once its images are decoded). ValueError for a size it refuses (aspect ratio)."""
        count = getattr(self.image_processor, "get_number_of_image_patches", None)
        if count is None:
            return 0
        patches = count(height, width, {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels})
        return patches // getattr(self.image_processor, "merge_size", 1) ** 2

    def load_images(self, sources: list, where: str) -> list[Image.Image]:
        """A row's images, in order. Each image's tokens are counted from its header before any
        is decoded: a row may name one image many times (80 parts of a 16 KB PNG held 5.7 GiB),
        and its prompt would be refused for its length only after all were decoded."""
        images, tokens = [], 0
        for k, source in enumerate(sources):
            name = shown(source) if isinstance(source, str) else f"{k} ({len(source)} bytes)"
            try:
                image, tokens = self._counted_image(source, k, tokens)
            except _Refused as err:
                raise DataError(f"{where}: {err}") from None
            except Exception as err:  # noqa: BLE001 - PIL's decoders raise many types (OSError,
                # SyntaxError, ValueError, EOFError, DecompressionBomb*) for a corrupt user file
                raise DataError(f"{where}: cannot read image {name} ({err})") from None
            images.append(image)
        return images

    def _counted_image(self, source: str | bytes, k: int, tokens: int) -> tuple[Image.Image, int]:
        """Image `k` of a row whose images before it took `tokens`: (it, decoded, and the
        tokens with it), or _Refused past data.max_prompt_tokens before it is decoded. The file
        is read once: its header counted, its pixels decoded from the same bytes. (A function of
        its own: the opened file and its bytes go when it returns, not when the next is read.)"""
        with self._header_then_pixels(source) as (size, decode):
            try:
                tokens += self.image_tokens(*size)
            except ValueError as err:  # e.g. smart_resize: "absolute aspect ratio must be smaller than 200"
                raise _Refused(f"cannot use its image ({err})") from None
            if tokens > self.max_prompt_tokens:
                raise _Refused(f"its first {k + 1} images alone take {tokens} tokens > "
                               f"data.max_prompt_tokens={self.max_prompt_tokens} (refused before decoding them)")
            return self._processed(decode()), tokens

    def encode(self, row: dict, index: int) -> Prompt:
        """A canonical dataset row -> Prompt (its image parts' files are loaded here)."""
        where = f"row id {row['id']!r}"
        sources = image_sources(row)
        if sources and self.image_processor is None:
            raise DataError(f"{where} has images but the model checkpoint has no image processor")
        images = self.load_images(sources, where)
        clips = []
        for k, part in enumerate(parts_of(row, "video")):
            if self.image_processor is None or self.video_refusal:
                raise DataError(f"{where} has a video: {self.video_refusal or 'the model checkpoint has no image processor'}")
            try:
                clips.append(read_clip(part, self.max_frames, self.load_video_frame, self.video_files.read))
            except Exception as err:  # noqa: BLE001 - as for images, decoders raise many types
                name = shown(part["video"]) if isinstance(part["video"], str) else f"{k} ({len(part['video'])} frames)"
                raise DataError(f"{where}: cannot read video {name} ({err})") from None
        return self.encode_with_images(row, images, index, clips)

    def load_video_frame(self, source: str | bytes) -> Image.Image:
        return self._read(source, self.video_max_pixels)

    def encode_with_images(self, row: dict, images: list[Image.Image], index: int, clips: list[Clip] = ()) -> Prompt:
        """A row whose image parts are already loaded as `images` and video parts as `clips`
        (each in order) -> Prompt."""
        where = f"row id {row['id']!r}"
        messages = json_safe(row["messages"])
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as err:  # the model's template refuses the messages (`raise_exception`)
            raise DataError(f"{where}: the chat template refuses its messages ({err})") from None
        mm_inputs = self.image_inputs(images, where) | self._video_inputs(clips, where)
        expanded = self.expand_image_pads(text, mm_inputs, where, len(images))
        expanded = self._expand_video_pads(expanded, mm_inputs, clips, where)
        ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        token_types = self.token_types(ids) if self.image_processor is not None else []
        if len(ids) > self.max_prompt_tokens:
            raise DataError(f"{where}: prompt has {len(ids)} tokens > data.max_prompt_tokens={self.max_prompt_tokens}")
        return Prompt(
            id=str(row["id"]),
            data_source=row["data_source"],
            answer=row["answer"],
            meta=row["meta"],
            prompt_text=text,
            prompt_ids=ids,
            images=images,
            mm_inputs=mm_inputs,
            mm_token_types=token_types,
            index=index,
            messages=messages,
        )

    def image_inputs(self, images: list[Image.Image], where: str) -> dict:
        """The images' pixel inputs (`pixel_values`, `image_grid_thw`), resized into
        [min_pixels, max_pixels]; {} without images."""
        if not images:
            return {}
        if self.image_processor is None:
            raise DataError(f"{where} has images but the model checkpoint has no image processor")
        size = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        try:
            return dict(self.image_processor(images=images, size=size, return_tensors="pt"))
        except ValueError as err:  # e.g. smart_resize: "absolute aspect ratio must be smaller than 200"
            raise DataError(f"{where}: cannot use its image ({err})") from None

    def token_types(self, ids: list[int]) -> list[int]:
        """Each token's modality id (TOKEN_TYPES: 1 image pad, 2 video pad, else 0 text)."""
        types = {self.tokenizer.convert_tokens_to_ids(token): kind for token, kind in TOKEN_TYPES.items()}
        return [types.get(t, 0) for t in ids]

    def expand_image_pads(self, text: str, mm_inputs: dict, where: str, n_images: int) -> str:
        """Replace each image's single pad token with one pad per merged patch."""
        pieces = text.split(IMAGE_PAD)
        if len(pieces) - 1 != n_images:
            raise DataError(f"{where}: chat template produced {len(pieces) - 1} image slots for {n_images} images")
        if not n_images:
            return text
        merge = self.image_processor.merge_size**2
        counts = [int(thw.prod()) // merge for thw in mm_inputs["image_grid_thw"]]
        out = pieces[0]
        for count, piece in zip(counts, pieces[1:]):
            out += IMAGE_PAD * count + piece
        return out

    def _video_inputs(self, clips: list[Clip], where: str) -> dict:
        """The clips' pixel inputs (data/video.py), concatenated in order; {} without videos."""
        if not clips:
            return {}
        size = {"shortest_edge": self.min_pixels, "longest_edge": self.video_max_pixels}
        try:
            per_clip = [video_pixels(clip, self.image_processor, size) for clip in clips]
        except ValueError as err:
            raise DataError(f"{where}: cannot use its video ({err})") from None
        out = {key: torch.cat([c[key] for c in per_clip]) for key in per_clip[0]}
        if self.seconds_per_grid:
            t = self.image_processor.temporal_patch_size
            out["second_per_grid_ts"] = torch.tensor([t / clip.fps for clip in clips])
        return out

    def _expand_video_pads(self, text: str, mm_inputs: dict, clips: list[Clip], where: str) -> str:
        """Replace each video's single pad token with its frames' tokens (data/video.py)."""
        pieces = text.split(VIDEO_PAD)
        if len(pieces) - 1 != len(clips):
            raise DataError(f"{where}: chat template produced {len(pieces) - 1} video slots for {len(clips)} videos")
        out = pieces[0]
        t = self.image_processor.temporal_patch_size if clips else 0
        for clip, grid, piece in zip(clips, mm_inputs.get("video_grid_thw", []), pieces[1:]):
            stamps = group_timestamps(clip, t) if self.video_timestamps else None
            out += video_placeholder(grid, self.image_processor.merge_size, stamps) + piece
        return out
