"""What the machine can do, measured: float32 matrix-vector bandwidth (the ceiling for decode,
which reads every active weight once per token) and float32 GEMM throughput (the ceiling for
prefill); and what the machine is (CPUs, numpy, BLAS)."""

from __future__ import annotations

import dataclasses

import contextlib
import os
import platform
import time

import numpy as np

from ds2cli.cli import console
from ds2cli.cli.bench.accounting import storage_format
from ds2cli.cli.bench.timing import seconds, summary

PROBE_RUNS = 8
POINT_PROBE_RUNS = 4        # the probes again beside each measured point, shorter


@dataclasses.dataclass(frozen=True)
class ProbeSizes:
    """The probes' matrices: large enough to measure this machine, not its caches."""
    matvec_n: int = 8192                # 8192 x 8192 float32 = 256 MB, far past any CPU cache
    # (M, K, N): (M, K) @ (N, K)^T, as the engine multiplies by weights: 512 prompt tokens through
    # a 2048 x 2048 projection; one routed expert's gate_up, 512 tokens x top-6 / 64 experts
    gemm_shapes: tuple = (("prefill", (512, 2048, 2048)), ("expert", (48, 2048, 2816)))
    ceiling_values: int = 64 << 20      # weights in each ceiling probe matrix: 64M, past any CPU
                                        # cache in every format


SIZES = ProbeSizes()


def probe_matvec(runs: int) -> dict:
    """GB/s of float32 W @ x with W far larger than the caches: the bandwidth decode can hope for."""
    n = SIZES.matvec_n
    w = np.full((n, n), 1.0 / n, np.float32)                        # written, so every page exists
    x = np.ones(n, np.float32)
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
# not n times one.
# That is what a decode step's products could reach in NumPy at best; ds2's kernels do the same
# work plus their own bookkeeping (or, for q4, less), so decode's share of this ceiling is how
# much of NumPy's speed ds2 keeps.
CEILING_ROW = 4096              # values a row
CEILING_BLOCK_ROWS = 64         # rows widened at once: 1 MB of float32, the fastest of 16-128 here
CEILING_PASSES = 2              # passes over the matrix a timing (one pass is 10-30 ms)
BLOCK_VALUES = CEILING_BLOCK_ROWS * CEILING_ROW
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
    """The plainest NumPy for one block of rows (stored values; q4 two a byte): widen to
    float32 into the flat scratch buf, then one gemv (tmp: q4's nibbles)."""
    if fmt == "f32":
        block @ x
        return
    rows, stored = block.shape
    if fmt == "bf16":
        w = buf[:block.size].reshape(rows, stored)
        u32 = w.view(np.uint32)
        np.copyto(u32, block)
        u32 <<= 16                         # bfloat16 is the top half of a float32
    elif fmt == "q8":
        w = buf[:block.size].reshape(rows, stored)
        np.copyto(w, block)                # int8 -> float32
    else:
        w, t = buf[:2 * block.size].reshape(rows, 2 * stored), tmp[:block.size].reshape(rows, stored)
        np.bitwise_and(block, 15, out=t)
        np.copyto(w[:, :stored], t)
        np.right_shift(block, 4, out=t)
        np.copyto(w[:, stored:], t)
        w -= 8.0
    w @ x


