"""Which modalities a vision-language run's vision tower is called for (models/vision_calls.py):
those its data can hold, agreed by every rank that trains."""

from __future__ import annotations

import torch

from vlrft.data.dataset import modalities_of
from vlrft.distributed import all_reduce_sum
from vlrft.models.vision_calls import ALL_MODALITIES, declare_modalities


def data_modalities(train_rows: list[dict], ptx_modalities: set[str], environment_shows_images: bool) -> set[str]:
    """The vision modalities ("image", "video") the run's micro-batches can hold: those of any
    training or PTX row, and images when the run's environment may show some in an observation
    (multiturn/environment.py, shows_images). From whole data files, so the same on every rank."""
    return modalities_of(train_rows) | ptx_modalities | ({"image"} if environment_shows_images else set())


def agree_modalities(backbones: list[torch.nn.Module], modalities: set[str], announce: bool) -> None:
    """Declare on `backbones` (the first is the policy's) the union over the ranks that train of
    `modalities` and what is declared already: the set only grows (the step API's rows may add
    one). A collective of those ranks, so that a rank whose data files differ (media one node
    cannot see) cannot make its vision calls differ. `announce`: print the set when it changes."""
    declared = getattr(backbones[0], "vision_modalities", None)
    wanted = torch.tensor([float(m in modalities or m in (declared or ())) for m in ALL_MODALITIES])
    union = {m for m, count in zip(ALL_MODALITIES, all_reduce_sum(wanted).tolist()) if count > 0}
    if declared is not None and union == set(declared):
        return
    for backbone in backbones:
        declare_modalities(backbone, union)
    if announce:
        held = " and ".join(f"{m}s" for m in sorted(union))
        print(f"vlrft: the vision tower runs for {held} in every micro-batch (what the data holds)" if held
              else "vlrft: the vision tower is never called: the data holds no images or videos")
