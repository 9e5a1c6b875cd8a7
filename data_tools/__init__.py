"""Offline data and tiny-model builders for vlrft (synthetic tasks, toy checkpoints)."""
