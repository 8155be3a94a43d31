"""A weight you can multiply by: every projection of the model goes through one call.

A projection holds W (out, in) as Hugging Face stores it (`y = x @ W.T`), either as a float32
array (`Dense`) or in a low-bit format (`quant.QuantMatrix`). Both offer the same four things,
so attention.py and moe.py never look at how a weight is stored:

  w.matmul(x)   x (T, in) -> (T, out)      the projection of T tokens
  w.rows(ids)   ids (T,)  -> (T, in)       gathered rows, float32 (the token embedding)
  w[e]          a stacked (E, out, in) weight -> expert e's (out, in) weight
  w.nbytes      bytes held (what one full pass over the weight reads)

and independent products are asked for together, `matmul_all([(w1, x1), (w2, x2)])`, so that
the cores can run them as one piece of work (cores.together).
"""

from __future__ import annotations

import numpy as np

from ds2cli.parallel import cores

# Below this many tokens OpenBLAS runs the weight-major product W @ x.T up to 1.7x faster than
# x @ W.T (measured: 16 tokens 101 vs 59 GFLOP/s, 48 tokens 143 vs 110); from a few hundred
# tokens on the two are level, and x @ W.T returns a contiguous (T, out).
WEIGHT_MAJOR_TOKENS = 128


class Dense:
    """A float32 weight (..., out, in)."""

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

    def matmul(self, x: np.ndarray) -> np.ndarray:
        if len(x) == 1:
            return (self.w @ x[0])[None]                                    # (1, out)
        if len(x) < WEIGHT_MAJOR_TOKENS:
            return (self.w @ x.T).T                                         # (T, out)
        return x @ self.w.T                                                 # (T, out)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self.w[ids]                                                  # (T, in)


def float32(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """An array as float32 (into `out` when given): a bfloat16 array widened by moving its bits
    up 16 places, since bfloat16 is a float32's top half, bit for bit (two integer passes widen
    2.5x faster than ml_dtypes' cast: 0.5 against 1.3 ms for a V2-Lite layer's w_uk and w_uv);
    any other dtype cast, float32 returned as it is."""
    if a.dtype.name == "bfloat16":
        out = np.empty(a.shape, np.float32) if out is None else out
        bits = out.view(np.uint32)
        np.copyto(bits, a.view(np.uint16))
        bits <<= 16
        return out
    if out is None:
        return np.asarray(a, np.float32)
    np.copyto(out, a, casting="unsafe")
    return out


def as_weight(w) -> "Dense":
    """Wrap a float array; leave a weight object (Dense or QuantMatrix) as it is."""
    return Dense(w) if isinstance(w, np.ndarray) else w


def matmul_all(pairs) -> list[np.ndarray]:
    """[w.matmul(x) for w, x in pairs], for products that do not depend on each other: the cores
    share them out, and a decode step sends the helper processes one message for all of them."""
    pairs = list(pairs)
    with cores.together():
        ys = cores.map(lambda pair: pair[0].matmul(pair[1]), pairs,
                       cost=[len(x) * w.shape[-1] * w.shape[-2] for w, x in pairs])
    return ys
