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

    def __init__(self, num_layers: int, capacity: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 layers: range | None = None):
        if capacity < 1:
            raise ContextFullError(f"cache capacity must be at least 1 token, got {capacity}")
        # `layers`: the decoder layers this cache holds (a node of a cluster holds its range's)
        self.layers = range(num_layers) if layers is None else layers
        self.capacity = capacity
        self.latent = np.zeros((len(self.layers), capacity, kv_lora_rank), dtype=np.float32)
        self.k_pe = np.zeros((len(self.layers), capacity, qk_rope_head_dim), dtype=np.float32)
        self.length = 0

    def layer(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Decoder layer i's slots: latent (capacity, C) and k_pe (capacity, R)."""
        j = i - self.layers.start
        return self.latent[j], self.k_pe[j]

    def prefix(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """A copy of the first n positions of every layer: latent (L, n, C), k_pe (L, n, R)."""
        return np.array(self.latent[:, :n]), np.array(self.k_pe[:, :n])

    def set_prefix(self, latent: np.ndarray, k_pe: np.ndarray) -> None:
        """Hold latent (L, n, C) and k_pe (L, n, R) as the first n positions, and nothing after."""
        n = latent.shape[1]
        if n > self.capacity:
            raise ContextFullError(f"{n} positions do not fit a cache of {self.capacity}")
        self.latent[:, :n], self.k_pe[:, :n] = latent, k_pe
        self.length = n

    def copy_prefix(self, src: "LatentCache", n: int) -> None:
        """Hold src's first n positions (and nothing after)."""
        self.latent[:, :n], self.k_pe[:, :n] = src.latent[:, :n], src.k_pe[:, :n]
        self.length = n

    def repeat(self, n: int, at: int) -> None:
        """Positions [at, at+n) become copies of [0, n) (bench fills a long context so)."""
        self.latent[:, at:at + n], self.k_pe[:, at:at + n] = self.latent[:, :n], self.k_pe[:, :n]

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
