"""Key/value cache for incremental decoding (Megatron's ``InferenceParams``).

Generation runs the prompt once, then one position per new token: each attention layer appends
that position's keys and values to buffers preallocated for the whole generation and attends over
everything cached so far. The training path never builds one of these (the argument defaults to
None), so it is unaffected.

The cache also carries what every layer of one forward step shares: how many positions are already
cached (``offset``, also the rotary position of the first new query) and the attention ``mask``
``[batch, 1, new, offset + new]`` (True where a query may attend), which the caller builds from the
padding of the batch (see ``megatron_ds.inference.generate``).
"""
from __future__ import annotations

import torch


class KVCache:
    """Keys and values of up to ``max_length`` positions for every layer of one batch."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.offset = 0
        self.mask: torch.Tensor | None = None
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, layer_number: int) -> "LayerKVCache":
        return LayerKVCache(self, layer_number)

    def store(self, layer_number: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` ``[new, batch, groups, d]`` at ``offset``; return all cached positions."""
        end = self.offset + k.shape[0]
        if end > self.max_length:
            raise ValueError(f"KV cache holds {self.max_length} positions; {end} were asked for")
        if layer_number not in self._buffers:
            # (multi-latent attention's values are narrower than its keys)
            self._buffers[layer_number] = (k.new_empty(self.max_length, *k.shape[1:]),
                                           v.new_empty(self.max_length, *v.shape[1:]))
        k_buf, v_buf = self._buffers[layer_number]
        k_buf[self.offset:end] = k
        v_buf[self.offset:end] = v
        return k_buf[:end], v_buf[:end]

    def advance(self, n: int) -> None:
        """Called once per forward step, after all layers stored their ``n`` new positions."""
        self.offset += n


class LayerKVCache:
    """One layer's view of a ``KVCache``: what ``ParallelAttention`` uses."""

    def __init__(self, cache: KVCache, layer_number: int):
        self.cache = cache
        self.layer_number = layer_number

    @property
    def offset(self) -> int:
        return self.cache.offset

    @property
    def max_length(self) -> int:
        return self.cache.max_length

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.store(self.layer_number, k, v)
