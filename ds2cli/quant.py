"""ds2's low-bit weight formats and their NumPy kernels.

Two formats, both symmetric round-to-nearest:

  q8: qweight int8 (..., out, in), one float32 scale per output row, scales (..., out):
      value = q * s[o], q in [-127, 127].
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
float32 several times faster than float16, and a decode step widens every q4 scale it uses. A
scale is rounded *up* to bfloat16, never to nearest, so the largest value of a group never leaves
the integer range; the step grows by at most 0.8%.

Kernels: a matrix-vector product (decode) widens row blocks that fit in L2 into a reused float32
buffer and multiplies each by the activation with BLAS; its rows are split across the cores, in
a decode step between this process and helper processes forked at load (see "Helper processes"
below), otherwise between threads, since NumPy releases the GIL in casts and in BLAS. A product
with many tokens (prefill) dequantizes each weight once, in chunks, and runs the usual GEMM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import select
import signal
import struct
import sys
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from ds2cli.errors import Ds2Error

BF16 = np.dtype(ml_dtypes.bfloat16)

Q4_GROUP = 32                 # q4: output rows per scale
ROW_ALIGN = 8                 # q8 row blocks and spans start at multiples of this (q4: its group)
L2_BLOCK_BYTES = 1 << 20      # a decode row block's float32 buffer: fits one core's L2
PREFILL_CHUNK_BYTES = 16 << 20  # prefill dequantizes at most this much float32 at once, a core
DEQUANTIZE_BLOCK_BYTES = 4 << 20  # ... and scales it in blocks of this much
SMALL_MATRIX = 1 << 18        # below this many values a matrix is dequantized whole, on one
                              # thread: splitting it would cost more in overhead than it saves
NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)


class QuantError(Ds2Error):
    """A low-bit format, bits or group size ds2 does not know, or tensors that disagree with it."""


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    bits: int
    group_size: int | None        # output rows per scale of one column; None: one scale per row

    def qweight_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, out, inp = shape
        return (*lead, out, inp // 2 if self.bits == 4 else inp)

    def scales_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, out, inp = shape
        if self.group_size is None:
            return (*lead, out)
        return (*lead, -(-out // self.group_size), inp)

    @property
    def qweight_dtype(self) -> np.dtype:
        return np.dtype(np.int8 if self.bits == 8 else np.uint8)

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
        return self.bits == 8 or shape[-1] % 2 == 0

    def spec(self) -> dict:
        """The format as config.json's quantization_config describes it."""
        d = {"bits": self.bits, "qweight": str(self.qweight_dtype), "symmetric": True}
        if self.group_size is None:
            d.update(scales="float32", scale_group="row")
        else:
            d.update(scales="bfloat16", scale_group="column", group_size=self.group_size,
                     offset=8, packing="low nibble: column k, high nibble: column k + in/2")
        return d


FORMATS = {"q8": Format("q8", 8, None), "q4": Format("q4", 4, Q4_GROUP)}


# ---------------------------------------------------------------------------------------------
# Quantization (round to nearest)


