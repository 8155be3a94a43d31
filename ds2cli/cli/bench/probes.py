"""What the machine can do, measured: float32 matrix-vector bandwidth (the ceiling for decode,
which reads every active weight once per token) and float32 GEMM throughput (the ceiling for
prefill); and what the machine is (CPUs, numpy, BLAS)."""

from __future__ import annotations

import contextlib
import os
import platform
import time

import numpy as np

from ds2cli.cli import console
from ds2cli.cli.bench.timing import seconds, summary

PROBE_RUNS = 8
POINT_PROBE_RUNS = 4        # the probes again beside each measured point, shorter
MATVEC_N = 8192             # 8192 x 8192 float32 = 256 MB, far past any CPU cache
GEMM_SHAPES = {             # (M, K, N): (M, K) @ (N, K)^T, as the engine multiplies by weights
    "prefill": (512, 2048, 2048),   # 512 prompt tokens through a 2048 x 2048 projection
    "expert": (48, 2048, 2816),     # one routed expert's gate_up: 512 tokens x top-6 / 64 experts
}


def probe_matvec(runs: int) -> dict:
    """GB/s of float32 W @ x with W far larger than the caches: the bandwidth decode can hope for."""
    w = np.full((MATVEC_N, MATVEC_N), 1.0 / MATVEC_N, np.float32)   # written, so every page exists
    x = np.ones(MATVEC_N, np.float32)
    w @ x  # BLAS threads start outside the timing
    return summary([w.nbytes / seconds(lambda: w @ x) / 1e9 for _ in range(runs)])


