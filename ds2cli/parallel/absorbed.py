"""MLA's query and its fold through W_UK as one product: an executor's way of sending two
products the math asks for together (executor.matmul_all's (q_proj, x, w_uk)) to the helper
processes as one plan, a message and a wait less a layer of a decode step."""

from __future__ import annotations

import numpy as np

from ds2cli.model.linear import Heads, scratch


class AbsorbedQuery:
    """y[t, h] = [q[t, h] | q_lat[t, h]], q = x @ Wq.T (T, H, d+R), q_lat[t, h] = q[t, h, :d] @ W_UK[h]
    (T, H, C). Each head's rows of q feed only that head's W_UK, so a span of whole heads computes
    both. Its output rows run head by head, d+R+C a head (`align`). A helper process rebuilds it
    from the two matrices' keys (processes.py: `key`, `then`)."""

    def __init__(self, q, w_uk: Heads):
        self.q, self.w_uk = q, w_uk
        H, d, C = w_uk.w.shape
        self.width = q.shape[0] // H                                        # d + R
        self.align = self.width + C
        self.shape = (H * self.align, q.shape[1])
        self.key, self.then = getattr(q, "key", None), getattr(w_uk, "key", (-1,))[0]
        # weights a row of the product multiplies: a head's q rows and its W_UK, over its rows
        self.depth = -(-(self.width * q.shape[1] + d * C) // self.align)

    @staticmethod
    def fits(q, w_uk: Heads) -> bool:
        """Whether q's rows can be cut at every head (a q4 group larger than d+R cannot), and
        both matrices are known to the helpers."""
        width = q.shape[0] // w_uk.w.shape[0]
        return (getattr(q, "key", None) is not None and getattr(w_uk, "key", None) is not None
                and width % getattr(q, "row_align", width + 1) == 0)

    @property
    def parts(self) -> tuple:
        return self.q, self.w_uk

    def span(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """Heads a/align .. b/align of y (k, H*align) from x (k, D), on this thread: their rows
        of q, then their W_UK."""
        H, d, C = self.w_uk.w.shape
        h0, h1 = a // self.align, b // self.align
        x = x.reshape(-1, x.shape[-1])                                      # (k, D)
        k, w = len(x), self.width
        heads = y.reshape(k, H, self.align)                                 # (k, H, d+R+C)
        with scratch(k * H * w, slot="absorbed q") as buf:
            q = buf.reshape(k, H * w)                                       # (k, H*(d+R)), heads h0..h1 only
            self.q.span(x, q, h0 * w, h1 * w)
            q = q.reshape(k, H, w)
            heads[:, h0:h1, :w] = q[:, h0:h1]
            q_nope = np.ascontiguousarray(q[..., :d]).reshape(k, H * d)     # (k, H*d), heads h0..h1 only
            self.w_uk.span(q_nope, heads[..., w:], h0 * C, h1 * C)          # into y's (k, H, C) columns
