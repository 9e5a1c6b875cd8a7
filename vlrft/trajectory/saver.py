"""Save each scored rollout of a step as one JSONL line, with its prompt images as PNG files.

Layout under `run_dir/trajectories/`:
  step_000010.rank0.jsonl   one line per experience of rank 0 at step 10
  images/<sha256[:20]>.png  each distinct image once, named by the hash of its PNG bytes

Every file appears atomically (written to a uniquely named temporary file in the same
directory, then `os.replace`d), so a reader never sees half a step and two ranks that store
the same image at the same time never leave a partial PNG. A step's images are stored before
its JSONL appears, so every image a visible line names exists.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import uuid
from pathlib import Path

import torch

from vlrft.types import Experience

IMAGE_DIR = "images"
IMAGE_HASH_CHARS = 20
SIGNIFICANT_DIGITS = 6
# Modes PNG stores as they are; anything else (CMYK, YCbCr, F, ...) is stored as RGB.
PNG_MODES = {"1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"}


def rounded(value: float) -> float | None:
    """`value` to SIGNIFICANT_DIGITS significant digits; None for NaN/inf (JSON has neither)."""
    value = float(value)
    if not math.isfinite(value):
        return None
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}")


def rounded_list(values) -> list[float | None] | None:
    """A per-token tensor (or list) as rounded floats; None stays None."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        values = values.detach().float().tolist()
    return [rounded(v) for v in values]


def component_value(value) -> float | None:
    """A reward component as one number: None (not applicable) stays None, a dense per-token
    list counts by its sum."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return rounded(sum(float(v) for v in value))
    return rounded(value)


def mean_advantage(experience: Experience) -> float | None:
    """Mean advantage over the generated response tokens (0.0 when none was computed)."""
    advantages = experience.advantages
    if advantages is None or advantages.numel() == 0:
        return 0.0
    trained = experience.rollout.trained_mask()
    return rounded(float((advantages.float() * trained).sum() / trained.sum().clamp(min=1.0)))


def png_bytes(image) -> bytes:
    """The image encoded as PNG with fixed settings, so the same pixels give the same bytes."""
    if image.mode not in PNG_MODES:
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False, compress_level=6)
    return buffer.getvalue()


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that `path` is either absent or complete, never partial.

    The temporary name is unique per process and call, so concurrent writers never share one;
    it is opened with plain `open` (not mkstemp) so the file gets the usual umask permissions."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def store_image(image, trajectory_dir: Path) -> str:
    """Store `image` once under `trajectory_dir/images/`; return its path relative to
    `trajectory_dir`."""
    data = png_bytes(image)
    relative = f"{IMAGE_DIR}/{hashlib.sha256(data).hexdigest()[:IMAGE_HASH_CHARS]}.png"
    path = trajectory_dir / relative
    if not path.exists():  # another rank or an earlier step may already have written it
        atomic_write(path, data)
    return relative


def stats_record(experience: Experience, correct: float) -> dict:
    """The fields the analysis statistics read (`analysis.summarise`), rounded as saved."""
    rollout = experience.rollout
    return {
        "data_source": rollout.prompt.data_source,
        "group_id": int(rollout.group_id),
        "response_text": rollout.response_text,
        "entropy": rounded_list(experience.entropy),
        "reward": rounded(experience.reward),
        "components": {name: component_value(v) for name, v in experience.reward_components.items()},
        "response_length": len(rollout.response_ids),
        "truncated": bool(rollout.truncated),
        "correct": rounded(correct),
    }


def trajectory_record(
    step: int,
    rank: int,
    experience: Experience,
    correct: float,
    image_paths: list[str],
    response_tokens: list[str],
    observation_image_paths: list[str] = (),
) -> dict:
    """One JSONL line: the prompt, the response (text, ids, each token's text), per-token
    logprobs/entropy, reward, components, mean advantage and correctness; for multi-turn
    trajectories also the turns (action, observation, reward, error) and per token whether the
    policy generated it (`trained`: 0 on observations), and the files of the images the
    environment showed (`observation_images`, in order; a turn's "images" counts its own)."""
    rollout = experience.rollout
    multi_turn = {"turns": rollout.turns, "trained": rollout.trained} if rollout.trained is not None else {}
    if observation_image_paths:
        multi_turn["observation_images"] = list(observation_image_paths)
    return {
        "step": step,
        "rank": rank,
        "id": str(rollout.prompt.id),
        "prompt_text": rollout.prompt.prompt_text,
        "images": image_paths,
        "response_ids": [int(t) for t in rollout.response_ids],
        "response_tokens": response_tokens,
        "logprobs": rounded_list(experience.old_logprobs),
        "advantage": mean_advantage(experience),
        **stats_record(experience, correct),
        **multi_turn,
    }


class TrajectorySaver:
    """Writes `run_dir/trajectories/step_{step:06d}.rank{rank}.jsonl` every `save_every` steps
    (and at the last step); `save_every=0` turns saving off."""

    def __init__(self, run_dir: Path, rank: int, tokenizer, save_every: int):
        self.trajectory_dir = Path(run_dir) / "trajectories"
        self.rank = rank
        self.tokenizer = tokenizer
        self.save_every = save_every

    def due(self, step: int, total_steps: int) -> bool:
        return self.save_every > 0 and (step % self.save_every == 0 or step == total_steps)

    def save(self, step: int, experiences: list[Experience], correct: list[float]) -> Path:
        if len(correct) != len(experiences):
            raise ValueError(f"{len(correct)} correctness values for {len(experiences)} experiences")
        (self.trajectory_dir / IMAGE_DIR).mkdir(parents=True, exist_ok=True)
        # Responses of one prompt share its image objects: encode and hash each object once.
        image_paths: dict[int, str] = {}
        token_texts: dict[int, str] = {}
        lines = []
        for experience, ok in zip(experiences, correct):
            images, shown = experience.rollout.prompt.images, experience.rollout.observation_images
            for image in images + shown:
                if id(image) not in image_paths:
                    image_paths[id(image)] = store_image(image, self.trajectory_dir)
            for token in experience.rollout.response_ids:
                if token not in token_texts:
                    token_texts[token] = self.tokenizer.decode([token])
            record = trajectory_record(
                step,
                self.rank,
                experience,
                ok,
                [image_paths[id(image)] for image in images],
                [token_texts[token] for token in experience.rollout.response_ids],
                [image_paths[id(image)] for image in shown],
            )
            lines.append(json.dumps(record, ensure_ascii=False, allow_nan=False))
        path = self.trajectory_dir / f"step_{step:06d}.rank{self.rank}.jsonl"
        atomic_write(path, "".join(line + "\n" for line in lines).encode("utf-8"))
        return path
