"""Console progress bar and JSONL metric sinks."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm


class JsonlSink:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class ConsoleSink:
    """A tqdm bar over RL steps with the headline numbers; eval results get their own line."""

    KEYS = {"rollout/reward_mean": "reward", "train/kl": "kl", "rollout/response_length": "len"}

    def __init__(self, total_steps: int, start_step: int = 0):
        self.total_steps, self.start_step = total_steps, start_step
        self.bar: tqdm | None = None  # drawn at the first metrics: a trainer that never logs draws none

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.bar is None:
            self.bar = tqdm(total=self.total_steps, initial=self.start_step, desc="vlrft", unit="step", dynamic_ncols=True)
        if "eval/accuracy" in metrics:
            self.bar.write(f"step {step:4d}  held-out accuracy {metrics['eval/accuracy']:.3f}")
        if "rollout/reward_mean" in metrics:
            self.bar.set_postfix({short: f"{metrics[k]:.3f}" for k, short in self.KEYS.items() if k in metrics})
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricsLogger:
    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.write(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
