"""The in-process engine's KV cache: transformers' DynamicCache with its full-attention layers
preallocated for the batch's whole length and written in place.

transformers' DynamicLayer concatenates each layer's whole cache with the new keys and values
at every decode step (a copy of everything so far, per layer and step); its StaticLayer writes in
place but attends over the whole preallocated length, masked. Here each layer holds
`[rows, kv_heads, capacity, head_dim]` buffers, writes the step's keys and values into the next
columns and hands attention a view up to the filled length: no copy, no masked tail, and rows
that end can still leave the batch. Measured on the tiny recipe's model
(docs/benchmarks/decode_step.md).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One full-attention layer's keys and values, `capacity` positions long at most."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        rows, heads, _, key_dim = key_states.shape
        # MLA's keys and values differ in width
        self._key_buffer = key_states.new_empty(rows, heads, self.capacity, key_dim)
        self._value_buffer = value_states.new_empty(
            rows, value_states.shape[1], self.capacity, value_states.shape[-1]
        )
        self.length = 0
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Write `[rows, heads, new, dim]` keys and values after those so far; all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(
                f"KV cache: {end} positions exceed the {self.capacity} preallocated for this batch"
            )
        self._key_buffer[:, :, self.length : end] = key_states
        self._value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep the rows `indices` (rows that ended leave the batch)."""
        if self.is_initialized:
            self._key_buffer = self._key_buffer[indices]
            self._value_buffer = self._value_buffer[indices]
            self._expose()

    def _expose(self) -> None:
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]


def preallocated_cache(config: PretrainedConfig, capacity: int) -> DynamicCache:
    """A DynamicCache for `config`'s model whose full-attention layers are `PreallocatedLayer`s
    of `capacity` positions (prompt width + new tokens); other kinds of layer (sliding window)
    stay transformers' own."""
    cache = DynamicCache(config=config)
    cache.layers = [
        PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache
