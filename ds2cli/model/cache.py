"""The preallocated two-slot latent cache: what MLA keeps per token instead of per-head K and V."""

from __future__ import annotations

import numpy as np

from ds2cli.errors import ContextFullError, Ds2Error


def common_prefix(a, b) -> int:
    """How many leading token ids a and b share: what a cache holding a's latents can keep for b
    (vectorised: the server's pool compares a prompt with hundreds of entries)."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    same = a[:n] == b[:n]                                                 # (n,)
    return n if same.all() else int(np.argmin(same))


class LatentCache:
    """Per layer, slot 0 is the kv_a_layernorm'd latent and slot 1 the RoPE'd single-head k_pe.

    latent: (L, capacity, C)  C = kv_lora_rank
    k_pe:   (L, capacity, R)  R = qk_rope_head_dim
    Both are allocated once; `length` counts the positions already written. Model.forward
    writes new positions at [length, length+T) layer by layer and only then advances `length`,
    so an error mid-forward leaves the cached prefix as it was.
    """

    def __init__(self, num_layers: int, capacity: int, kv_lora_rank: int, qk_rope_head_dim: int):
        if capacity < 1:
            raise ContextFullError(f"cache capacity must be at least 1 token, got {capacity}")
        self.capacity = capacity
        self.latent = np.zeros((num_layers, capacity, kv_lora_rank), dtype=np.float32)
        self.k_pe = np.zeros((num_layers, capacity, qk_rope_head_dim), dtype=np.float32)
        self.length = 0

    @property
    def bytes_per_token(self) -> int:
        return (self.latent[:, 0].nbytes + self.k_pe[:, 0].nbytes)

    @property
    def nbytes(self) -> int:
        return self.latent.nbytes + self.k_pe.nbytes

    @property
    def free(self) -> int:
        return self.capacity - self.length

    def check_room(self, n_new: int) -> None:
        if n_new > self.free:
            raise ContextFullError(f"context full: {self.length} cached + {n_new} new tokens "
                                   f"exceed the cache capacity of {self.capacity}")

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (the next forward overwrites them)."""
        if not 0 <= length <= self.length:
            raise Ds2Error(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0