def quantize(w: np.ndarray, f: Format) -> tuple[np.ndarray, np.ndarray]:
    """w (..., out, in) float -> (qweight, scales) in format f. A stack of matrices (experts) is
    quantized one matrix at a time, so the float32 temporaries stay one matrix large."""
    if w.ndim > 2:
        qweight = np.empty(f.qweight_shape(w.shape), f.qweight_dtype)
        scales = np.empty(f.scales_shape(w.shape), f.scale_dtype)
        for e in np.ndindex(w.shape[:-2]):
            qweight[e], scales[e] = quantize(w[e], f)
        return qweight, scales
    w = np.asarray(w, dtype=np.float32)
    if f.group_size is None:
        scale = np.abs(w).max(axis=-1) / np.float32(127)                    # (out,)
        inv = np.divide(1, scale, out=np.zeros_like(scale), where=scale != 0)
        q = np.clip(np.rint(w * inv[:, None]), -127, 127).astype(np.int8)
        return q, scale.astype(np.float32)
    out, inp = w.shape
    g = f.group_size
    pad = -out % g
    if pad:  # zero rows never change a group's maximum; they are dropped again below
        w = np.concatenate([w, np.zeros((pad, inp), np.float32)], axis=-2)
    groups = w.reshape(-1, g, inp)                                          # (G, g, in)
    # As llama.cpp's Q4_0: the value of largest magnitude maps to -8 exactly, so the full
    # range [-8, 7] is used whichever sign the extreme has.
    extreme = np.take_along_axis(groups, np.abs(groups).argmax(axis=-2)[..., None, :], axis=-2)
    scales = bf16_up(extreme[..., 0, :] / np.float32(-8))                   # (G, in)
    s = scales.astype(np.float32)
    inv = np.divide(1, s, out=np.zeros_like(s), where=s != 0)[..., None, :]  # (G, 1, in)
    q = np.clip(np.rint(groups * inv) + 8, 0, 15).astype(np.uint8)
    q = q.reshape(out + pad, inp)[:out]
    half = inp // 2
    return np.ascontiguousarray(q[:, :half] | (q[:, half:] << 4)), np.ascontiguousarray(scales)


