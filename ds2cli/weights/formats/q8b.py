"""q8b: one float32 scale per block of 32 *inputs of one row*, value = q * s[o, i // 32]: GGUF's
Q8_0 blocks, held exactly (a Q8_0 file's integers and scales come back bit for bit), how a Q8_0
GGUF loads. Stored in panels of R output rows, each transposed: qweight int8 (..., out/R, in, R),
scales (..., out/R, in/32, R), R chosen by panel_width.

Why transposed: a block's scale varies along a row, so a row-major kernel must scale every
widened weight (a pass NumPy makes 32 values at a time: half q8's decode speed); in a panel,
block j of the inputs is a (32, R) slab whose product with the token's 32 inputs gives every
row's partial sum over that block at once (BLAS on rows of R), and the scales then weigh in/32
partial sums instead of every weight.
"""

from __future__ import annotations

import numpy as np

from ds2cli.model.linear import Rows, scratch
from ds2cli.weights.formats import base
from ds2cli.weights.formats.base import QuantMatrix, register

Q8_BLOCK = 32                 # inputs of a row per scale (GGUF's Q8_0 block)
Q8B_PANELS = (512, 256, 128, 64, 32, 16, 8, 4, 2, 1)  # output rows a panel (BLAS multiplies
                              # a (32, R) slab by a token at 6.5 G values/s for R = 64, 8 for 128,
                              # 9.7 from 256), the widest dividing out that leaves panels enough
                              # to split evenly (panel_width); below 8 only test models' odd shapes
Q8B_BLOCK_BYTES = 2 << 20     # a widened tile: larger than q8's, fewer calls (from L3); decode
                              # of the 4-layer slice against 8-bit, median of 6 rounds: 0.89x
                              # with 1 MB, 0.90x with 2, 0.77x with 4 (two processes share the L3)
Q8B_PARTIAL_SUMS = 1 << 18    # this many partial sums are weighed at once (1 MB)


