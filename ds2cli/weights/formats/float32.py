"""float32: a weight kept as Hugging Face's float values widened to float32 (`Dense`), multiplied
by BLAS in one call on BLAS's own threads."""

from __future__ import annotations

import numpy as np

# Below this many tokens OpenBLAS runs the weight-major product W @ x.T faster than x @ W.T
# (docs/performance.md, "Why the constants are what they are"); from a few hundred tokens on the
# two are level, and x @ W.T returns a contiguous (T, out).
WEIGHT_MAJOR_TOKENS = 128


class Dense:
    """A float32 weight (..., out, in)."""

    name = "f32"

    def __init__(self, w: np.ndarray):
        self.w = w

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def __getitem__(self, e) -> "Dense":
        return Dense(self.w[e])

    def __len__(self) -> int:
        return len(self.w)

    def product(self, x: np.ndarray) -> None:
        return None                  # never cut: one BLAS call, on BLAS's own threads

    def matmul(self, x: np.ndarray) -> np.ndarray:
        if len(x) == 1:
            return (self.w @ x[0])[None]                                    # (1, out)
        if len(x) < WEIGHT_MAJOR_TOKENS:
            return (self.w @ x.T).T                                         # (T, out)
        return x @ self.w.T                                                 # (T, out)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self.w[ids]                                                  # (T, in)

    def dequantize(self) -> np.ndarray:
        return np.asarray(self.w, np.float32)


def as_weight(w) -> Dense:
    """Wrap a float array; leave a weight object (Dense or a low-bit format) as it is."""
    return Dense(w) if isinstance(w, np.ndarray) else w
