"""A KV cache for the HF engine's decoding loop that is written in place.

transformers' `DynamicCache` grows each layer's keys and values by `torch.cat` at every
decoding step: a copy of the whole cache per layer per token. On the CPU that copy took a fifth
of the decoding time of a 25M model (32 sequences x 64 tokens). Here each layer allocates its
buffers once, for the prompt and every new token, writes each step's keys and values into the
next free slots, and hands attention a view of the filled part. Attention sees the same
tensors of the same length as with `DynamicCache` (the same mask, the same sums), so the
logprobs do not change.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One decoder layer's keys and values: [B, heads, capacity, head_dim] buffers; `keys` and
    `values` are views of the first `length` positions (what `DynamicLayer` would hold)."""

    is_croppable = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, _ = key_states.shape
        self.key_buffer = key_states.new_empty((batch, heads, self.capacity, key_states.shape[-1]))
        self.value_buffer = value_states.new_empty((batch, value_states.shape[1], self.capacity, value_states.shape[-1]))
        self.length = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} positions, room for {self.capacity}")
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` (finished responses leave the decoding batch)."""
        if self.is_initialized:
            self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
            self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]


def decoding_cache(config, capacity: int) -> Cache:
    """A cache for decoding at most `capacity` positions (prompt + new tokens) with a model of
    `config`: preallocated layers where every layer attends to the whole sequence, transformers'
    `DynamicCache` otherwise (sliding-window layers keep their own bookkeeping)."""
    text = config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    if any(kind != "full_attention" for kind in layer_types):
        return DynamicCache(config=config)
    return Cache(layers=[PreallocatedLayer(capacity) for _ in layer_types])
