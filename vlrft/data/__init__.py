"""Prompt datasets, prompt encoding and the rank-aware sampler."""
