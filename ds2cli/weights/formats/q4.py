"""q4: qweight uint8 (..., out, in/2), one bfloat16 scale per group of 32 *output rows of one
input column* (W[32j:32j+32, i]), scales (..., ceil(out/32), in): value = (q - 8) * s, q in
[0, 15]. Byte k of a row holds column k in its low nibble and column k + in/2 in its high
nibble, so unpacking a block is two contiguous half-width slabs. The last group of rows may be
partial.

Why these scales: q4 needs small groups (ds2-tiny's KL: 0.122 with 32 rows, 0.150 with 64, 0.181
with 128), and a group of rows of one column puts its scale on the activation side,
    y[o] = sum_i (q[o, i] - 8) * s[o // 32, i] * x[i] = q[o] . xs[o // 32] - 8 * sum(xs[o // 32])
with xs = s * x (G, in): the raw nibbles multiply the scaled activation, and the offset is one
number per group, subtracted from the output, never from each weight. The scales are bfloat16
rather than float16 because bfloat16 widens to float32 several times faster, and a decode step
widens every q4 scale it uses. The round-to-nearest scale is rounded *up* to bfloat16, so the
largest value of a group never leaves the integer range (the step grows by at most 0.8%); a
searched scale is rounded to the nearest bfloat16 and kept only where it then measures better
(scales.search_q4), clipping included.
"""

from __future__ import annotations

import numpy as np

from ds2cli.model.linear import float32, scratch
from ds2cli.weights.formats.base import BFloat16Dtype, QuantMatrix, register, row_block

Q4_GROUP = 32                 # output rows per scale
NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)


def split_nibbles(qweight: np.ndarray, scratch_buf: np.ndarray, signed: bool) -> np.ndarray:
    """q4 bytes (..., rows, in/2) -> (2, ..., rows, in/2) bytes in `scratch_buf` (float32, at least
    qweight.size / 2 values): the low nibbles (columns :in/2) then the high ones (in/2:), as
    uint8 0..15, or as int8 q - 8 when signed."""
    nibbles = scratch_buf.view(np.uint8)[:2 * qweight.size].reshape(2, *qweight.shape)
    lo, hi = nibbles
    if qweight.size % 8 == 0 and qweight.flags.c_contiguous:
        # on 64-bit words: NumPy has no 8-bit SIMD shift, and 8 nibbles a word is 8x fewer ops
        q64, lo64, hi64 = (a.reshape(-1).view(np.uint64) for a in (qweight, lo, hi))
        np.bitwise_and(q64, NIBBLES, out=lo64)
        np.right_shift(q64, np.uint64(4), out=hi64)
        np.bitwise_and(hi64, NIBBLES, out=hi64)
    else:
        np.bitwise_and(qweight, np.uint8(15), out=lo)
        np.right_shift(qweight, np.uint8(4), out=hi)
    if not signed:
        return nibbles
    # 0..15 minus 8 wraps in uint8 to exactly q - 8 read as int8
    np.subtract(nibbles, np.uint8(8), out=nibbles)
    return nibbles.view(np.int8)


