"""Metric sinks. Rank 0 writes; values are already reduced over ranks."""

from vlrft.metrics.sinks import ConsoleSink, JsonlSink, MetricsLogger

__all__ = ["ConsoleSink", "JsonlSink", "MetricsLogger"]
