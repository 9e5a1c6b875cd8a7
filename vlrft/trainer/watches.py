"""Slow failures that never raise, watched step by step: a reward component stuck at nothing
while the others pay (a verifier broken behind a format bonus), and memory that only grows.
Both warn with one line naming what they saw; the math is in pure functions."""

from __future__ import annotations

import os
import resource
from collections import deque

import torch

MIB = 2**20
GIB = 2**30
# Growth under this over a whole window is allocator noise, not a leak.
MIN_WINDOW_GROWTH = 64 * MIB


def stuck_components(ranges: dict[str, tuple[float, float]]) -> list[str]:
    """Components (name -> (lowest, highest) score over the step's samples) that gave every
    sample the same score of 0 or less while another component gave some sample more than 0."""
    paying = {name for name, (_, high) in ranges.items() if high > 0}
    return sorted(name for name, (low, high) in ranges.items() if low == high <= 0 and paying - {name})


def merge_ranges(per_rank: list[dict[str, tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    """Per-rank (lowest, highest) of each component merged into one over all ranks."""
    merged: dict[str, tuple[float, float]] = {}
    for ranges in per_rank:
        for name, (low, high) in ranges.items():
            old = merged.get(name, (low, high))
            merged[name] = (min(old[0], low), max(old[1], high))
    return merged


def component_ranges(components: list[dict[str, float]], names: list[str]) -> dict[str, tuple[float, float]]:
    """(lowest, highest) score of each top-level component among the samples that have it."""
    ranges = {}
    for name in names:
        scores = [c[name] for c in components if name in c]
        if scores:
            ranges[name] = (min(scores), max(scores))
    return ranges


class ComponentWatch:
    """Counts, per component, consecutive steps it was stuck (`stuck_components`)."""

    def __init__(self, patience: int):
        self.patience = patience  # 0 = off
        self.streaks: dict[str, int] = {}

    def update(self, stuck: list[str]) -> list[str]:
        """Record one step; the components whose streak reaches the patience now (once per streak)."""
        self.streaks = {name: self.streaks.get(name, 0) + 1 for name in stuck}
        return [name for name, streak in self.streaks.items() if self.patience > 0 and streak == self.patience]


def host_rss_bytes() -> int:
    """This process's resident memory now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_metrics() -> dict[str, float]:
    """This rank's host RSS and, on CUDA, its allocated and reserved accelerator memory (GiB)."""
    metrics = {"perf/host_rss_gib": host_rss_bytes() / GIB}
    if torch.cuda.is_available():
        metrics["perf/cuda_allocated_gib"] = torch.cuda.memory_allocated() / GIB
        metrics["perf/cuda_reserved_gib"] = torch.cuda.memory_reserved() / GIB
    return metrics


def growth_slope(values: list[float]) -> float:
    """Least-squares slope of `values` per step."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    spread = sum((x - mean_x) ** 2 for x in range(n))
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / spread if spread else 0.0


def only_grows(values: list[float], min_growth: float) -> bool:
    """Never lower than the step before, and higher by at least `min_growth` over all of them."""
    return all(b >= a for a, b in zip(values, values[1:])) and values[-1] - values[0] >= min_growth


class MemoryWatch:
    """A memory series (bytes, one value per step) that grew at every step of a full window."""

    def __init__(self, window: int):
        self.window = window  # 0 = off
        self.values: deque[float] = deque(maxlen=max(window, 1))

    def update(self, value: float) -> float | None:
        """Record one step; the slope (bytes per step) when the window shows only growth, then
        a fresh window (one warning per window of growth)."""
        if self.window < 2:
            return None
        self.values.append(value)
        if len(self.values) < self.window or not only_grows(list(self.values), MIN_WINDOW_GROWTH):
            return None
        slope = growth_slope(list(self.values))
        self.values.clear()
        return slope


class CompileWatch:
    """torch.compile's compilations step by step (`perf/compiles`). The first steps compile
    (the first shapes, the switch to symbolic lengths, the no-grad passes); compiling again at
    every one of `patience` steps in a row means a guard fails every time (a shape or Python
    value the compiled code depends on changes each step): each recompile costs seconds, and
    past torch's recompile limit the layer silently runs eagerly."""

    def __init__(self, frames: int, patience: int = 5):
        self.frames, self.patience, self.streak = frames, patience, 0

    def update(self, frames: int) -> tuple[int, bool]:
        """Record the process's compiled-frame count after a step: (frames compiled during the
        step, whether this step completes a streak of `patience` compiling steps)."""
        new, self.frames = frames - self.frames, frames
        self.streak = self.streak + 1 if new else 0
        return new, self.streak == self.patience