def panel_width(out: int, inp: int) -> int:
    """Rows a panel for a matrix (out, in): the widest whose panels split over two cores within
    5% (16 or more, an even count or 20 or more), else the narrowest: V2-Lite's lm_head gets 512
    (200 panels), an expert's gate_up 128 (22; 256 would leave 11), kv_a_proj 32. A matrix small
    enough to run on one thread (base.SMALL_MATRIX) is not split: the widest."""
    fits = [r for r in Q8B_PANELS if out % r == 0]
    if out * inp <= base.SMALL_MATRIX:
        return fits[0]
    even = [r for r in fits if out // r >= 16 and (out // r % 2 == 0 or out // r >= 20)]
    return even[0] if even else fits[-1]


def to_panels(q: np.ndarray, s: np.ndarray, r: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Row-major q8b (q (out, in), s (out, in/32)) -> its panels of `r` rows (default:
    panel_width's, the layout of qweight_shape and scales_shape)."""
    out, inp = q.shape
    r = r or panel_width(out, inp)
    return (np.ascontiguousarray(q.reshape(out // r, r, inp).transpose(0, 2, 1)),
            np.ascontiguousarray(s.reshape(out // r, r, -1).transpose(0, 2, 1)))


def dequantize_panels(qweight: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """q8b panels (..., P, in, R) -> the float32 weight (..., P * R, in), row-major."""
    *lead, panels, inp, r = qweight.shape
    slabs = qweight.reshape(*lead, panels, -1, Q8_BLOCK, r) * scales[..., None, :]   # (..., P, nb, 32, R)
    w = np.swapaxes(slabs.reshape(*lead, panels, inp, r), -1, -2).reshape(*lead, panels * r, inp)
    if out is None:
        return w
    out[...] = w
    return out


@register
class Q8b(QuantMatrix):
    name, bits, block = "q8b", 8, Q8_BLOCK
    qweight_dtype = np.dtype(np.int8)
    scale_dtype = np.dtype(np.float32)
    pads = False

    @classmethod
    def qweight_shape(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, out, inp = shape
        r = panel_width(out, inp)
        return (*lead, out // r, inp, r)

    @classmethod
    def weight_shape(cls, qweight_shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, panels, inp, r = qweight_shape
        return (*lead, panels * r, inp)

    @classmethod
    def scales_shape(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, out, inp = shape
        r = panel_width(out, inp)
        return (*lead, out // r, inp // Q8_BLOCK, r)

    @classmethod
    def supports(cls, shape: tuple[int, ...]) -> bool:
        return shape[-1] % Q8_BLOCK == 0

    @classmethod
    def spec(cls) -> dict:
        return {"bits": 8, "qweight": "int8", "symmetric": True, "scales": "float32", "scale_group": "block",
                "block_size": Q8_BLOCK,
                "layout": f"panels of R output rows, transposed: qweight (out/R, in, R), scales "
                          f"(out/R, in/{Q8_BLOCK}, R), R dividing out, one of {list(Q8B_PANELS)}"}

    @classmethod
    def quantize(cls, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        blocks = w.reshape(w.shape[0], -1, Q8_BLOCK)
        s = np.abs(blocks).max(axis=-1) / np.float32(127)
        s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
        q = np.clip(np.rint(blocks / s[..., None]), -127, 127).astype(np.int8).reshape(w.shape)
        return to_panels(q, s)

    @classmethod
    def dequantize_arrays(cls, qweight, scales, out=None) -> np.ndarray:
        return dequantize_panels(qweight, scales, out)

    @property
    def row_align(self) -> int:
        return self.qweight.shape[-1]                                       # a panel

    many_align = row_align

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        panel, column = np.divmod(ids, self.qweight.shape[-1])             # row o: column o % R of panel o // R
        q, s = self.qweight[panel, :, column], self.scales[panel, :, column]    # (T, in), (T, nb)
        return (q.reshape(len(ids), -1, Q8_BLOCK) * s[..., None]).reshape(q.shape)

    def product(self, x: np.ndarray) -> Rows | None:
        p = super().product(x)
        if p is not None and p.transposed:     # many tokens: y (T, out), x (T, in), panels side by side
            p = Rows(self, np.ascontiguousarray(x, np.float32), np.empty((len(x), self.shape[0]), np.float32),
                     self.row_align, kernel=self.span_many)
        return p

    def small_matmul(self, x: np.ndarray) -> np.ndarray:
        """The span's math for a small matrix on this thread, in five NumPy calls: a test
        model's or a small projection's product costs its calls more than its values."""
        out, r = self.shape[0], self.qweight.shape[-1]
        k = len(x)
        xb = x.reshape(k, -1, Q8_BLOCK).transpose(1, 0, 2)                               # (nb, k, 32)
        z = np.matmul(xb, self.qweight.reshape(out // r, -1, Q8_BLOCK, r).astype(np.float32))   # (P, nb, k, R)
        z *= self.scales[:, :, None, :]
        return z.sum(axis=1).transpose(1, 0, 2).reshape(k, out)

    def span_gemv(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """y[:, a:b] for rows a..b (whole panels), any number of tokens k: a few panels at a
        time are widened into a cache-sized buffer; z[j] = x[:, block j] @ slab j (32, R) is every
        row's partial sum over input block j, for all blocks in one batched product; the block
        scales then weigh the partial sums, y = sum_j s[j] * z[j], for many panels at once (the
        partial sums are 1/32 of the weights: two calls a group of panels, not two a block)."""
        inp, r = self.shape[1], self.qweight.shape[-1]
        nb, k = inp // Q8_BLOCK, len(x)
        xb = np.ascontiguousarray(x.reshape(k, nb, Q8_BLOCK).transpose(1, 0, 2))   # (nb, k, 32)
        blocks = max(1, min(nb, Q8B_BLOCK_BYTES // (4 * Q8_BLOCK * r)))          # input blocks a tile
        per = max(1, Q8B_BLOCK_BYTES // (4 * inp * r)) if blocks == nb else 1    # panels a tile
        group = max(1, Q8B_PARTIAL_SUMS // (nb * k * r * per)) * per             # panels a weighing
        with scratch(per * blocks * Q8_BLOCK * r) as buf, scratch(group * nb * k * r, "partial sums") as zbuf:
            for g0 in range(a // r, b // r, group):
                g1 = min(b // r, g0 + group)
                z = zbuf[:(g1 - g0) * nb * k * r].reshape(g1 - g0, nb, k, r)
                for p0 in range(g0, g1, per):
                    p1 = min(g1, p0 + per)
                    for j0 in range(0, nb, blocks):
                        j1 = min(nb, j0 + blocks)
                        w = buf[:(p1 - p0) * (j1 - j0) * Q8_BLOCK * r].reshape(p1 - p0, j1 - j0, Q8_BLOCK, r)
                        np.copyto(w, self.qweight[p0:p1, j0 * Q8_BLOCK:j1 * Q8_BLOCK].reshape(w.shape),
                                  casting="unsafe")
                        np.matmul(xb[j0:j1], w, out=z[p0 - g0:p1 - g0, j0:j1])   # (n, blocks, k, R)
                z *= self.scales[g0:g1, :, None, :]
                y[:, g0 * r:g1 * r] = z.sum(axis=1).transpose(1, 0, 2).reshape(k, -1)

    def span_many(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """Rows a..b of y = x @ W.T (x (T, in), y (T, out)) for many tokens: a chunk of panels is
        dequantized side by side into W.T's columns (in, n R), scales broadcast along each
        slab's 32 rows, then one GEMM x @ W.T a chunk."""
        inp, r, T = self.shape[1], self.qweight.shape[-1], len(x)
        per = max(1, self.prefill_chunk_bytes // (4 * inp * r))                        # panels a chunk
        with scratch(min(per, (b - a) // r) * inp * r, slot="chunk") as buf, \
                scratch(T * min(per, (b - a) // r) * r, slot="gemm out") as tmp:
            for p0 in range(a // r, b // r, per):
                n = min(b // r, p0 + per) - p0
                wt = buf[:inp * n * r].reshape(inp, n, r)                         # W.T, by panel
                for i in range(n):
                    np.multiply(self.qweight[p0 + i].reshape(-1, Q8_BLOCK, r), self.scales[p0 + i, :, None, :],
                                out=wt[:, i].reshape(-1, Q8_BLOCK, r))
                yt = tmp[:T * n * r].reshape(T, n * r)
                np.matmul(x, wt.reshape(inp, n * r), out=yt)
                y[:, p0 * r:(p0 + n) * r] = yt