def probe_gemm(m: int, k: int, n: int, runs: int) -> dict:
    """GFLOP/s of float32 (m, k) @ (n, k)^T."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((n, k), dtype=np.float32)
    a @ b.T
    return summary([2 * m * k * n / seconds(lambda: a @ b.T) / 1e9 for _ in range(runs)])


# The ceiling probe: plain NumPy's rate of widening each storage format to float32 and
# multiplying by one token, over a matrix past the caches, on every core at once: this process
# and cores - 1 forked processes each take their share of the rows (processes, as decode's
# helpers are: threads share the GIL between short calls), capped by what memory can deliver of
# that format (the matvec probe's GB/s over its bytes a value). One core alone is measured too
# ("core"): the cores share memory, caches and, on many machines, a physical core, so n cores are
# not n times one (on the 2-core EPYC VM: q8 1.6-1.9x, bf16 1.2-1.5x, float32 memory-bound).
# That is what a decode step's products could reach in NumPy at best; ds2's kernels do the same
# work plus their own bookkeeping (or, for q4, less), so decode's share of this ceiling is how
# much of NumPy's speed ds2 keeps.
CEILING_VALUES = 64 << 20       # weights in each probe matrix: 64M, past any CPU cache in every format
CEILING_ROW = 4096              # values a row
CEILING_BLOCK_ROWS = 64         # rows widened at once: 1 MB of float32, the fastest of 16-128 here
CEILING_PASSES = 2              # passes over the matrix a timing (one pass is 10-30 ms)
BYTES_PER_VALUE = {"f32": 4.0, "bf16": 2.0, "q8": 1.0, "q4": 0.5}


def _ceiling_matrix(fmt: str, rows: int) -> np.ndarray:
    """A matrix of the format, every page written (the values do not change the speed)."""
    if fmt == "f32":
        return np.full((rows, CEILING_ROW), 0.5, np.float32)
    if fmt == "bf16":
        return np.full((rows, CEILING_ROW), 0x3f00, np.uint16)                      # 0.5 as bfloat16
    if fmt == "q8":
        return np.full((rows, CEILING_ROW), 3, np.int8)
    return np.full((rows, CEILING_ROW // 2), 0x9a, np.uint8)                        # q4: two a byte


def _widen_and_multiply(fmt: str, block: np.ndarray, x: np.ndarray, buf: np.ndarray, tmp: np.ndarray) -> None:
    """The plainest NumPy for one block: widen to float32 (buf), then one gemv."""
    if fmt == "f32":
        block @ x
        return
    buf = buf[:len(block)]
    if fmt == "bf16":
        u32 = buf.view(np.uint32)
        np.copyto(u32, block)
        u32 <<= 16                         # bfloat16 is the top half of a float32
    elif fmt == "q8":
        np.copyto(buf, block)              # int8 -> float32
    else:
        half, tmp = block.shape[1], tmp[:len(block)]
        np.bitwise_and(block, 15, out=tmp)
        np.copyto(buf[:, :half], tmp)
        np.right_shift(block, 4, out=tmp)
        np.copyto(buf[:, half:], tmp)
        buf -= 8.0
    buf @ x


def _passes(fmt: str, w: np.ndarray, rows: slice) -> None:
    """CEILING_PASSES passes of widen-and-multiply over w's rows `rows`, a block at a time."""
    x = np.ones(CEILING_ROW, np.float32)
    buf = np.empty((CEILING_BLOCK_ROWS, CEILING_ROW), np.float32)
    tmp = np.empty((CEILING_BLOCK_ROWS, CEILING_ROW // 2), np.uint8)
    for _ in range(CEILING_PASSES):
        for r in range(rows.start, rows.stop, CEILING_BLOCK_ROWS):
            _widen_and_multiply(fmt, w[r:r + CEILING_BLOCK_ROWS], x, buf, tmp)


class _Team:
    """cores - 1 forked processes that each run their share of the rows when told to; this
    process runs the first share. Forked after the matrix exists, so they read the same pages."""

    def __init__(self, fmt: str, w: np.ndarray, n: int):
        bounds = [len(w) * k // n // CEILING_BLOCK_ROWS * CEILING_BLOCK_ROWS for k in range(n)] + [len(w)]
        self.shares = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
        self.fmt, self.w, self.members = fmt, w, []
        for share in self.shares[1:]:
            go_r, go_w = os.pipe()
            done_r, done_w = os.pipe()
            pid = os.fork()
            if pid == 0:        # a member: one share each time it is told, until the pipe closes
                try:            # (holding no other member's pipe open, or it would never close)
                    for fd in (go_w, done_r, *(fd for _, go, done in self.members for fd in (go, done))):
                        os.close(fd)
                    while os.read(go_r, 1) == b"g":
                        _passes(fmt, w, share)
                        os.write(done_w, b"d")
                finally:
                    os._exit(0)
            os.close(go_r)
            os.close(done_w)
            self.members.append((pid, go_w, done_r))

    def seconds(self) -> float:
        t0 = time.perf_counter()
        for _, go, _ in self.members:
            os.write(go, b"g")
        _passes(self.fmt, self.w, self.shares[0])
        for _, _, done in self.members:
            if os.read(done, 1) != b"d":
                raise OSError("a ceiling probe process ended early")
        return time.perf_counter() - t0

    def close(self) -> None:
        """Close every pipe first (each member then reads the end of its own), then reap them."""
        for _, go, done in self.members:
            for fd in (go, done):
                with contextlib.suppress(OSError):
                    os.close(fd)
        for pid, _, _ in self.members:
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)


def probe_ceiling(runs: int, matvec_gb_per_s: float) -> dict:
    """Per format: one core's G weights/s of plain NumPy widen-and-multiply ("core"), every
    core's at once ("cores_at_once"), and the ceiling, min(every core's, memory GB/s / bytes a
    value) ("g_weights_per_s"), from the best run of each: a ceiling is what NumPy reaches at
    best, and on a shared machine one busy core slows every core's run."""
    from ds2cli.parallel import cores
    n = cores.workers().n
    rows = CEILING_VALUES // CEILING_ROW
    values = CEILING_PASSES * CEILING_VALUES
    core, together, ceiling = {}, {}, {}
    with cores.blas_threads(1):
        for fmt in BYTES_PER_VALUE:
            w = _ceiling_matrix(fmt, rows)
            _passes(fmt, w, slice(0, rows))           # pages warm, outside the timing
            core[fmt] = summary([values / seconds(lambda: _passes(fmt, w, slice(0, rows))) / 1e9
                                 for _ in range(runs)])
            team = _Team(fmt, w, n) if n > 1 else None
            try:
                together[fmt] = summary([values / (team.seconds() if team else seconds(lambda: _passes(fmt, w, slice(0, rows)))) / 1e9
                                         for _ in range(runs)])
            finally:
                if team is not None:
                    team.close()
            ceiling[fmt] = min(together[fmt]["max"], matvec_gb_per_s / BYTES_PER_VALUE[fmt])
            del w
    return {"cores": n, "core": core, "cores_at_once": together, "g_weights_per_s": ceiling}


def probe_beside() -> dict:
    """Both probes again, right before a measurement: on a shared machine the speed drifts within
    a run, and a ratio only means something against a probe taken at the same time."""
    matvec = probe_matvec(POINT_PROBE_RUNS)
    return {"matvec_gb_per_s": matvec,
            "gemm_gflop_per_s": probe_gemm(*GEMM_SHAPES["prefill"], POINT_PROBE_RUNS),
            "ceiling": probe_ceiling(POINT_PROBE_RUNS, matvec["max"])}


def machine_info() -> dict:
    info = {"cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform(),
            "numpy": np.__version__, "blas": None}
    try:
        from threadpoolctl import threadpool_info  # optional: reported when installed
    except ImportError:
        return info
    keys = ("user_api", "internal_api", "version", "num_threads", "threading_layer", "architecture")
    info["blas"] = [{k: lib.get(k) for k in keys} for lib in threadpool_info()]
    return info


def probe_machine() -> dict:
    console.info("probing memory bandwidth, GEMM throughput and NumPy's widening ceiling")
    matvec = probe_matvec(PROBE_RUNS)
    return {"matvec": {"shape": [MATVEC_N, MATVEC_N], "gb_per_s": matvec},
            "gemm": {name: {"shape": list(shape), "gflop_per_s": probe_gemm(*shape, PROBE_RUNS)}
                     for name, shape in GEMM_SHAPES.items()},
            "ceiling": {"values": CEILING_VALUES, **probe_ceiling(POINT_PROBE_RUNS, matvec["max"])}}