@register
class Q4(QuantMatrix):
    name, bits, group_size = "q4", 4, Q4_GROUP
    qweight_dtype = np.dtype(np.uint8)
    scale_dtype = BFloat16Dtype()
    per_element = 2
    ROW_ALIGN = Q4_GROUP      # a block holds whole groups, so each group meets one scaled activation

    @classmethod
    def scales_shape(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, out, inp = shape
        return (*lead, -(-out // Q4_GROUP), inp)

    @classmethod
    def spec(cls) -> dict:
        return {"bits": 4, "qweight": "uint8", "symmetric": True, "scales": "bfloat16", "scale_group": "column",
                "group_size": Q4_GROUP, "offset": 8, "packing": "low nibble: column k, high nibble: column k + in/2"}

    @classmethod
    def quantize(cls, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError("q4's scales are chosen by scales.quantize_q4")

    @classmethod
    def unpack(cls, qweight: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """q - 8 as float32 (..., rows, in)."""
        stored = qweight.shape[-1]
        out = np.empty(cls.weight_shape(qweight.shape), np.float32) if out is None else out
        with scratch(-(-qweight.size // 2), slot="nibbles") as buf:
            lo, hi = split_nibbles(qweight, buf, signed=True)
            np.copyto(out[..., :stored], lo, casting="unsafe")
            np.copyto(out[..., stored:], hi, casting="unsafe")
        return out

    @classmethod
    def scale_rows(cls, w: np.ndarray, scales: np.ndarray, r0: int) -> None:
        """Rows r0 .. r0 + len(w) (r0 where a group starts) times their groups' scales."""
        rows, g = w.shape[0], Q4_GROUP
        s = float32(scales[r0 // g:-(-(r0 + rows) // g)])                 # (G, in)
        full = rows // g * g
        grouped = w[:full].reshape(full // g, g, w.shape[1])                # (G, g, in), a view
        grouped *= s[:full // g, None, :]
        if full < rows:
            w[full:] *= s[full // g]

    def scale_gathered(self, w: np.ndarray, ids: np.ndarray) -> None:
        w *= float32(self.scales[ids // Q4_GROUP])

    def span_gemv(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """y[:, a:b] for rows a..b (a multiple of the group): each group of g rows multiplies its
        raw nibbles (0..15) by each token's scaled activation xs = s * x, less 8 * sum(xs) for
        the offset. The nibbles of four blocks are split at once; a block is widened in one cast
        and multiplied in one batched product a token."""
        inp = self.shape[1]
        half, g = inp // 2, Q4_GROUP
        s = self.scales[a // g:-(-b // g)]
        xs = float32(s, np.empty(s.shape, np.float32))                                # (G, in), scaled in place below
        if len(x) == 1:
            xs *= x[0]
            xs = xs[None]                                                             # (1, G, in)
        else:
            xs = xs[None] * x[:, None, :]                                             # (k, G, in)
        offset = np.repeat(np.float32(8) * xs.sum(axis=2), g, axis=1)[:, :b - a]     # (k, b - a)
        block = row_block(inp, self.ROW_ALIGN, self.l2_block_bytes)
        chunk = 4 * block
        with scratch(block * inp) as buf, scratch(chunk * inp // 4 + 1, "nibbles") as nbuf:
            for c0 in range(a, b, chunk):
                c1 = min(b, c0 + chunk)
                nibbles = split_nibbles(self.qweight[c0:c1], nbuf, signed=False)     # (2, rows, in/2)
                for r0 in range(c0, c1, block):
                    r1 = min(c1, r0 + block)
                    n, full = r1 - r0, (r1 - r0) // g * g
                    w = buf[:n * inp].reshape(n, inp)
                    # row r = its low nibbles (columns :in/2) then its high ones (in/2:)
                    np.copyto(w.reshape(n, 2, half), nibbles[:, r0 - c0:r1 - c0].transpose(1, 0, 2),
                              casting="unsafe")
                    g0 = (r0 - a) // g
                    for t in range(len(x)):
                        if full:
                            np.matmul(w[:full].reshape(-1, g, inp), xs[t, g0:g0 + full // g, :, None],
                                      out=y[t, r0:r0 + full].reshape(-1, g, 1))  # (groups, g, 1)
                        if full < n:      # the matrix's last, partial group
                            y[t, r0 + full:r1] = w[full:] @ xs[t, -1]
        y[:, a:b] -= offset

    def span_gemm(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """y[:, a:b] for rows a..b and more tokens: a block is widened to q - 8 and scaled in
        place (one multiply a weight, cheaper than scaling k activations per group once k is
        large), then multiplied by all k rows in one GEMM."""
        inp = self.shape[1]
        half = inp // 2
        block = row_block(inp, self.ROW_ALIGN, self.l2_block_bytes)
        chunk = 4 * block
        with (scratch(block * inp) as buf, scratch(chunk * inp // 4 + 1, "nibbles") as nbuf,
              scratch(block * len(x), "gemm out") as tmp):
            for c0 in range(a, b, chunk):
                c1 = min(b, c0 + chunk)
                nibbles = split_nibbles(self.qweight[c0:c1], nbuf, signed=True)      # (2, rows, in/2)
                for r0 in range(c0, c1, block):
                    r1 = min(c1, r0 + block)
                    w = buf[:(r1 - r0) * inp].reshape(r1 - r0, inp)
                    np.copyto(w.reshape(r1 - r0, 2, half), nibbles[:, r0 - c0:r1 - c0].transpose(1, 0, 2),
                              casting="unsafe")
                    self.scale_rows(w, self.scales, r0)
                    yt = tmp[:(r1 - r0) * len(x)].reshape(r1 - r0, len(x))
                    np.matmul(w, x.T, out=yt)                               # (block, k)
                    y[:, r0:r1] = yt.T
