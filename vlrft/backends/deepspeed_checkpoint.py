"""DeepSpeed's checkpoint files, read without unpickling code.

DeepSpeed reads every file of a checkpoint (the model states, each rank's ZeRO optimizer
partition) through its engine's `checkpoint_engine`, whose `torch.load` is `weights_only=False`:
a pickle planted there would run when a run resumes. vlrft puts its own engine in its place:
DeepSpeed's (saves unchanged), loading with `weights_only=True` and an explicit allow-list, the
few DeepSpeed classes its states hold (DEEPSPEED_STATE_CLASSES, trainer/checkpoint_read.py). A
file holding anything else is refused in one line naming it (ConfigError), before any of it
runs. Rank 0 has probed every file already (trainer/checkpoint.py, `check_checkpoint`).
Imported by deepspeed_backend.py, after the environment it sets for DeepSpeed's import.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from vlrft.trainer.checkpoint_read import DEEPSPEED_STATE_CLASSES, load_state


def state_classes() -> list[type]:
    """The classes DEEPSPEED_STATE_CLASSES names, imported from DeepSpeed."""
    classes = []
    for name in DEEPSPEED_STATE_CLASSES:
        module, _, attribute = name.rpartition(".")
        classes.append(getattr(importlib.import_module(module), attribute))
    return classes


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch.save engine whose load unpickles tensors, plain data and
    DEEPSPEED_STATE_CLASSES only."""

    classes = state_classes()

    def load(self, path: str, map_location=None):
        return load_state(Path(path), map_location, self.classes)


def use_weights_only_loads(engine) -> None:
    """Load `engine`'s (a DeepSpeedEngine's) checkpoints with WeightsOnlyCheckpointEngine. Its
    state is taken over as it is (DeepSpeed's serialization settings: saves are unchanged)."""
    current = engine.checkpoint_engine
    if type(current) is not TorchCheckpointEngine:  # DeepSpeed picks another only for config keys vlrft never sets
        raise RuntimeError(f"DeepSpeed chose checkpoint engine {type(current).__name__}; vlrft loads through TorchCheckpointEngine only")
    safe = WeightsOnlyCheckpointEngine.__new__(WeightsOnlyCheckpointEngine)
    safe.__dict__.update(current.__dict__)
    engine.checkpoint_engine = safe
