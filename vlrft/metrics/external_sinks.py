"""Metric sinks backed by optional packages: Weights & Biases and TensorBoard.

The only module that imports wandb or tensorboard, and only inside the constructors, so
importing vlrft never needs either.
"""

from __future__ import annotations

from pathlib import Path

from vlrft.errors import VlrftError

WANDB_MODES = ("offline", "online")


class MissingSinkPackage(VlrftError, ImportError):
    """A configured metric sink needs a package that is not installed."""


class WandbSink:
    """Logs every write as part of the history row of its step; `mode="offline"` keeps the run
    on disk under `run_dir/wandb/` (upload it later with `wandb sync`)."""

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict, mode: str, resumed: bool = False):
        if mode not in WANDB_MODES:
            raise ValueError(f"logging.wandb: unknown mode '{mode}'; valid: {', '.join(WANDB_MODES)}")
        try:
            import wandb
        except ImportError as error:
            raise MissingSinkPackage(
                "logging.wandb is set but the wandb package is not installed: pip install 'vlrft[wandb]'"
            ) from error
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        # A resumed training run continues its W&B run (same id) instead of starting another.
        id_file = run_dir / "wandb" / "run_id"
        same_run = {"id": id_file.read_text().strip(), "resume": "allow"} if resumed and id_file.is_file() else {}
        self.run = wandb.init(dir=str(run_dir), project=project, name=run_name, config=config, mode=mode, **same_run)
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(self.run.id)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        # wandb merges writes that share a step into one history row (the trainer logs eval
        # metrics in a second write at the training step) and commits the row when a later
        # step arrives or the run finishes; steps must not decrease.
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()
        # `finish` returns before wandb's service process has flushed the run's `.wandb` file
        # (seen empty right after `finish` on a busy machine); `teardown` waits for the service
        # to exit, so the run is complete on disk when `close` returns.
        self.wandb.teardown()


class TensorboardSink:
    """Writes each metric as a TensorBoard scalar (tag = metric name) at `step`."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise MissingSinkPackage(
                "logging.tensorboard is set but the tensorboard package is not installed: pip install tensorboard"
            ) from error
        # purge_step: a resumed run hides the events the killed run wrote after its checkpoint.
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def configured_sinks(logging, run_dir: Path, config: dict, start_step: int = 0) -> list:
    """The optional sinks the `logging` config section turns on (rank 0 builds them);
    `start_step` > 0 when the run resumes from a checkpoint of that step."""
    sinks: list = []
    if logging.wandb != "disabled":
        sinks.append(WandbSink(run_dir, logging.wandb_project, Path(run_dir).name, config, logging.wandb,
                               resumed=start_step > 0))
    if logging.tensorboard:
        sinks.append(TensorboardSink(Path(run_dir) / "tensorboard", purge_step=start_step + 1 if start_step else None))
    return sinks
