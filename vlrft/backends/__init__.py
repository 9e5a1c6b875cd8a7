"""Training backends behind the TrainBackend protocol."""

from vlrft.backends.base import TrainBackend

__all__ = ["TrainBackend"]
