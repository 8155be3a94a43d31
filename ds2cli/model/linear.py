"""A weight you can multiply by: the interface every weight format meets, and attention's stacks
of per-head matrices.

A projection holds W (out, in) as Hugging Face stores it (`y = x @ W.T`) in some format: float32,
bfloat16, q8, q8b, q4 (weights/formats/, one class each) or one of your own. Every format offers

  w.shape         (..., out, in)
  w.nbytes        bytes held (what one full pass over the weight reads)
  w.matmul(x)     x (T, in) -> (T, out): the whole product, on this thread
  w.rows(ids)     ids (T,) -> (T, in) float32 rows (the token embedding)
  w[e]            a stacked (E, out, in) weight -> expert e's (out, in) weight
  w.dequantize()  the float32 (..., out, in)
  w.product(x)    the product as `Rows`, for an executor to cut into row spans that any core
                  may compute (`w.span(x, y, a, b)`), or None where it is not to be cut (a
                  float32 weight: one BLAS call on BLAS's own threads; a small matrix)

so attention.py and moe.py never look at how a weight is stored, and never at who multiplies:
they ask the executor they are handed (executor.py), which calls these.

Attention's absorbed weights are a stack of per-head matrices (`Heads`), where each head's
inputs meet only that head's matrix: `w.heads(x)`, x (T, H, n_in) -> (T, H, n_out).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable

import numpy as np

# A pass of at most this many tokens is a few-token pass (a decode step, a draft's verification):
# low-bit kernels widen a row block once for all its tokens (weights/formats), and executors cut
# each product's rows across the cores; a longer pass dequantizes in large chunks and runs GEMMs.
FEW_TOKENS = 64


@dataclasses.dataclass(eq=False)
class Rows:
    """One product y = x @ W.T to be computed in row spans: `kernel(x, y, a, b)` (the weight's
    `span` unless it says otherwise) fills rows a..b of W's output, spans starting at multiples
    of `align`. The executor that runs it sets `spans`; `result()` is the product once every
    span has run."""
    m: Any                          # the weight (its `key`, if an executor gave it one, names it
                                    # to a helper process)
    x: np.ndarray                   # (k, in), or (in, T) when transposed
    y: np.ndarray                   # (k, out), or (out, T) when transposed
    align: int
    depth: int = 0                  # weights a row of W multiplies (0: all of x's last axis; a
                                    # stack of per-head matrices: one head's inputs)
    kernel: Callable | None = None
    k: int | None = None            # the tokens asked for (x may be padded)
    transposed: bool = False        # a many-token product writes W's rows as y's rows (out, T)
    shape: tuple | None = None      # the result's shape, if not y's
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.y.shape[0] if self.transposed else self.y.shape[-1]

    @property
    def row_values(self) -> int:
        """Weights x tokens one row of the product takes: what a share of its rows costs."""
        inp = self.x.shape[0] if self.transposed else self.x.shape[-1]
        return (self.depth or inp) * (self.x.size // inp)

    def span(self, a: int, b: int) -> None:
        (self.kernel or self.m.span)(self.x, self.y, a, b)

    def whole(self) -> None:
        """Every row in one span, on this thread (a product too small to be worth sharing)."""
        self.spans = [(0, self.rows)]
        self.span(0, self.rows)

    def result(self) -> np.ndarray:
        y = self.y.T if self.transposed else self.y
        y = y if self.k is None else y[:self.k]
        return y if self.shape is None else y.reshape(self.shape)


class Scratch:
    """Float32 scratch buffers the kernels borrow, kept for the next caller: a fresh 64 MB array
    costs 16k page faults each time it is first written. Lent, not tied to threads, so a
    server's many request threads share the few that the kernels use at once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.free: dict[str, list[np.ndarray]] = {}

    @contextlib.contextmanager
    def __call__(self, n: int, slot: str = "block"):
        with self.lock:
            spare = self.free.setdefault(slot, [])
            k = next((k for k, b in enumerate(spare) if b.size >= n), None)
            buf = spare.pop(k) if k is not None else None
        if buf is None:
            buf = np.empty(n, np.float32)
        try:
            yield buf[:n]
        finally:
            with self.lock:
                self.free[slot].append(buf)


