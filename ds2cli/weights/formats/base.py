"""What every low-bit format shares: a weight stored as integers (or narrow floats) and scales,
`qweight` and `scales`, and the interface the model multiplies through (model/linear.py).

A format is a subclass of `QuantMatrix` that says how its values are stored (the class
attributes and `qweight_shape` / `scales_shape`: what a file holds, `spec()`: how config.json
describes it) and how they are multiplied (`span_gemv`, `span_gemm`, `span_many`, `unpack`,
`scale_rows`, `rows`). The kernels all work on row spans on the calling thread; who computes which
rows is the executor's (the product's `Rows`). `register` makes a format known to every file,
recipe and report by its name, one line a format (formats/__init__.py).

Kernels: a matrix-vector product (decode) widens row blocks that fit in L2 into a reused float32
buffer and multiplies each by the activation with BLAS; a product of a few tokens widens each block
once for all of them; a product with many tokens (prefill) dequantizes chunks of rows once and
runs the usual GEMM.
"""

from __future__ import annotations

import functools

import numpy as np

from ds2cli.errors import Ds2Error
from ds2cli.model.linear import FEW_TOKENS, Rows, scratch


@functools.cache
def bfloat16_dtype() -> np.dtype:
    """ml_dtypes' bfloat16 dtype, imported when a format first holds bfloat16 values: ml_dtypes'
    import costs more than the rest of ds2's start, which `ds2 --help`, a tokenizer or a float
    checkpoint (read as uint16 bits, linear.widen_bfloat16) never need."""
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


class BFloat16Dtype:
    """A format's qweight_dtype or scale_dtype that is bfloat16_dtype(), looked up when it is read."""

    def __get__(self, obj, owner=None) -> np.dtype:
        return bfloat16_dtype()


def __getattr__(name: str):
    if name == "BF16":              # the module attribute, as it was before it was looked up late
        return bfloat16_dtype()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

ROW_ALIGN = 8                 # row blocks and spans start at multiples of this (q4: its group)
L2_BLOCK_BYTES = 1 << 20      # a decode row block's float32 buffer: fits one core's L2
PREFILL_CHUNK_BYTES = 16 << 20  # prefill dequantizes at most this much float32 at once, a core
DEQUANTIZE_BLOCK_BYTES = 4 << 20  # ... and scales it in blocks of this much
SMALL_MATRIX = 1 << 18        # below this many values a matrix is dequantized whole, on one
                              # thread: splitting it would cost more in overhead than it saves
# Up to this many tokens a widened row block meets each token in its own gemv; from more, in one
# GEMM: a small sgemm has a fixed cost that a few gemvs from L2 undercut (the crossing measured:
# docs/performance.md, "Why the constants are what they are").
GEMV_TOKENS = 4
GEMM_MIN_TOKENS = 8           # and 5-7 tokens are multiplied as 8: a GEMM of 8 columns costs no more

FORMATS: dict[str, type["QuantMatrix"]] = {}   # every format by name, in the order registered


class QuantError(Ds2Error):
    """A low-bit format, bits or group size ds2 does not know, or tensors that disagree with it."""


def register(cls: type["QuantMatrix"]) -> type["QuantMatrix"]:
    """Make a format known by its name (a class decorator)."""
    FORMATS[cls.name] = cls
    return cls


class KernelSize:
    """A size a weight's kernels read as its attribute (`w.small_matrix`): this module's constant
    of that name, looked up when read, unless the weight was given its own (a test sends one
    small matrix through the cut kernels in small blocks: `m.small_matrix = 0`)."""

    def __init__(self, constant: str):
        self.constant = constant

    def __get__(self, obj, owner=None) -> int:
        return globals()[self.constant]


