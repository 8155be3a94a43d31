"""q8: qweight int8 (..., out, in), one float32 scale per output row, scales (..., out):
value = q * s[o], q in [-127, 127].

Why one scale a row: a decode step is CPU-bound in NumPy's int8 -> float32 cast (about 0.12 ns a
value on one core from cache, 0.2 from memory), so whatever the scales add to the product shows
in the tok/s. A per-row scale applies to the output, y = s * (q @ x): one plain gemv per row
block and nothing else. Column groups of 32 measured 3.5e-3 mean KL on ds2-tiny against 4.7e-3
per row (fake-quantized, see the README), but cost a batched product and a scaled copy of x per
group of rows: the whole 4-layer V2-Lite slice decoded at 112-141 ms a token against 92-126 ms
per row (float32: 83-109 ms), min-median of 10 rounds in one process.
"""

from __future__ import annotations

import numpy as np

from ds2cli.model.linear import scratch
from ds2cli.weights.formats.base import QuantMatrix, register, row_block


@register
class Q8(QuantMatrix):
    name, bits = "q8", 8
    qweight_dtype = np.dtype(np.int8)
    scale_dtype = np.dtype(np.float32)
    output_scales = True

    @classmethod
    def spec(cls) -> dict:
        return {"bits": 8, "qweight": "int8", "symmetric": True, "scales": "float32", "scale_group": "row"}

    @classmethod
    def quantize(cls, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = np.abs(w).max(axis=1) / np.float32(127)
        s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
        return np.clip(np.rint(w / s[:, None]), -127, 127).astype(np.int8), s

    @classmethod
    def scale_rows(cls, w: np.ndarray, scales: np.ndarray, r0: int) -> None:
        w *= scales[r0:r0 + len(w), None]

    def scale_gathered(self, w: np.ndarray, ids: np.ndarray) -> None:
        w *= self.scales[ids][:, None]

    def output_rows(self, y: np.ndarray, a: int, b: int) -> None:
        """The per-row scales, applied to the output columns a..b (bf16: none)."""
        y[:, a:b] *= self.scales[a:b]

    # Two threads that both call NumPy often pass the GIL back and forth, and each hand-over waits
    # for a wake-up; so the kernels make few, long calls: a block is one cast and one gemv a token.

    def span_gemv(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """y[:, a:b] = s * (q @ x[t]) for each token t: a block is cast once, then one gemv a
        token while it is in cache."""
        inp = self.shape[1]
        block = row_block(inp, self.ROW_ALIGN, self.l2_block_bytes)
        with scratch(block * inp) as buf:
            for r0 in range(a, b, block):
                r1 = min(b, r0 + block)
                w = buf[:(r1 - r0) * inp].reshape(r1 - r0, inp)
                self.unpack(self.qweight[r0:r1], w)                         # int8 or bf16 -> float32
                for t in range(len(x)):
                    np.dot(w, x[t], out=y[t, r0:r1])
        self.output_rows(y, a, b)

    def span_gemm(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """y[:, a:b] = s * (x @ q.T): one cast and one GEMM (block, in) x (in, k) a row block."""
        inp = self.shape[1]
        block = row_block(inp, self.ROW_ALIGN, self.l2_block_bytes)
        with scratch(block * inp) as buf, scratch(block * len(x), "gemm out") as tmp:
            for r0 in range(a, b, block):
                r1 = min(b, r0 + block)
                w = buf[:(r1 - r0) * inp].reshape(r1 - r0, inp)
                self.unpack(self.qweight[r0:r1], w)                         # int8 or bf16 -> float32
                yt = tmp[:(r1 - r0) * len(x)].reshape(r1 - r0, len(x))
                np.matmul(w, x.T, out=yt)                                   # (block, k)
                y[:, r0:r1] = yt.T
        self.output_rows(y, a, b)

    def unpack_chunk(self, qweight: np.ndarray, out: np.ndarray) -> np.ndarray:
        """A prefill chunk's values as float32: int8 in one cast."""
        return self.unpack(qweight, out)

    def span_many(self, xt: np.ndarray, yt: np.ndarray, a: int, b: int) -> None:
        """Rows a..b of yt = W @ xt for many tokens: each chunk cast once and multiplied; the
        per-row scales go on the output rows, not on every weight."""
        inp = self.shape[1]
        chunk = row_block(inp, self.ROW_ALIGN, self.prefill_chunk_bytes)
        with scratch(min(b - a, chunk) * inp, slot="chunk") as buf:
            for c0 in range(a, b, chunk):
                c1 = min(b, c0 + chunk)
                w = buf[:(c1 - c0) * inp].reshape(c1 - c0, inp)
                np.matmul(self.unpack_chunk(self.qweight[c0:c1], w), xt, out=yt[c0:c1])
                if self.output_scales:
                    yt[c0:c1] *= self.scales[c0:c1, None]                   # (chunk, T), rows contiguous
