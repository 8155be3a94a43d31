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

Attention's absorbed weights are a third kind, a stack of per-head matrices (`Heads`), where each
head's inputs meet only that head's matrix: `w.heads(x)`, x (T, H, n_in) -> (T, H, n_out); and
`w_uk.after(q_proj)` (`AbsorbedQuery`) is q's projection with each head's W_UK after it, one
product whose spans of whole heads compute both.
"""

from __future__ import annotations

import numpy as np

from ds2cli.parallel import cores
from ds2cli.parallel import processes as helpers

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


class Heads:
    """A stack of per-head matrices W (H, n_in, n_out), float32 or bfloat16, multiplied head by
    head: y[t, h] = x[t, h] @ W[h]. MLA's W_UK (H, d, C) folds each head's query into the latent
    and W_UV (H, C, v) unfolds its context: the absorbed attention of a decode step multiplies by
    every head of both, about a fifth of V2-Lite's attention weights.

    As a product it is one (H*n_out, n_in) matrix whose output rows run head by head (`shape`,
    what the accounting counts), computed in spans of whole heads (`span`): so the cores and the
    helper processes share it as they share any other product, each widening only its own
    heads' bfloat16 values (a step's widening of w_uk and w_uv alone took 0.4-0.9 ms a layer
    on one core)."""

    def __init__(self, w: np.ndarray):
        self.w = w                                                          # (H, n_in, n_out)
        H, n_in, n_out = w.shape
        self.shape = (H * n_out, n_in)
        self.key = (helpers.register(self), -1)   # how a helper process finds it (processes.py)

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def heads(self, x: np.ndarray) -> np.ndarray:
        """x (T, H, n_in) -> y (T, H, n_out), y[t, h] = x[t, h] @ W[h]."""
        T, H, n_in = x.shape
        n_out = self.w.shape[2]
        y = np.empty((T, H * n_out), np.float32)
        rows = cores.Rows(self, np.ascontiguousarray(x, np.float32).reshape(T, H * n_in), y, align=n_out, depth=n_in)
        if cores.workers().held:
            cores.workers().split(rows)    # a low-bit pass: its heads shared out like any product's rows
        else:
            rows.span(0, rows.rows)        # float32 weights: one batched product, BLAS on its own threads
        return y.reshape(T, H, n_out)

    def span(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """Heads a/n_out .. b/n_out of y (k, H*n_out), or a (k, H, n_out) view, from x (k, H*n_in),
        on this thread: the heads' matrices widened at once (a few MB) and multiplied by their
        rows of x."""
        H, n_in, n_out = self.w.shape
        h0, h1 = a // n_out, b // n_out
        x, y = x.reshape(-1, H, n_in), y.reshape(-1, H, n_out)              # (k, H, n_in), (k, H, n_out)
        with cores.workers().buffer((h1 - h0) * n_in * n_out, slot="heads") as buf:
            w = self.w[h0:h1] if self.w.dtype == np.float32 else \
                float32(self.w[h0:h1], buf.reshape(h1 - h0, n_in, n_out))  # (h, n_in, n_out)
            y[:, h0:h1] = np.matmul(x[:, h0:h1].transpose(1, 0, 2), w).transpose(1, 0, 2)

    def widened(self) -> np.ndarray:
        """The whole stack as float32 (H, n_in, n_out): for the expanded form's big products."""
        return float32(self.w)

    def after(self, q) -> "AbsorbedQuery":
        """q's projection, then this stack (W_UK) over each head's first n_in outputs, as one
        product (a helper process rebuilds it from the two matrices' keys)."""
        return AbsorbedQuery(q, self)


class AbsorbedQuery:
    """MLA's queries and their absorbed form as one product: y[t, h] = [q[t, h] | q_lat[t, h]],
    q = x @ Wq.T (T, H, d+R), q_lat[t, h] = q[t, h, :d] @ W_UK[h] (T, H, C). Each head's rows
    of q feed only that head's W_UK, so a span of whole heads computes both, and a decode step
    sends q and its W_UK to the helper processes as one plan, not two (a message and a wait
    less a layer). Its output rows run head by head, d+R+C a head (`align`)."""

    def __init__(self, q, w_uk: Heads):
        self.q, self.w_uk = q, w_uk
        H, d, C = w_uk.w.shape
        self.width = q.shape[0] // H                                        # d + R
        self.align = self.width + C
        self.shape = (H * self.align, q.shape[1])
        self.key, self.then = getattr(q, "key", None), w_uk.key[0]         # float32 q (Dense): no key
        # weights a row of the product multiplies: a head's q rows and its W_UK, over its rows
        self.depth = -(-(self.width * q.shape[1] + d * C) // self.align)

    @property
    def parts(self) -> tuple:
        return self.q, self.w_uk

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x (T, D) -> y (T, H*(d+R+C)), head by head [q_h | q_lat_h]."""
        T = len(x)
        H, d, C = self.w_uk.w.shape
        y = np.empty((T, self.shape[0]), np.float32)
        if cores.workers().held and self.key is not None and self.width % self.q.row_align == 0:
            # a low-bit pass: the heads shared out like any product's rows
            cores.workers().split(cores.Rows(self, np.ascontiguousarray(x, np.float32), y, align=self.align,
                                             depth=self.depth))
        else:             # float32 weights (BLAS on its own threads) or a q whose rows cannot be cut by head
            q = self.q.matmul(x).reshape(T, H, self.width)                  # (T, H, d+R)
            heads = y.reshape(T, H, self.align)
            heads[..., :self.width] = q
            heads[..., self.width:] = self.w_uk.heads(q[..., :d])
        return y

    def span(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """Heads a/align .. b/align of y (k, H*align) from x (k, D), on this thread: their rows
        of q, then their W_UK."""
        H, d, C = self.w_uk.w.shape
        h0, h1 = a // self.align, b // self.align
        x = x.reshape(-1, x.shape[-1])                                      # (k, D)
        k, w = len(x), self.width
        heads = y.reshape(k, H, self.align)                                 # (k, H, d+R+C)
        with cores.workers().buffer(k * H * w, slot="absorbed q") as buf:
            q = buf.reshape(k, H * w)                                       # (k, H*(d+R)), heads h0..h1 only
            self.q.span(x, q, h0 * w, h1 * w)
            q = q.reshape(k, H, w)
            heads[:, h0:h1, :w] = q[:, h0:h1]
            q_nope = np.ascontiguousarray(q[..., :d]).reshape(k, H * d)     # (k, H*d), heads h0..h1 only
            self.w_uk.span(q_nope, heads[..., w:], h0 * C, h1 * C)          # into y's (k, H, C) columns


def as_heads(w) -> Heads:
    """Wrap a per-head array (H, n_in, n_out); leave a Heads as it is."""
    return w if isinstance(w, Heads) else Heads(w)


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