def row_block(inp: int, align: int, nbytes: int | None = None) -> int:
    """Rows of a block of about nbytes of float32 (default: a decode block, L2-sized)."""
    return max(align, (nbytes or L2_BLOCK_BYTES) // (4 * inp) // align * align)


class QuantMatrix:
    """A low-bit weight (..., out, in): qweight and scales as stored (memory-mapped or in RAM).
    `QuantMatrix(qweight, scales, f)` builds format f's class; a format's own class takes
    (qweight, scales)."""

    name = ""                     # the format's name in files and recipes
    bits = 0                      # 8, 4, or 16 (bfloat16 values, not integers): the recipe's --bits
    group_size: int | None = None  # q4: output rows per scale of one column
    block: int | None = None      # q8b: inputs per scale along a row
    qweight_dtype = np.dtype(np.int8)
    scale_dtype = np.dtype(np.float32)
    per_element = 1               # weights a stored qweight element holds (a q4 byte holds two)
    output_scales = False         # one scale a row, applied to the output rows (q8)
    ROW_ALIGN = ROW_ALIGN
    small_matrix = KernelSize("SMALL_MATRIX")
    l2_block_bytes = KernelSize("L2_BLOCK_BYTES")
    prefill_chunk_bytes = KernelSize("PREFILL_CHUNK_BYTES")
    dequantize_block_bytes = KernelSize("DEQUANTIZE_BLOCK_BYTES")

    def __new__(cls, qweight=None, scales=None, f: type["QuantMatrix"] | None = None, **_):
        return object.__new__(f if cls is QuantMatrix and f is not None else cls)

    def __init__(self, qweight: np.ndarray, scales: np.ndarray, f=None, origin: tuple | None = None):
        if type(self) is QuantMatrix:
            raise QuantError("QuantMatrix needs a format (FORMATS[name])")
        self.qweight, self.scales = qweight, scales
        self.shape = self.weight_shape(qweight.shape)
        self.origin = origin        # (stack, e) for expert e's view of a stack, else None: how a
                                    # helper process that knows the stack finds the view
        self.experts: dict[int, QuantMatrix] = {}   # a stack's expert views, made once each

    # ---- the format as stored ----

    @classmethod
    def qweight_shape(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, out, inp = shape
        return (*lead, out, inp // cls.per_element)

    @classmethod
    def weight_shape(cls, qweight_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The (..., out, in) weight a qweight of this shape holds (qweight_shape's inverse)."""
        *lead, out, stored = qweight_shape
        return (*lead, out, stored * cls.per_element)

    @classmethod
    def scales_shape(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, out, inp = shape
        return (*lead, out)

    @classmethod
    def nbytes_of(cls, shape: tuple[int, ...]) -> int:
        """Bytes a (..., out, in) weight takes in this format: integers plus scales."""
        q, s = cls.qweight_shape(shape), cls.scales_shape(shape)
        return int(np.prod(q)) * cls.qweight_dtype.itemsize + int(np.prod(s)) * cls.scale_dtype.itemsize

    @classmethod
    def supports(cls, shape: tuple[int, ...]) -> bool:
        return shape[-1] % cls.per_element == 0

    @classmethod
    def spec(cls) -> dict:
        """The format as config.json's quantization_config describes it."""
        raise NotImplementedError

    @classmethod
    def quantize(cls, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A float32 matrix (out, in) -> (qweight, scales), rounded to nearest (scales.py searches
        better scales for the formats it knows)."""
        raise NotImplementedError

    # ---- the weight ----

    @property
    def f(self) -> type["QuantMatrix"]:
        return type(self)

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
            view = self.experts[e] = type(self)(self.qweight[e], self.scales[e], origin=(self, e % len(self)))
        return view

    @property
    def row_align(self) -> int:
        """Spans given to the cores start at multiples of this."""
        return self.ROW_ALIGN

    def dequantize(self) -> np.ndarray:
        return self.dequantize_arrays(self.qweight, self.scales)

    @classmethod
    def dequantize_arrays(cls, qweight: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """(qweight, scales) -> float32 (..., rows, in), written into `out` when given, block by
        block, so the scaling pass finds each block still in cache; blocks of a few MB, not L2's
        one, because two cores dequantizing at once pass the GIL at every call and fewer,
        longer calls win (q4 prefill of 512 tokens on the 4-layer slice: 147-161 vs 128-143 tok/s)."""
        if qweight.ndim > 2:
            if out is None:
                out = np.empty(cls.weight_shape(qweight.shape), np.float32)
            for e in np.ndindex(qweight.shape[:-2]):
                cls.dequantize_arrays(qweight[e], scales[e], out[e])
            return out
        return cls.dequantize_into(qweight, scales, 0,
                                   np.empty(cls.weight_shape(qweight.shape), np.float32) if out is None else out)

    @classmethod
    def dequantize_into(cls, qweight: np.ndarray, scales: np.ndarray, r0: int, out: np.ndarray,
                        block_bytes: int | None = None) -> np.ndarray:
        """Rows r0 .. r0 + len(qweight) of a matrix whose scales are `scales` (qweight: those
        rows), as float32 into `out`, `block_bytes` at a time (default: DEQUANTIZE_BLOCK_BYTES, a
        few MB: dequantize_arrays says why)."""
        rows, inp = cls.weight_shape(qweight.shape)
        block = row_block(inp, cls.ROW_ALIGN, block_bytes or DEQUANTIZE_BLOCK_BYTES)
        for b0 in range(0, rows, block):
            b1 = min(rows, b0 + block)
            cls.scale_rows(cls.unpack(qweight[b0:b1], out[b0:b1]), scales, r0 + b0)
        return out

    @classmethod
    def unpack(cls, qweight: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The stored values as float32 (..., rows, in), unscaled."""
        out = np.empty(cls.weight_shape(qweight.shape), np.float32) if out is None else out
        np.copyto(out, qweight, casting="unsafe")
        return out

    @classmethod
    def scale_rows(cls, w: np.ndarray, scales: np.ndarray, r0: int) -> None:
        """Scale unpacked rows r0 .. r0 + len(w) in place (scales: the whole matrix's)."""

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        w = self.unpack(self.qweight[ids])                                  # (T, in)
        self.scale_gathered(w, ids)
        return w

    def scale_gathered(self, w: np.ndarray, ids: np.ndarray) -> None:
        """Scale the unpacked rows `ids` in place."""

    # ---- products ----

    def product(self, x: np.ndarray) -> Rows | None:
        """x (T, in) @ W.T as Rows for the cores (None: a small matrix, done whole by `matmul`).
        A few tokens keep y (k, out) and meet each row block while it is in cache; many tokens
        are computed transposed, W's rows as y's rows (out, T), chunks of rows dequantized once."""
        out, inp = self.shape
        if out * inp <= self.small_matrix:
            return None
        k = len(x)
        if k > FEW_TOKENS:
            return Rows(self, np.ascontiguousarray(x.T), np.empty((out, k), np.float32), self.many_align,
                        kernel=self.span_many, transposed=True)
        if GEMV_TOKENS < k < GEMM_MIN_TOKENS and self.pads:   # OpenBLAS multiplies 5-7 columns slower than 8
            x = np.concatenate([x, np.zeros((GEMM_MIN_TOKENS - k, inp), np.float32)])
        x = np.ascontiguousarray(x, np.float32)
        return Rows(self, x, np.empty((len(x), out), np.float32), self.row_align, k=k)

    pads = True                   # 5-7 tokens padded to 8 (q8b's kernel has no such step)

    @property
    def many_align(self) -> int:
        return self.ROW_ALIGN

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x (T, in) @ W.T on this thread."""
        p = self.product(x)
        if p is None:
            return self.small_matmul(x)
        p.span(0, p.rows)
        return p.result()

    def small_matmul(self, x: np.ndarray) -> np.ndarray:
        out, inp = self.shape
        with scratch(out * inp, slot="chunk") as buf:
            w = self.dequantize_arrays(self.qweight, self.scales, buf.reshape(out, inp))
            return (w @ x[0])[None] if len(x) == 1 else x @ w.T

    def span(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """Columns a..b of y = x @ W.T on this thread (rows a..b of W): x (k, in), y (k, out)."""
        x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])       # (k, in), (k, out)
        (self.span_gemv if len(x) <= GEMV_TOKENS else self.span_gemm)(x, y, a, b)

    def span_gemv(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        raise NotImplementedError

    def span_gemm(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        self.span_gemv(x, y, a, b)

    def span_many(self, xt: np.ndarray, yt: np.ndarray, a: int, b: int) -> None:
        """Rows a..b of yt = W @ xt (xt (in, T), yt (out, T)) for many tokens: each chunk of rows
        dequantized once (scales on the weights), then one GEMM."""
        inp = self.shape[1]
        chunk = row_block(inp, self.ROW_ALIGN, self.prefill_chunk_bytes)
        with scratch(min(b - a, chunk) * inp, slot="chunk") as buf:
            for c0 in range(a, b, chunk):
                c1 = min(b, c0 + chunk)
                w = buf[:(c1 - c0) * inp].reshape(c1 - c0, inp)
                self.dequantize_rows(c0, c1, w)
                np.matmul(w, xt, out=yt[c0:c1])                             # (chunk, T)

    def dequantize_rows(self, r0: int, r1: int, out: np.ndarray) -> np.ndarray:
        """Rows r0..r1 of the weight as float32 into out."""
        return self.dequantize_into(self.qweight[r0:r1], self.scales, r0, out, self.dequantize_block_bytes)


def dequantize(qweight: np.ndarray, scales: np.ndarray, f: type[QuantMatrix], out: np.ndarray | None = None) -> np.ndarray:
    """(qweight, scales) in format f -> float32 (..., rows, in), written into `out` when given."""
    return f.dequantize_arrays(qweight, scales, out)