scratch = Scratch()     # `with scratch(n, slot) as buf`: a float32 buffer of n values


def float32(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """An array as float32 (into `out` when given): a bfloat16 array widened by moving its bits
    up 16 places, since bfloat16 is a float32's top half, bit for bit (two integer passes widen
    2.5x faster than ml_dtypes' cast: 0.5 against 1.3 ms for a V2-Lite layer's w_uk and w_uv);
    any other dtype cast, float32 returned as it is."""
    if a.dtype.name == "bfloat16":
        return widen_bfloat16(a.view(np.uint16), out)
    if out is None:
        return np.asarray(a, np.float32)
    np.copyto(out, a, casting="unsafe")
    return out


def widen_bfloat16(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 values held as their uint16 bits -> float32 (into `out` when given): no bfloat16
    dtype needed, so a checkpoint's BF16 tensors are read without importing ml_dtypes."""
    out = np.empty(bits.shape, np.float32) if out is None else out
    wide = out.view(np.uint32)
    np.copyto(wide, bits)
    wide <<= 16
    return out


def bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> the uint16 bits of the nearest bfloat16, ties to even as ml_dtypes rounds
    (finite values), with no bfloat16 dtype."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)


class Heads:
    """A stack of per-head matrices W (H, n_in, n_out), float32 or bfloat16, multiplied head by
    head: y[t, h] = x[t, h] @ W[h]. MLA's W_UK (H, d, C) folds each head's query into the latent
    and W_UV (H, C, v) unfolds its context: the absorbed attention of a decode step multiplies by
    every head of both, about a fifth of V2-Lite's attention weights.

    As a product it is one (H*n_out, n_in) matrix whose output rows run head by head (`shape`,
    what the accounting counts), computed in spans of whole heads (`span`): an executor shares
    it as it shares any other product, each core widening only its own heads' bfloat16 values."""

    def __init__(self, w: np.ndarray):
        self.w = w                                                          # (H, n_in, n_out)
        H, n_in, n_out = w.shape
        self.shape = (H * n_out, n_in)

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def product(self, x: np.ndarray) -> Rows:
        """x (T, H, n_in) -> Rows of y (T, H*n_out), spans of whole heads; result (T, H, n_out)."""
        T, H, n_in = x.shape
        n_out = self.w.shape[2]
        y = np.empty((T, H * n_out), np.float32)
        return Rows(self, np.ascontiguousarray(x, np.float32).reshape(T, H * n_in), y, align=n_out,
                    depth=n_in, shape=(T, H, n_out))

    def heads(self, x: np.ndarray) -> np.ndarray:
        """x (T, H, n_in) -> y (T, H, n_out), y[t, h] = x[t, h] @ W[h], on this thread (a float32
        stack: one batched product, BLAS on its own threads)."""
        p = self.product(x)
        p.span(0, p.rows)
        return p.result()

    def span(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """Heads a/n_out .. b/n_out of y (k, H*n_out), or a (k, H, n_out) view, from x (k, H*n_in),
        on this thread: the heads' matrices widened at once (a few MB) and multiplied by their
        rows of x."""
        H, n_in, n_out = self.w.shape
        h0, h1 = a // n_out, b // n_out
        x, y = x.reshape(-1, H, n_in), y.reshape(-1, H, n_out)              # (k, H, n_in), (k, H, n_out)
        with scratch((h1 - h0) * n_in * n_out, slot="heads") as buf:
            w = self.w[h0:h1] if self.w.dtype == np.float32 else \
                float32(self.w[h0:h1], buf.reshape(h1 - h0, n_in, n_out))  # (h, n_in, n_out)
            y[:, h0:h1] = np.matmul(x[:, h0:h1].transpose(1, 0, 2), w).transpose(1, 0, 2)

    def widened(self) -> np.ndarray:
        """The whole stack as float32 (H, n_in, n_out): for the expanded form's big products."""
        return float32(self.w)


def as_heads(w) -> Heads:
    """Wrap a per-head array (H, n_in, n_out); leave a Heads as it is."""
    return w if isinstance(w, Heads) else Heads(w)