def _scratch() -> tuple[np.ndarray, np.ndarray]:
    """The float32 block buffer (1 MB) and q4's nibble scratch, flat."""
    return np.empty(BLOCK_VALUES, np.float32), np.empty(BLOCK_VALUES // 2, np.uint8)


def _passes(fmt: str, w: np.ndarray, rows: slice) -> None:
    """CEILING_PASSES passes of widen-and-multiply over w's rows `rows`, a block at a time."""
    x = np.ones(CEILING_ROW, np.float32)
    buf, tmp = _scratch()
    for _ in range(CEILING_PASSES):
        for r in range(rows.start, rows.stop, CEILING_BLOCK_ROWS):
            _widen_and_multiply(fmt, w[r:r + CEILING_BLOCK_ROWS], x, buf, tmp)


class _Team:
    """cores - 1 forked processes that each run their share of the work when told to, share(i)
    for member i; this process runs share(0). Forked after the work's arrays exist, so they
    read the same pages."""

    def __init__(self, share, n: int):
        self.share, self.members = share, []
        for i in range(1, n):
            go_r, go_w = os.pipe()
            done_r, done_w = os.pipe()
            pid = os.fork()
            if pid == 0:        # a member: its share each time it is told, until the pipe closes
                try:            # (holding no other member's pipe open, or it would never close)
                    for fd in (go_w, done_r, *(fd for _, go, done in self.members for fd in (go, done))):
                        os.close(fd)
                    while os.read(go_r, 1) == b"g":
                        share(i)
                        os.write(done_w, b"d")
                finally:
                    os._exit(0)
            os.close(go_r)
            os.close(done_w)
            self.members.append((pid, go_w, done_r))

    def seconds(self) -> float:
        """One run of every member's share at once: the time until the last one is done."""
        t0 = time.perf_counter()
        for _, go, _ in self.members:
            os.write(go, b"g")
        self.share(0)
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


def _best_of(share, n: int, runs: int) -> list[float]:
    """Seconds of `runs` runs of share(0..n-1) on n cores at once (a team of forked processes)."""
    if n < 2:
        return [seconds(lambda: share(0)) for _ in range(runs)]
    team = _Team(share, n)
    try:
        return [team.seconds() for _ in range(runs)]
    finally:
        team.close()


def probe_ceiling(runs: int, matvec_gb_per_s: float) -> dict:
    """Per format: one core's G weights/s of plain NumPy widen-and-multiply ("core"), every
    core's at once ("cores_at_once"), and the ceiling, min(every core's, memory GB/s / bytes a
    value) ("g_weights_per_s"), from the best run of each: a ceiling is what NumPy reaches at
    best, and on a shared machine one busy core slows every core's run."""
    from ds2cli.execution.cores import Blas, allowed_cores, split_rows
    n = allowed_cores()
    rows = SIZES.ceiling_values // CEILING_ROW
    values = CEILING_PASSES * SIZES.ceiling_values
    core, together, ceiling = {}, {}, {}
    with Blas().threads(1):
        for fmt in BYTES_PER_VALUE:
            w = _ceiling_matrix(fmt, rows)
            _passes(fmt, w, slice(0, rows))           # pages warm, outside the timing
            core[fmt] = summary([values / seconds(lambda: _passes(fmt, w, slice(0, rows))) / 1e9
                                 for _ in range(runs)])
            shares = split_rows(rows, n, CEILING_BLOCK_ROWS)
            together[fmt] = summary([values / t / 1e9 for t in _best_of(
                lambda i: _passes(fmt, w, slice(*shares[i]) if i < len(shares) else slice(0, 0)), n, runs)])
            ceiling[fmt] = min(together[fmt]["max"], matvec_gb_per_s / BYTES_PER_VALUE[fmt])
            del w
    return {"cores": n, "core": core, "cores_at_once": together, "g_weights_per_s": ceiling}


# The same widen-and-multiply over the matrices a decode step multiplied: the model's own arrays,
# in the step's own shapes (a routed expert's 1408 x 2048, not 16k x 4096), each product's rows
# split evenly over every core at once, and nothing between the products, no message, no wait,
# no Python of ds2's. The ceiling probe above is what NumPy reaches over one large matrix; this
# is what it reaches over the step's: the difference is what the shapes themselves keep (a gemv
# and a cast a block, whatever the block's size; a share's last, short block). ds2's own kernels
# do the same work plus their bookkeeping and the helpers' coordination.
STEP_SHAPES_RUNS = 3


def stored_rows(w) -> tuple[str, np.ndarray]:
    """A weight as the probes widen it: its storage format and its stored values as rows (q4:
    two a byte). A q8b matrix's panels are read as rows of the same bytes; a stacked per-head
    array (w_uk, w_uv) as its rows, (H * d, C) or (H * C, v)."""
    fmt = storage_format(w)
    a = getattr(w, "qweight", getattr(w, "w", w))
    if fmt == "bf16":
        a = a.view(np.uint16)
    row = w.shape[-1] // 2 if fmt == "q4" else w.shape[-1]
    return fmt, a.reshape(-1, row)


def _replay(matrices: list[tuple[str, np.ndarray]], i: int, n: int) -> None:
    """Core i's share of every matrix, in order: its rows (an even split in multiples of 8, as
    the threads split a product) widened and multiplied a block of about BLOCK_VALUES at a time."""
    from ds2cli.execution.cores import split_rows
    buf, tmp = _scratch()
    xs: dict[int, np.ndarray] = {}
    for fmt, a in matrices:
        rows, stored = a.shape
        inp = 2 * stored if fmt == "q4" else stored
        x = xs.setdefault(inp, np.ones(inp, np.float32))
        shares = split_rows(rows, n, 8)                 # fewer than n for a matrix of few rows
        r0, r1 = shares[i] if i < len(shares) else (0, 0)
        block = max(8, BLOCK_VALUES // inp // 8 * 8)
        for r in range(r0, r1, block):
            _widen_and_multiply(fmt, a[r:min(r + block, r1)], x, buf, tmp)


def probe_step_shapes(matrices: list, steps: int, runs: int = STEP_SHAPES_RUNS) -> dict:
    """Per format: plain NumPy's G weights/s over the weights a decode step multiplied
    (`matrices`: those of `steps` steps, in order), every core at once, the best of `runs`;
    and the seconds a step's products take at those rates, summed over the formats."""
    from ds2cli.execution.cores import Blas, allowed_cores
    n = allowed_cores()
    by_format: dict[str, list] = {}
    for w in matrices:
        fmt, a = stored_rows(w)
        by_format.setdefault(fmt, []).append((fmt, a))
    out = {}
    with Blas().threads(1):
        for fmt, group in by_format.items():
            values = sum(a.size * (2 if fmt == "q4" else 1) for _, a in group)
            best = min(_best_of(lambda i: _replay(group, i, n), n, runs))
            out[fmt] = {"values_per_step": values / steps, "seconds_per_step": best / steps,
                        "g_weights_per_s": values / best / 1e9}
    return {"cores": n, "steps": steps, "by_format": out,
            "products_s": sum(f["seconds_per_step"] for f in out.values())}


def probe_beside() -> dict:
    """Both probes again, right before a measurement: on a shared machine the speed drifts within
    a run, and a ratio only means something against a probe taken at the same time."""
    matvec = probe_matvec(POINT_PROBE_RUNS)
    return {"matvec_gb_per_s": matvec,
            "gemm_gflop_per_s": probe_gemm(*dict(SIZES.gemm_shapes)["prefill"], POINT_PROBE_RUNS),
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
    return {"matvec": {"shape": [SIZES.matvec_n, SIZES.matvec_n], "gb_per_s": matvec},
            "gemm": {name: {"shape": list(shape), "gflop_per_s": probe_gemm(*shape, PROBE_RUNS)}
                     for name, shape in SIZES.gemm_shapes},
            "ceiling": {"values": SIZES.ceiling_values, **probe_ceiling(POINT_PROBE_RUNS, matvec["max"])}}
