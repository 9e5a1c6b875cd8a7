"""The training-backend protocol: forward, accumulate, step, hand out full weights, save."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Protocol

import torch


class TrainBackend(Protocol):
    model: torch.nn.Module  # call it for forwards; it may be a sharding wrapper

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        """Accumulate gradients of `loss` (used as given, never rescaled); `boundary` marks the
        last micro-batch of an optimizer step."""

    def step(self) -> float:
        """Apply the accumulated update; returns the global gradient norm before clipping."""

    def skip_step(self) -> None:
        """End the step without an update (a non-finite loss somewhere): drop the accumulated
        gradients; parameters, optimizer state and lr schedule stay as they were."""

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full unsharded tensor) of every parameter; collective under sharding."""

    def save_hf(self, out_dir: Path) -> None:
        """Write an HF checkpoint of the policy (collective; rank 0 writes)."""

    def save_state_dict(self, out_file: Path) -> None:
        """torch.save the full state dict (collective; rank 0 writes), for non-HF modules."""

    def save_checkpoint(self, out_dir: Path) -> None:
        """Model, optimizer and lr-scheduler state as sharded (collective; every rank writes)."""

    def load_checkpoint(self, in_dir: Path, schedule: bool = True) -> None:
        """Restore what `save_checkpoint` wrote (collective); `schedule=False` keeps the current
        learning-rate schedule (a rollback: trainer/rollback.py)."""

    def scale_lr(self, factor: float) -> None:
        """Multiply the learning rate by `factor` from this step on (every parameter group)."""
