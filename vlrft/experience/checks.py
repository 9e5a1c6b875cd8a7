"""Pre-forward input checks: a sample whose image (or video) tokens do not match its pixel
patches would crash the forward ("Image features and image tokens do not match") on one rank
and hang the others; it is found here first and named."""

from __future__ import annotations

from dataclasses import dataclass

from vlrft.models.collate import rollout_of


@dataclass
class ImageTokenCheck:
    image_token_id: int  # the checkpoint's <|image_pad|> id
    merge_size: int  # vision_config.spatial_merge_size: patches merged per token along each side
    video_token_id: int | None = None  # its <|video_pad|> id

    @classmethod
    def for_model(cls, config) -> "ImageTokenCheck | None":
        """The check for a vision-language checkpoint's config; None for a text model."""
        vision = getattr(config, "vision_config", None)
        if vision is None or getattr(config, "image_token_id", None) is None:
            return None
        return cls(config.image_token_id, vision.spatial_merge_size, getattr(config, "video_token_id", None))

    def problem(self, sample) -> str | None:
        """None when the sample's image (and video) token counts equal its patches /
        merge_size^2, else a one-line description naming the sample."""
        r = rollout_of(sample)
        tokens = r.prompt.prompt_ids + r.response_ids
        for what, token_id, grid_key in (("image", self.image_token_id, "image_grid_thw"), ("video", self.video_token_id, "video_grid_thw")):
            grid = r.mm_inputs().get(grid_key)  # [images or videos, 3]
            expected = int((grid.prod(-1) // self.merge_size**2).sum()) if grid is not None else 0
            found = tokens.count(token_id) if token_id is not None else 0
            if found != expected:
                return f"sample {r.prompt.id!r} has {found} {what} tokens but its {what}s give {expected} ({grid_key})"
        return None

    def first_problem(self, samples: list) -> str | None:
        return next((p for p in map(self.problem, samples) if p is not None), None)