def bf16_up(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16, rounding the magnitude up (a bfloat16 is a float32's top 16 bits)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    up = (bits.astype(np.uint64) + 0xFFFF).clip(max=0xFFFFFFFF).astype(np.uint32)
    # a finite value never rounds past the largest bfloat16 into inf/nan
    up = np.where((up & 0x7F800000) == 0x7F800000, bits, up)
    return (up >> 16).astype(np.uint16).view(BF16)


def dequantize(qweight: np.ndarray, scales: np.ndarray, f: Format, out: np.ndarray | None = None) -> np.ndarray:
    """(qweight, scales) -> float32 (..., rows, in), written into `out` when given. For q4 the
    rows must start where a group starts, `scales` holding those groups."""
    if qweight.ndim > 2:
        if out is None:
            out = np.empty((*qweight.shape[:-1], qweight.shape[-1] * (2 if f.bits == 4 else 1)), np.float32)
        for e in np.ndindex(qweight.shape[:-2]):
            dequantize(qweight[e], scales[e], f, out[e])
        return out
    rows = qweight.shape[0]
    inp = qweight.shape[1] * (2 if f.bits == 4 else 1)
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
    rows = qweight.shape[0]
    w = unpack(qweight, f, out)                                             # (rows, in)
    if f.group_size is None:
        w *= scales[r0:r0 + rows, None]
        return
    g = f.group_size
    s = scales[r0 // g:-(-(r0 + rows) // g)].astype(np.float32)             # (G, in)
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
    """The signed integers as float32 (..., rows, in): q for q8, q - 8 for q4."""
    *lead, rows, stored = qweight.shape
    inp = stored * 2 if f.bits == 4 else stored
    if out is None:
        out = np.empty((*lead, rows, inp), np.float32)
    if f.bits == 8:
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


# ---------------------------------------------------------------------------------------------
# Kernels


class Workers:
    """The cores a kernel splits its row blocks over: the calling thread plus a small pool."""

    def __init__(self, n: int | None = None):
        self.n = n or max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                 else (os.cpu_count() or 1), 8))
        self.pool = ThreadPoolExecutor(self.n - 1, thread_name_prefix="ds2-kernel") if self.n > 1 else None
        self.lock = threading.Lock()
        self.free: dict[str, list[np.ndarray]] = {}
        self.local = threading.local()   # .inside: this thread already runs one of several parts
        self.held = 0                    # > 0 while a low-bit forward pass holds BLAS (hold_blas)
        self.decoding = 0                # > 0 while that pass is a one-token step

    @contextlib.contextmanager
    def buffer(self, n: int, slot: str = "block"):
        """A float32 scratch of n values, lent for the `with` block and kept for the next caller.
        Reuse matters: a fresh 64 MB array costs 16k page faults each time it is first written.
        Buffers are lent, not tied to threads, so a server's many request threads share the few
        that the kernels use at once."""
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

    @property
    def inside(self) -> bool:
        """This thread already runs one of several parts (see part)."""
        return getattr(self.local, "inside", False)

    @property
    def parts(self) -> int:
        """How many parts to split work into here: one inside a part (which runs on its core
        alone, so more parts would only add calls), else one a core."""
        return 1 if self.inside else self.n

    def run(self, fn, spans: list[tuple[int, int]]) -> None:
        """fn(start, stop) over each span, the first on this thread, the rest on the pool.

        While the spans run, BLAS is held to one thread: each span already has a core, and
        OpenBLAS's own threads would fight over the same cores (measured: two concurrent
        2-thread gemv calls run no faster than one after the other; the q8 decode kernel took
        1.5 ms a 2816x2048 matrix with BLAS at one thread against 2.3 ms at two)."""
        if self.pool is None or len(spans) < 2 or self.inside:
            for span in spans:
                fn(*span)
            return
        with contextlib.nullcontext() if self.held else blas_threads(1):   # held: already one
            futures = [self.pool.submit(self.part, fn, *span) for span in spans[1:]]
            self.part(fn, *spans[0])
            for future in futures:
                future.result()

    def part(self, fn, *args):
        """Run one of several parts: a kernel called inside it runs on this thread alone."""
        self.local.inside = True
        try:
            return fn(*args)
        finally:
            self.local.inside = False

    @property
    def lanes(self) -> int:
        """How many items `map` runs at once here: one a core in a low-bit forward pass, else 1
        (in a decode step with helper processes, each matvec is split across them instead)."""
        if self.pool is None or not self.held or self.inside or (self.decoding and helpers_running()):
            return 1
        return self.n

    def map(self, fn, items) -> list:
        """[fn(item) for item in items], the items shared across the cores while a low-bit
        forward pass holds BLAS at one thread: each core takes the next item when it is free
        and runs it with kernels on that core alone (a decode step's six experts are too small
        to split each one well). In order, on this thread, otherwise, and in a decode step that
        has helper processes, whose matvecs are each split across the processes instead."""
        items = list(items)
        if self.lanes < 2 or len(items) < 2:
            return [fn(item) for item in items]
        out = [None] * len(items)
        turns = iter(range(len(items)))     # next() on a range iterator is atomic under the GIL

        def lane() -> None:
            try:
                for k in turns:
                    out[k] = fn(items[k])
            except BaseException:
                for _ in turns:     # the other cores stop after their current item (Ctrl-C)
                    pass
                raise

        futures = [self.pool.submit(self.part, lane) for _ in range(min(self.lanes, len(items)) - 1)]
        self.part(lane)
        for future in futures:
            future.result()
        return out


_workers: Workers | None = None
_blas = None


@contextlib.contextmanager
def hold_blas(low_bit: bool, decoding: bool = False):
    """What a forward pass over a model with low-bit weights runs in: BLAS held at one thread
    throughout. OpenBLAS's idle threads keep spinning for a while after each call, and a
    spinning BLAS thread takes a core from the low-bit kernels' own threads: holding BLAS at one
    thread for the whole decode step measured 6.5 tok/s against 3.9 on the 4-layer V2-Lite
    slice at 8 bits (2 cores)."""
    pool = workers()
    if not low_bit or pool.n < 2:
        yield
        return
    with blas_threads(1):
        pool.held += 1
        pool.decoding += decoding
        try:
            yield
        finally:
            pool.held -= 1
            pool.decoding -= decoding


@contextlib.contextmanager
def kernel_threads(n: int):
    """Use at most n cores in the low-bit kernels for the block (the CLI's --threads)."""
    pool = workers()
    before = pool.n
    pool.n = max(1, min(n, before))
    try:
        yield
    finally:
        pool.n = before


@contextlib.contextmanager
def blas_threads(n: int):
    """Set the BLAS library's thread count for the block, and restore it after."""
    controllers = blas_controllers()
    before = [c.num_threads for c in controllers]
    for c in controllers:
        c.set_num_threads(n)
    try:
        yield
    finally:
        for c, k in zip(controllers, before):
            c.set_num_threads(k)


def blas_controllers() -> list:
    global _blas
    if _blas is None:
        from threadpoolctl import ThreadpoolController
        _blas = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
    return _blas


def workers() -> Workers:
    global _workers
    if _workers is None:
        _workers = Workers()
    return _workers


def split_rows(rows: int, parts: int, g: int) -> list[tuple[int, int]]:
    """`parts` spans of whole groups covering [0, rows)."""
    groups = -(-rows // g)
    bounds = [min(rows, g * (groups * k // parts)) for k in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


# ---------------------------------------------------------------------------------------------
# Helper processes: the other cores of a decode step
#
# Two threads that both call NumPy in short calls spend much of their time handing the GIL to
# each other (measured: the q8 decode kernel run on two cores scaled 1.3-1.6x as two threads and
# 1.9x as two processes). So a one-token step hands the other cores' rows of each matvec to
# helper processes instead. A helper is forked from this process once the weights exist, so it
# sees every weight at the same address: memory-mapped files and copy-on-write pages are shared
# with it, never copied. For each matvec this process writes x into the helper's shared memory,
# sends it one small message through a pipe (which matrix, which rows), runs its own rows, and
# reads the helper's rows back from the shared memory.

_matrices: list[weakref.ref] = []    # QuantMatrix.key -> the matrix, in this and every helper
_helpers: "Helpers | None" = None
_helpers_failed = False               # a helper died or could not start: threads from then on
JOB = struct.Struct("<qqqqqqq")       # seq, key, expert (-1: none), rows a, b, in, out
DONE = struct.Struct("<qq")           # seq, 1 if the rows are in shared memory, 0 if not
HELPER_VALUES = 1 << 20               # float32 values of shared memory a helper: x, then y
HELPER_SPIN = 0.01                    # seconds a process polls for its next message (receive)
HELPER_TIMEOUT = 60.0                 # a helper silent this long on one matvec is taken as stuck


def helpers_wanted() -> bool:
    """Whether decode steps split their matvecs across helper processes: on Linux (macOS's
    system libraries, Accelerate among them, are not safe to use in a forked child, which is why
    Python's multiprocessing no longer forks there), with more than one core; DS2_HELPERS=0
    turns them off, and threads are used instead."""
    return (sys.platform.startswith("linux") and workers().n > 1 and not _helpers_failed
            and os.environ.get("DS2_HELPERS", "1") != "0")


class Helper:
    """One forked helper, from this process's side: its pid, its two pipes and its memory."""

    def __init__(self, pid: int, jobs: int, done: int, shared: mmap.mmap):
        self.pid, self.jobs, self.done, self.shared = pid, jobs, done, shared
        self.values = np.frombuffer(shared, np.float32)                     # x (in,), then y (out,)
        self.closed = False


class Helpers:
    """n helper processes, forked now; they know every matrix whose key is below `horizon`."""

    def __init__(self, n: int):
        self.horizon = len(_matrices)
        self.seq = 0
        self.lock = threading.Lock()
        self.procs: list[Helper] = []
        try:
            for _ in range(n):
                self.procs.append(self.fork())
        except OSError:
            self.stop()
            raise
        weakref.finalize(self, stop_helpers, list(self.procs))

    def fork(self) -> Helper:
        shared = mmap.mmap(-1, 4 * HELPER_VALUES)     # anonymous and shared across the fork
        jobs_r, jobs_w = os.pipe()
        done_r, done_w = os.pipe()
        parent = os.getpid()
        # Linux documents PR_SET_PDEATHSIG as sent when the forking *thread* ends, and only the
        # main thread's end is the process's end
        with_parent = threading.current_thread() is threading.main_thread()
        with warnings.catch_warnings():     # Python 3.12+ warns of forking with threads alive:
            warnings.simplefilter("ignore", DeprecationWarning)   # the child takes no lock of theirs
            pid = os.fork()
        if pid == 0:
            try:
                for fd in (jobs_w, done_r, *(fd for h in self.procs for fd in (h.jobs, h.done))):
                    os.close(fd)
                helper_main(parent, with_parent, jobs_r, done_w, np.frombuffer(shared, np.float32))
            finally:
                os._exit(0)
        os.close(jobs_r)
        os.close(done_w)
        os.set_blocking(done_r, False)
        return Helper(pid, jobs_w, done_r, shared)

    def stop(self) -> None:
        stop_helpers(self.procs)
        self.procs = []

    def matvec(self, m: "QuantMatrix", x: np.ndarray, y: np.ndarray, spans: list[tuple[int, int]], span) -> bool:
        """Rows spans[0] here, spans[1:] on the helpers; False (nothing done) if they are busy
        with another thread's step or cannot take the matrix."""
        global _helpers_failed
        key, expert = m.key
        inp, out = len(x), len(y)
        if key >= self.horizon or inp + out > HELPER_VALUES or not self.lock.acquire(blocking=False):
            return False
        try:
            self.seq += 1
            sent = []
            for h, (a, b) in zip(self.procs, spans[1:]):
                h.values[:inp] = x
                os.write(h.jobs, JOB.pack(self.seq, key, expert, a, b, inp, out))
                sent.append((h, a, b))
            span(x, y, *spans[0])
            for h, a, b in sent:
                if self.wait(h):
                    y[a:b] = h.values[inp + a:inp + b]
                else:
                    span(x, y, a, b)
            for a, b in spans[1 + len(sent):]:
                span(x, y, a, b)
            return True
        except OSError:      # a helper is gone (killed, out of memory) or stuck: carry on without
            _helpers_failed = True                                                # them
            raise HelperGone from None
        finally:
            self.lock.release()
            if _helpers_failed:
                stop_helpers_now()

    def wait(self, h: Helper) -> bool:
        """Read h's replies up to this step's (an interrupted step leaves its reply unread)."""
        while True:
            reply = receive(h.done, DONE.size, HELPER_TIMEOUT)
            if reply is None:
                raise OSError("a helper process exited")
            seq, ok = DONE.unpack(reply)
            if seq == self.seq:
                return bool(ok)


class HelperGone(Exception):
    """Raised inside quant when a helper dies; the matvec is then run here."""


def receive(fd: int, size: int, timeout: float | None = None) -> bytes | None:
    """The next message of `size` bytes from a non-blocking pipe, None once it is closed;
    TimeoutError after `timeout` seconds without one.

    Polls for HELPER_SPIN seconds before sleeping in select: a process that sleeps between a
    step's matvecs is woken up to a millisecond late on this VM (a 2816x2048 q4 matvec split
    over two processes took 2.4 ms, median, against 1.2 ms for either half), and a decode step
    sends the next matvec well within the spin. Messages are shorter than PIPE_BUF, so each is
    written, and read, whole."""
    start = time.perf_counter()
    sleep = None
    while True:
        try:
            return os.read(fd, size) or None
        except BlockingIOError:
            waited = time.perf_counter() - start
            if waited > HELPER_SPIN:
                if sleep is None:
                    sleep = select.poll()
                    sleep.register(fd, select.POLLIN)
                if timeout is not None and waited > timeout:
                    raise TimeoutError(f"no message in {timeout:.0f} s") from None
                sleep.poll(None if timeout is None else 1000 * (timeout - waited) + 1)


def stop_helpers(procs: list[Helper]) -> None:
    """Close the helpers' pipes, end them and reap them. A helper holds nothing to clean up
    (it writes no file), and one that is stuck must not hold this process up: SIGKILL."""
    procs = [h for h in procs if not h.closed]
    for h in procs:
        h.closed = True     # once only: a closed descriptor's number may be reused by then
        for fd in (h.jobs, h.done):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.kill(h.pid, signal.SIGKILL)
    for h in procs:
        with contextlib.suppress(OSError):
            os.waitpid(h.pid, 0)


def helper_main(parent: int, with_parent: bool, jobs: int, done: int, values: np.ndarray) -> None:
    """A helper's life: run the rows it is sent until the job pipe closes (this process's parent
    exited or stopped it). Ctrl-C is the parent's to handle; the helper dies with the parent."""
    global _workers, _helpers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(Exception):   # Linux: be killed with the parent, however it dies
        if not with_parent:
            raise NotImplementedError
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    if os.getppid() != parent:      # it died before that took effect
        return
    devnull = os.open(os.devnull, os.O_RDWR)   # hold no one's terminal or pipe open: a reader
    for fd in (0, 1, 2):                        # of ds2's stdout waits for every writer to close
        os.dup2(devnull, fd)
    _workers, _helpers = Workers(1), None   # one core, no pool, no lock another thread holds
    os.set_blocking(jobs, False)
    for c in blas_controllers():
        c.set_num_threads(1)
    while (job := receive(jobs, JOB.size)) is not None:
        seq, key, expert, a, b, inp, out = JOB.unpack(job)
        ok = 0
        try:
            m = _matrices[key]() if key < len(_matrices) else None
            if m is not None:
                m = m[expert] if expert >= 0 else m
                m.span(values[:inp], values[inp:inp + out], a, b)
                ok = 1
        except Exception:    # noqa: BLE001 - any failure: the parent runs the rows itself
            ok = 0
        os.write(done, DONE.pack(seq, ok))


def helpers_running() -> bool:
    return _helpers is not None and helpers_wanted()


def start_helpers() -> None:
    """Fork the helper processes anew (model.load calls this once a low-bit model is loaded):
    they then know every matrix alive, and the helpers of an earlier model, which would keep
    its memory alive in their copy of this process, are gone. Forking right after the load also
    means the copy holds no scratch buffers or caches of this process yet."""
    global _helpers, _helpers_failed
    stop_helpers_now()
    if helpers_wanted():
        try:
            _helpers = Helpers(workers().n - 1)
        except OSError:
            _helpers_failed = True


def stop_helpers_now() -> None:
    global _helpers
    if _helpers is not None:
        _helpers.stop()
        _helpers = None


def helper_private_bytes() -> int:
    """Resident memory of the helpers that this process does not also map: their scratch, the
    pages of this process's heap they wrote since the fork, and the weight pages only they have
    read (a decode step reads each matrix's rows split between the processes). Added to this
    process's RSS it counts every resident page once. Linux only (0 elsewhere)."""
    total = 0
    for h in _helpers.procs if _helpers is not None else []:
        with contextlib.suppress(OSError), open(f"/proc/{h.pid}/smaps_rollup") as f:
            total += sum(int(line.split()[1]) * 1024 for line in f
                         if line.startswith(("Private_Clean:", "Private_Dirty:")))
    return total


def helpers_for() -> Helpers | None:
    """The helper processes, if this matvec is a decode step's (Helpers.matvec declines a
    matrix they do not know)."""
    pool = workers()
    if _helpers is None or not (pool.held and pool.decoding) or pool.inside or not helpers_wanted():
        return None
    return _helpers


class QuantMatrix:
    """A low-bit weight (..., out, in): qweight and scales as stored (memory-mapped or in RAM)."""

    def __init__(self, qweight: np.ndarray, scales: np.ndarray, f: Format, key: tuple[int, int] | None = None):
        self.qweight, self.scales, self.f = qweight, scales, f
        self.shape = (*qweight.shape[:-1], qweight.shape[-1] * (2 if f.bits == 4 else 1))
        if key is None:      # how a helper process finds this matrix: (its number, expert or -1)
            key = (len(_matrices), -1)
            _matrices.append(weakref.ref(self))
        self.key = key

    @classmethod
    def from_float(cls, w: np.ndarray, f: Format) -> "QuantMatrix":
        return cls(*quantize(w, f), f)

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e) -> "QuantMatrix":
        if len(self.shape) < 3 or not isinstance(e, (int, np.integer)):
            raise TypeError("a QuantMatrix is indexed by expert only")
        return QuantMatrix(self.qweight[e], self.scales[e], self.f, key=(self.key[0], int(e)))

    def dequantize(self) -> np.ndarray:
        return dequantize(self.qweight, self.scales, self.f)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        w = unpack(self.qweight[ids], self.f)                               # (T, in)
        if self.f.group_size is None:
            return w * self.scales[ids][:, None]
        return w * self.scales[ids // self.f.group_size].astype(np.float32)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        if len(x) == 1:
            return self.matvec(x[0])[None]                                  # (1, out)
        return self.matmul_many(x)

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """W @ x for x (in,) -> (out,), never materializing W."""
        out, inp = self.shape
        if out * inp <= SMALL_MATRIX:
            with workers().buffer(out * inp) as buf:
                return dequantize(self.qweight, self.scales, self.f, buf.reshape(out, inp)) @ x
        y = np.empty(out, np.float32)
        pool = workers()
        spans = split_rows(out, pool.parts, self.f.row_align)
        helpers = helpers_for() if len(spans) > 1 else None
        try:
            if helpers is not None and helpers.matvec(self, x, y, spans, self.span):
                return y
        except HelperGone:
            pass
        pool.run(lambda a, b: self.span(x, y, a, b), spans)
        return y

    def span(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """y[a:b] = (W @ x)[a:b], rows a..b of a matvec, on this thread."""
        (self._span_q8 if self.f.group_size is None else self._span_q4)(x, y, a, b)

    # Two threads that both call NumPy often pass the GIL back and forth, and each hand-over waits
    # for a wake-up; so the kernels make few, long calls: a q8 block is one cast and one gemv.

    def _span_q8(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """y[a:b] = s * (q @ x), one gemv a row block."""
        inp = self.shape[1]
        block = row_block(inp, self.f)
        with workers().buffer(block * inp) as buf:
            for r0 in range(a, b, block):
                r1 = min(b, r0 + block)
                w = buf[:(r1 - r0) * inp].reshape(r1 - r0, inp)
                np.copyto(w, self.qweight[r0:r1], casting="unsafe")
                np.dot(w, x, out=y[r0:r1])
        y[a:b] *= self.scales[a:b]

    def _span_q4(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        """y[a:b] for q4 rows a..b (a multiple of the group): each group of g rows multiplies its
        raw nibbles (0..15) by its scaled activation xs = s * x, less 8 * sum(xs) for the offset.
        The nibbles of four blocks are split at once; a block is widened in one cast and
        multiplied in one batched product."""
        inp = self.shape[1]
        half, g = inp // 2, self.f.group_size
        xs = self.scales[a // g:-(-b // g)].astype(np.float32)              # (G, in)
        xs *= x
        offset = np.repeat(np.float32(8) * xs.sum(axis=1), g)[:b - a]       # (b - a,)
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
                    if full:
                        np.matmul(w[:full].reshape(-1, g, inp), xs[g0:g0 + full // g, :, None],
                                  out=y[r0:r0 + full].reshape(-1, g, 1))    # (groups, g, 1)
                    if full < n:      # the matrix's last, partial group
                        y[r0 + full:r1] = w[full:] @ xs[-1]
        y[a:b] -= offset

    def matmul_many(self, x: np.ndarray) -> np.ndarray:
        """x (T, in) @ W.T for many tokens: dequantize chunks of rows once, then GEMM each,
        the rows split across the cores (BLAS at one thread, see Workers.run)."""
        out, inp = self.shape
        f, g = self.f, self.f.group_size
        if out * inp <= SMALL_MATRIX:
            with workers().buffer(out * inp, slot="chunk") as buf:
                return x @ dequantize(self.qweight, self.scales, f, buf.reshape(out, inp)).T
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
                    if g is None:
                        np.matmul(unpack(self.qweight[c0:c1], f, w), xt, out=yt[c0:c1])
                        yt[c0:c1] *= self.scales[c0:c1, None]
                    else:
                        np.matmul(dequantize(self.qweight[c0:c1], self.scales[c0 // g:-(-c1 // g)], f, w),
                                  xt, out=yt[c0:c1])                        # (chunk, T)

        pool.run(span, split_rows(out, pool.parts, f.row_align))
        return yt.T                                                         # (T, out)
