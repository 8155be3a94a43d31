"""ds2's low-bit weight formats and their NumPy kernels.

Four formats; the integer ones symmetric (integers times a scale; how each scale is chosen, from
a float weight, is scales.py's):

  q8: qweight int8 (..., out, in), one float32 scale per output row, scales (..., out):
      value = q * s[o], q in [-127, 127].
  q8b: one float32 scale per block of 32 *inputs of one row*, value = q * s[o, i // 32]: GGUF's
      Q8_0 blocks, held exactly (a Q8_0 file's integers and scales come back bit for bit), how a
      Q8_0 GGUF loads. Stored in panels of R output rows, each transposed: qweight int8
      (..., out/R, in, R), scales (..., out/R, in/32, R), R chosen by panel_width. Why
      transposed: a block's scale varies along a row, so a row-major kernel must scale
      every widened weight (a pass NumPy makes 32 values at a time: half q8's decode speed);
      in a panel, block j of the inputs is a (32, R) slab whose product with the token's 32
      inputs gives every row's partial sum over that block at once (BLAS on rows of R), and
      the scales then weigh in/32 partial sums instead of every weight.
  bf16: qweight bfloat16 (..., out, in), scales (..., out) all 1: q8's code path with a 16-bit
      value that NumPy widens faster than int8 (0.11 vs 0.14 ns a value from cache), lossless
      for a bfloat16 source; the roles of `--bits 8` whose error counts most (qcheckpoint.py).
  q4: qweight uint8 (..., out, in/2), one bfloat16 scale per group of 32 *output rows of one
      input column* (W[32j:32j+32, i]), scales (..., ceil(out/32), in): value = (q - 8) * s,
      q in [0, 15]. Byte k of a row holds column k in its low nibble and column k + in/2 in its
      high nibble, so unpacking a block is two contiguous half-width slabs. The last group of
      rows may be partial.

Why these scales. A decode step is CPU-bound in NumPy's int8 -> float32 cast (about 0.12 ns a
value on one core from cache, 0.2 from memory; float32 weights stream at about 0.15 ns a value
on two cores), so whatever the scales add to the product shows in the tok/s:
  - q8's per-row scale applies to the output, y = s * (q @ x): one plain gemv per row block and
    nothing else. Column groups of 32 measured 3.5e-3 mean KL on ds2-tiny against 4.7e-3 per row
    (fake-quantized, see the README), but cost a batched product and a scaled copy of x per
    group of rows: the whole 4-layer V2-Lite slice decoded at 112-141 ms a token against
    92-126 ms per row (float32: 83-109 ms), min-median of 10 rounds in one process.
  - q4 needs small groups (ds2-tiny's KL: 0.122 with 32 rows, 0.150 with 64, 0.181 with 128), and
    a group of rows of one column puts its scale on the activation side,
        y[o] = sum_i (q[o, i] - 8) * s[o // 32, i] * x[i] = q[o] . xs[o // 32] - 8 * sum(xs[o // 32])
    with xs = s * x (G, in): the raw nibbles multiply the scaled activation, and the offset is
    one number per group, subtracted from the output, never from each weight.
q4 scales are bfloat16 rather than float16 because NumPy (through ml_dtypes) widens bfloat16 to
float32 several times faster than float16, and a decode step widens every q4 scale it uses. The
round-to-nearest scale is rounded *up* to bfloat16, so the largest value of a group never leaves
the integer range (the step grows by at most 0.8%); a searched scale is rounded to the nearest
bfloat16 and kept only where it then measures better (scales.search_q4), clipping included.

Kernels: a matrix-vector product (decode) widens row blocks that fit in L2 into a reused float32
buffer and multiplies each by the activation with BLAS; its rows are split across the cores, in
a decode step between this process and helper processes forked at load (parallel/processes.py), otherwise
between threads (cores.py), since NumPy releases the GIL in casts and in BLAS. A product
with many tokens (prefill) dequantizes each weight once, in chunks, and runs the usual GEMM.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from ds2cli.parallel import processes as helpers
from ds2cli.parallel.cores import FEW_TOKENS, Rows, split_rows, workers
from ds2cli.errors import Ds2Error
from ds2cli.model.linear import float32

BF16 = np.dtype(ml_dtypes.bfloat16)

Q4_GROUP = 32                 # q4: output rows per scale
Q8_BLOCK = 32                 # q8b: inputs of a row per scale (GGUF's Q8_0 block)
Q8B_PANELS = (512, 256, 128, 64, 32, 16, 8, 4, 2, 1)  # q8b: output rows a panel (BLAS multiplies
                              # a (32, R) slab by a token at 6.5 G values/s for R = 64, 8 for 128,
                              # 9.7 from 256), the widest dividing out that leaves panels enough
                              # to split evenly (panel_width); below 8 only test models' odd shapes
ROW_ALIGN = 8                 # q8 row blocks and spans start at multiples of this (q4: its group)
L2_BLOCK_BYTES = 1 << 20      # a decode row block's float32 buffer: fits one core's L2
Q8B_BLOCK_BYTES = 2 << 20     # q8b's: larger than q8's, fewer calls (from L3); decode of the
                              # 4-layer slice against 8-bit, median of 6 rounds: 0.89x with 1 MB,
                              # 0.90x with 2, 0.77x with 4 (two processes share the L3)
Q8B_PARTIAL_SUMS = 1 << 18    # q8b weighs this many partial sums at once (1 MB)
PREFILL_CHUNK_BYTES = 16 << 20  # prefill dequantizes at most this much float32 at once, a core
DEQUANTIZE_BLOCK_BYTES = 4 << 20  # ... and scales it in blocks of this much
SMALL_MATRIX = 1 << 18        # below this many values a matrix is dequantized whole, on one
                              # thread: splitting it would cost more in overhead than it saves
NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
# Up to this many tokens a widened row block meets each token in its own gemv; from more, in one
# GEMM. OpenBLAS's sgemm of a 128x2048 block by N = 2..8 columns takes a fixed ~85 us on this
# 2-core EPYC (Haswell kernels), where one gemv from L2 takes ~21 us and the int8 cast ~41 us:
# k gemvs win up to k = 4, the GEMM from 5 (16 columns: 170 us, against 340 for 16 gemvs).
GEMV_TOKENS = 4
GEMM_MIN_TOKENS = 8           # and 5-7 tokens are multiplied as 8 (measured: 5 took 2.9 matvecs, 8 took 2.3)


class QuantError(Ds2Error):
    """A low-bit format, bits or group size ds2 does not know, or tensors that disagree with it."""


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    bits: int                     # 8, 4, or 16 (bfloat16 values, not integers)
    group_size: int | None        # q4: output rows per scale of one column
    block: int | None = None      # q8b: inputs per scale along a row; neither: one scale per row

    def qweight_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, out, inp = shape
        if self.block is not None:
            r = panel_width(out, inp)
            return (*lead, out // r, inp, r)
        return (*lead, out, inp // self.per_element)

    def weight_shape(self, qweight_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The (..., out, in) weight a qweight of this shape holds (qweight_shape's inverse)."""
        if self.block is not None:
            *lead, panels, inp, r = qweight_shape
            return (*lead, panels * r, inp)
        *lead, out, stored = qweight_shape
        return (*lead, out, stored * self.per_element)

    def scales_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, out, inp = shape
        if self.block is not None:
            r = panel_width(out, inp)
            return (*lead, out // r, inp // self.block, r)
        if self.group_size is None:
            return (*lead, out)
        return (*lead, -(-out // self.group_size), inp)

    @property
    def qweight_dtype(self) -> np.dtype:
        return np.dtype({8: np.int8, 4: np.uint8, 16: BF16}[self.bits])

    @property
    def per_element(self) -> int:
        """Weights a stored qweight element holds (a q4 byte holds two)."""
        return 2 if self.bits == 4 else 1

    @property
    def output_scales(self) -> bool:
        """q8's one scale a row, which the kernels apply to the output rows rather than to every
        weight (q8b's and q4's scales vary along a row; bf16's are 1)."""
        return self.bits == 8 and self.block is None

    @property
    def scale_dtype(self) -> np.dtype:
        return np.dtype(np.float32) if self.group_size is None else BF16

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes a (..., out, in) weight takes in this format: integers plus scales."""
        q, s = self.qweight_shape(shape), self.scales_shape(shape)
        return int(np.prod(q)) * self.qweight_dtype.itemsize + int(np.prod(s)) * self.scale_dtype.itemsize

    @property
    def row_align(self) -> int:
        """Row blocks and the spans given to the cores start at multiples of this: a q4 block
        holds whole groups, so each group meets one scaled activation."""
        return self.group_size or ROW_ALIGN

    def supports(self, shape: tuple[int, ...]) -> bool:
        if self.block is not None:
            return shape[-1] % self.block == 0
        return self.bits != 4 or shape[-1] % 2 == 0

    def spec(self) -> dict:
        """The format as config.json's quantization_config describes it."""
        d = {"bits": self.bits, "qweight": str(self.qweight_dtype), "symmetric": True}
        if self.bits == 16:
            d.update(scales="float32", scale_group="row", scale_value=1)
        elif self.block is not None:
            d.update(scales="float32", scale_group="block", block_size=self.block,
                     layout=f"panels of R output rows, transposed: qweight (out/R, in, R), scales "
                            f"(out/R, in/{self.block}, R), R dividing out, one of {list(Q8B_PANELS)}")
        elif self.group_size is None:
            d.update(scales="float32", scale_group="row")
        else:
            d.update(scales="bfloat16", scale_group="column", group_size=self.group_size,
                     offset=8, packing="low nibble: column k, high nibble: column k + in/2")
        return d


FORMATS = {"q8": Format("q8", 8, None), "q4": Format("q4", 4, Q4_GROUP),
           "q8b": Format("q8b", 8, None, Q8_BLOCK), "bf16": Format("bf16", 16, None)}


def panel_width(out: int, inp: int) -> int:
    """q8b's rows a panel for a matrix (out, in): the widest whose panels split over two cores
    within 5% (16 or more, an even count or 20 or more), else the narrowest: V2-Lite's lm_head
    gets 512 (200 panels), an expert's gate_up 128 (22; 256 would leave 11), kv_a_proj 32. A
    matrix small enough to run on one thread (SMALL_MATRIX) is not split: the widest."""
    fits = [r for r in Q8B_PANELS if out % r == 0]
    if out * inp <= SMALL_MATRIX:
        return fits[0]
    even = [r for r in fits if out // r >= 16 and (out // r % 2 == 0 or out // r >= 20)]
    return even[0] if even else fits[-1]


def to_panels(q: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-major q8b (q (out, in), s (out, in/32)) -> its panels (qweight_shape, scales_shape)."""
    out, inp = q.shape
    r = panel_width(out, inp)
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


def dequantize(qweight: np.ndarray, scales: np.ndarray, f: Format, out: np.ndarray | None = None) -> np.ndarray:
    """(qweight, scales) -> float32 (..., rows, in), written into `out` when given. For q4 the
    rows must start where a group starts, `scales` holding those groups."""
    if f.block is not None:
        return dequantize_panels(qweight, scales, out)
    if qweight.ndim > 2:
        if out is None:
            out = np.empty((*qweight.shape[:-1], qweight.shape[-1] * f.per_element), np.float32)
        for e in np.ndindex(qweight.shape[:-2]):
            dequantize(qweight[e], scales[e], f, out[e])
        return out
    rows = qweight.shape[0]
    inp = qweight.shape[1] * f.per_element
    w = np.empty((rows, inp), np.float32) if out is None else out
    # block by block, so the scaling pass finds each block still in cache; blocks of a few MB,
    # not L2's one, because two cores dequantizing at once pass the GIL at every call and fewer,
    # longer calls win (q4 prefill of 512 tokens on the 4-layer slice: 147-161 vs 128-143 tok/s)
    block = row_block(inp, f, DEQUANTIZE_BLOCK_BYTES)
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        dequantize_block(qweight[r0:r1], scales, r0, f, w[r0:r1])
    return w


def dequantize_block(qweight: np.ndarray, scales: np.ndarray, r0: int, f: Format, out: np.ndarray) -> None:
    """Rows r0 .. r0 + len(qweight) of a matrix whose scales are `scales`, into out."""
    dequantize_scale(unpack(qweight, f, out), scales, r0, f)


def dequantize_scale(w: np.ndarray, scales: np.ndarray, r0: int, f: Format) -> None:
    """Scale the signed integers w (rows r0 .. r0 + len(w), as float32) in place."""
    rows = w.shape[0]
    if f.bits == 16:
        return                                                              # its scales are 1
    if f.group_size is None:
        w *= scales[r0:r0 + rows, None]
        return
    g = f.group_size
    s = float32(scales[r0 // g:-(-(r0 + rows) // g)])                         # (G, in)
    full = rows // g * g
    grouped = w[:full].reshape(full // g, g, w.shape[1])                    # (G, g, in), a view
    grouped *= s[:full // g, None, :]
    if full < rows:
        w[full:] *= s[full // g]


def row_block(inp: int, f: Format, nbytes: int | None = None) -> int:
    """Rows of a block of about nbytes of float32 (default: a decode block, L2-sized)."""
    align = f.row_align
    return max(align, (nbytes or L2_BLOCK_BYTES) // (4 * inp) // align * align)


def unpack(qweight: np.ndarray, f: Format, out: np.ndarray | None = None) -> np.ndarray:
    """The stored values as float32 (..., rows, in), unscaled: q for q8, q - 8 for q4, the
    bfloat16 values widened for bf16 (q8b's panels have their own kernels: dequantize_panels)."""
    *lead, rows, stored = qweight.shape
    inp = stored * f.per_element
    if out is None:
        out = np.empty((*lead, rows, inp), np.float32)
    if f.bits == 16 and out.flags.c_contiguous:
        # two integer passes widen 1.4x faster than ml_dtypes' cast (2.7 against 1.9 G values/s,
        # a decode block on one core), and bf16 products are a third of an 8-bit decode step
        return float32(qweight.view(BF16), out)
    if f.bits != 4:
        np.copyto(out, qweight, casting="unsafe")
        return out
    with workers().buffer(-(-qweight.size // 2), slot="nibbles") as scratch:
        lo, hi = split_nibbles(qweight, scratch, signed=True)
        np.copyto(out[..., :stored], lo, casting="unsafe")
        np.copyto(out[..., stored:], hi, casting="unsafe")
    return out


def split_nibbles(qweight: np.ndarray, scratch: np.ndarray, signed: bool) -> np.ndarray:
    """q4 bytes (..., rows, in/2) -> (2, ..., rows, in/2) bytes in `scratch` (float32, at least
    qweight.size / 2 values): the low nibbles (columns :in/2) then the high ones (in/2:), as
    uint8 0..15, or as int8 q - 8 when signed."""
    nibbles = scratch.view(np.uint8)[:2 * qweight.size].reshape(2, *qweight.shape)
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


class QuantMatrix:
    """A low-bit weight (..., out, in): qweight and scales as stored (memory-mapped or in RAM)."""

    def __init__(self, qweight: np.ndarray, scales: np.ndarray, f: Format, key: tuple[int, int] | None = None):
        self.qweight, self.scales, self.f = qweight, scales, f
        self.shape = f.weight_shape(qweight.shape)
        # how a helper process finds this matrix: (its number, expert or -1)
        self.key = (helpers.register(self), -1) if key is None else key
        self.experts: dict[int, QuantMatrix] = {}   # a stack's expert views, made once each

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e) -> "QuantMatrix":
        if len(self.shape) < 3 or not isinstance(e, (int, np.integer)):
            raise TypeError("a QuantMatrix is indexed by expert only")
        view = self.experts.get(e)
        if view is None:     # (a decode step takes 12 experts a layer: made anew, 2-5 us each)
            e = int(e)
            if not -len(self) <= e < len(self):
                raise IndexError(f"expert {e} of {len(self)}")
            view = self.experts[e] = QuantMatrix(self.qweight[e], self.scales[e], self.f, key=(self.key[0], e % len(self)))
        return view

    def dequantize(self) -> np.ndarray:
        return dequantize(self.qweight, self.scales, self.f)

    @property
    def row_align(self) -> int:
        """Spans given to the cores start at multiples of this: a q8b panel, a q4 group."""
        return self.qweight.shape[-1] if self.f.block is not None else self.f.row_align

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        if self.f.block is not None:                 # row o is column o % R of panel o // R
            panel, column = np.divmod(ids, self.qweight.shape[-1])
            q, s = self.qweight[panel, :, column], self.scales[panel, :, column]    # (T, in), (T, nb)
            return (q.reshape(len(ids), -1, self.f.block) * s[..., None]).reshape(q.shape)
        w = unpack(self.qweight[ids], self.f)                               # (T, in)
        if self.f.bits == 16:
            return w
        if self.f.group_size is None:
            return w * self.scales[ids][:, None]
        return w * float32(self.scales[ids // self.f.group_size])

    def matmul(self, x: np.ndarray) -> np.ndarray:
        if len(x) == 1:
            return self.matvec(x[0])[None]                                  # (1, out)
        if len(x) <= FEW_TOKENS:
            return self.matmul_few(x)
        return self.matmul_many(x)

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """W @ x for x (in,) -> (out,), never materializing W."""
        out, inp = self.shape
        if out * inp <= SMALL_MATRIX and self.f.block is not None:
            return self._small_q8b(x[None])[0]
        if out * inp <= SMALL_MATRIX:
            with workers().buffer(out * inp) as buf:
                return dequantize(self.qweight, self.scales, self.f, buf.reshape(out, inp)) @ x
        y = np.empty(out, np.float32)
        self.spread(x, y)
        return y

    def matmul_few(self, x: np.ndarray) -> np.ndarray:
        """x (k, in) @ W.T for a few tokens (2 <= k <= FEW_TOKENS): decode's kernel for k rows.
        Row blocks that fit in L2 are widened into a reused buffer, as for one token, and each
        block meets all k rows while it is in cache, so a weight is widened once for the k
        tokens; the rows are split across the cores (the helper processes included)."""
        out, inp = self.shape
        if out * inp <= SMALL_MATRIX and self.f.block is not None:
            return self._small_q8b(x)
        if out * inp <= SMALL_MATRIX:
            with workers().buffer(out * inp, slot="chunk") as buf:
                return x @ dequantize(self.qweight, self.scales, self.f, buf.reshape(out, inp)).T
        k = len(x)
        if GEMV_TOKENS < k < GEMM_MIN_TOKENS and self.f.block is None:   # OpenBLAS multiplies 5-7 columns slower than 8
            x = np.concatenate([x, np.zeros((GEMM_MIN_TOKENS - k, inp), np.float32)])
        x = np.ascontiguousarray(x)
        y = np.empty((len(x), out), np.float32)                             # (k, out)
        self.spread(x, y)
        return y[:k]

    def spread(self, x: np.ndarray, y: np.ndarray) -> None:
        """y = x @ W.T (x (in,) or (k, in)) in row spans over the cores: with the helper
        processes in a few-token pass (they run the other spans), else with threads."""
        workers().split(Rows(self, x, y, self.row_align))

    def span(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """Columns a..b of y = x @ W.T on this thread (rows a..b of W): x (in,) and y (out,) for
        one token, x (k, in) and y (k, out) for k."""
        x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])       # (k, in), (k, out)
        if self.f.block is not None:
            self._span_q8b(x, y, a, b)
        elif self.f.group_size is None:
            (self._span_q8 if len(x) <= GEMV_TOKENS else self._span_q8_gemm)(x, y, a, b)
        else:
            (self._span_q4 if len(x) <= GEMV_TOKENS else self._span_q4_gemm)(x, y, a, b)

    # Two threads that both call NumPy often pass the GIL back and forth, and each hand-over waits
    # for a wake-up; so the kernels make few, long calls: a q8 block is one cast and one gemv a token.

    def _span_q8(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """y[:, a:b] = s * (q @ x[t]) for each token t: a block is cast once, then one gemv a
        token while it is in cache (bf16: its values need no scale)."""
        inp = self.shape[1]
        block = row_block(inp, self.f)
        with workers().buffer(block * inp) as buf:
            for r0 in range(a, b, block):
                r1 = min(b, r0 + block)
                w = buf[:(r1 - r0) * inp].reshape(r1 - r0, inp)
                unpack(self.qweight[r0:r1], self.f, w)                      # int8 or bf16 -> float32
                for t in range(len(x)):
                    np.dot(w, x[t], out=y[t, r0:r1])
        self._row_scales(y, a, b)

    def _row_scales(self, y: np.ndarray, a: int, b: int) -> None:
        """q8's per-row scales, applied to the output columns a..b (other formats: none left)."""
        if self.f.output_scales:
            y[:, a:b] *= self.scales[a:b]

    def _span_q8_gemm(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """y[:, a:b] = s * (x @ q.T): one cast and one GEMM (block, in) x (in, k) a row block."""
        inp = self.shape[1]
        block = row_block(inp, self.f)
        pool = workers()
        with pool.buffer(block * inp) as buf, pool.buffer(block * len(x), "gemm out") as tmp:
            for r0 in range(a, b, block):
                r1 = min(b, r0 + block)
                w = buf[:(r1 - r0) * inp].reshape(r1 - r0, inp)
                unpack(self.qweight[r0:r1], self.f, w)                      # int8 or bf16 -> float32
                yt = tmp[:(r1 - r0) * len(x)].reshape(r1 - r0, len(x))
                np.matmul(w, x.T, out=yt)                                   # (block, k)
                y[:, r0:r1] = yt.T
        self._row_scales(y, a, b)

    def _span_q8b(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """y[:, a:b] for q8b rows a..b (whole panels), any number of tokens k: a few panels at a
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
        pool = workers()
        with pool.buffer(per * blocks * Q8_BLOCK * r) as buf, \
                pool.buffer(group * nb * k * r, "partial sums") as zbuf:
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

    def _small_q8b(self, x: np.ndarray) -> np.ndarray:
        """_span_q8b's math for a small matrix on this thread, in five NumPy calls: a test
        model's or a small projection's product costs its calls more than its values."""
        (out, inp), r = self.shape, self.qweight.shape[-1]
        k = len(x)
        xb = x.reshape(k, -1, Q8_BLOCK).transpose(1, 0, 2)                               # (nb, k, 32)
        z = np.matmul(xb, self.qweight.reshape(out // r, -1, Q8_BLOCK, r).astype(np.float32))   # (P, nb, k, R)
        z *= self.scales[:, :, None, :]
        return z.sum(axis=1).transpose(1, 0, 2).reshape(k, out)

    def _span_q4(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """y[:, a:b] for q4 rows a..b (a multiple of the group): each group of g rows multiplies
        its raw nibbles (0..15) by each token's scaled activation xs = s * x, less 8 * sum(xs)
        for the offset. The nibbles of four blocks are split at once; a block is widened in one
        cast and multiplied in one batched product a token."""
        inp = self.shape[1]
        half, g = inp // 2, self.f.group_size
        s = self.scales[a // g:-(-b // g)]
        xs = float32(s, np.empty(s.shape, np.float32))                                # (G, in), scaled in place below
        if len(x) == 1:
            xs *= x[0]
            xs = xs[None]                                                             # (1, G, in)
        else:
            xs = xs[None] * x[:, None, :]                                             # (k, G, in)
        offset = np.repeat(np.float32(8) * xs.sum(axis=2), g, axis=1)[:, :b - a]     # (k, b - a)
        block = row_block(inp, self.f)
        chunk = 4 * block
        pool = workers()
        with pool.buffer(block * inp) as buf, pool.buffer(chunk * inp // 4 + 1, "nibbles") as scratch:
            for c0 in range(a, b, chunk):
                c1 = min(b, c0 + chunk)
                nibbles = split_nibbles(self.qweight[c0:c1], scratch, signed=False)  # (2, rows, in/2)
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

    def _span_q4_gemm(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """y[:, a:b] for q4 rows a..b and many tokens: a block is widened to q - 8 and scaled in
        place (one multiply a weight, cheaper than scaling k activations per group once k is
        large), then multiplied by all k rows in one GEMM."""
        inp = self.shape[1]
        half = inp // 2
        block = row_block(inp, self.f)
        chunk = 4 * block
        pool = workers()
        with (pool.buffer(block * inp) as buf, pool.buffer(chunk * inp // 4 + 1, "nibbles") as scratch,
              pool.buffer(block * len(x), "gemm out") as tmp):
            for c0 in range(a, b, chunk):
                c1 = min(b, c0 + chunk)
                nibbles = split_nibbles(self.qweight[c0:c1], scratch, signed=True)  # (2, rows, in/2)
                for r0 in range(c0, c1, block):
                    r1 = min(c1, r0 + block)
                    w = buf[:(r1 - r0) * inp].reshape(r1 - r0, inp)
                    np.copyto(w.reshape(r1 - r0, 2, half), nibbles[:, r0 - c0:r1 - c0].transpose(1, 0, 2),
                              casting="unsafe")
                    dequantize_scale(w, self.scales, r0, self.f)
                    yt = tmp[:(r1 - r0) * len(x)].reshape(r1 - r0, len(x))
                    np.matmul(w, x.T, out=yt)                               # (block, k)
                    y[:, r0:r1] = yt.T

    def matmul_many(self, x: np.ndarray) -> np.ndarray:
        """x (T, in) @ W.T for many tokens: dequantize chunks of rows once, then GEMM each,
        the rows split across the cores (BLAS at one thread, see cores.Workers.run)."""
        out, inp = self.shape
        f, g = self.f, self.f.group_size
        if out * inp <= SMALL_MATRIX:
            with workers().buffer(out * inp, slot="chunk") as buf:
                return x @ dequantize(self.qweight, self.scales, f, buf.reshape(out, inp)).T
        if f.block is not None:
            return self._many_q8b(x)
        chunk = row_block(inp, f, PREFILL_CHUNK_BYTES)
        yt = np.empty((out, len(x)), np.float32)                            # (out, T)
        pool = workers()
        xt = np.ascontiguousarray(x.T)                                      # (in, T)

        def span(a: int, b: int) -> None:
            # each core dequantizes its rows chunk by chunk and multiplies them itself; q8's
            # per-row scales go on the output rows, not on every weight
            with pool.buffer(min(b - a, chunk) * inp, slot="chunk") as buf:
                for c0 in range(a, b, chunk):
                    c1 = min(b, c0 + chunk)
                    w = buf[:(c1 - c0) * inp].reshape(c1 - c0, inp)
                    if f.output_scales:
                        np.matmul(unpack(self.qweight[c0:c1], f, w), xt, out=yt[c0:c1])
                        yt[c0:c1] *= self.scales[c0:c1, None]
                    elif g is None:      # q8b, bf16: scales (if any) on the weights, rows c0..c1
                        np.matmul(dequantize(self.qweight[c0:c1], self.scales[c0:c1], f, w), xt, out=yt[c0:c1])
                    else:
                        np.matmul(dequantize(self.qweight[c0:c1], self.scales[c0 // g:-(-c1 // g)], f, w),
                                  xt, out=yt[c0:c1])                        # (chunk, T)

        pool.run(span, split_rows(out, pool.parts, f.row_align))
        return yt.T                                                         # (T, out)

    def _many_q8b(self, x: np.ndarray) -> np.ndarray:
        """matmul_many for q8b: a chunk of panels is dequantized side by side into W.T's columns
        (in, n R), scales broadcast along each slab's 32 rows, then one GEMM x @ W.T a chunk."""
        (out, inp), r, T = self.shape, self.qweight.shape[-1], len(x)
        per = max(1, PREFILL_CHUNK_BYTES // (4 * inp * r))                        # panels a chunk
        y = np.empty((T, out), np.float32)
        pool = workers()

        def span(a: int, b: int) -> None:
            with pool.buffer(min(per, (b - a) // r) * inp * r, slot="chunk") as buf, \
                    pool.buffer(T * min(per, (b - a) // r) * r, slot="gemm out") as tmp:
                for p0 in range(a // r, b // r, per):
                    n = min(b // r, p0 + per) - p0
                    wt = buf[:inp * n * r].reshape(inp, n, r)                     # W.T, by panel
                    for i in range(n):
                        np.multiply(self.qweight[p0 + i].reshape(-1, Q8_BLOCK, r), self.scales[p0 + i, :, None, :],
                                    out=wt[:, i].reshape(-1, Q8_BLOCK, r))
                    yt = tmp[:T * n * r].reshape(T, n * r)
                    np.matmul(x, wt.reshape(inp, n * r), out=yt)
                    y[:, p0 * r:(p0 + n) * r] = yt

        pool.run(span, split_rows(out, pool.parts, r))
        return y
