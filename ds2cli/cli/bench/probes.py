"""What the machine can do, measured: float32 matrix-vector bandwidth (the ceiling for decode,
which reads every active weight once per token) and float32 GEMM throughput (the ceiling for
prefill); and what the machine is (CPUs, numpy, BLAS)."""

from __future__ import annotations

import os
import platform

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
# multiplying by one token, over a matrix past the caches. Measured on one core (this thread,
# BLAS at one thread) and scaled by the cores, capped by what memory can deliver of that format
# (the matvec probe's GB/s over its bytes a value): what a decode step's products could reach
# in NumPy at best. Threads measured together fall short of it (the GIL between their short
# calls: 1.5x on 2 cores for int8), which is why ds2 hands decode's rows to processes. ds2's
# kernels do the same work plus their own bookkeeping, so decode's share of this ceiling is how
# much of NumPy's speed ds2 keeps.
CEILING_VALUES = 64 << 20       # weights in each probe matrix: 64M, past any CPU cache in every format
CEILING_ROW = 4096              # values a row
CEILING_BLOCK_ROWS = 64         # rows widened at once: 1 MB of float32, the fastest of 16-128 here
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


def probe_ceiling(runs: int, matvec_gb_per_s: float) -> dict:
    """Per format: one core's G weights/s of plain NumPy widen-and-multiply ("core"), and the
    ceiling of all the cores, min(cores x that, memory GB/s / bytes a value) ("g_weights_per_s")."""
    from ds2cli.parallel import cores
    n = cores.workers().n
    rows = CEILING_VALUES // CEILING_ROW
    x = np.ones(CEILING_ROW, np.float32)
    buf = np.empty((CEILING_BLOCK_ROWS, CEILING_ROW), np.float32)
    tmp = np.empty((CEILING_BLOCK_ROWS, CEILING_ROW // 2), np.uint8)
    core, ceiling = {}, {}
    with cores.blas_threads(1):
        for fmt in BYTES_PER_VALUE:
            w = _ceiling_matrix(fmt, rows)

            def one_pass(fmt=fmt, w=w) -> None:
                for r in range(0, rows, CEILING_BLOCK_ROWS):
                    _widen_and_multiply(fmt, w[r:r + CEILING_BLOCK_ROWS], x, buf, tmp)
            one_pass()                              # pages warm, outside the timing
            core[fmt] = summary([CEILING_VALUES / seconds(one_pass) / 1e9 for _ in range(runs)])
            ceiling[fmt] = min(n * core[fmt]["median"], matvec_gb_per_s / BYTES_PER_VALUE[fmt])
            del w
    return {"cores": n, "core": core, "g_weights_per_s": ceiling}


def probe_beside() -> dict:
    """Both probes again, right before a measurement: on a shared machine the speed drifts within
    a run, and a ratio only means something against a probe taken at the same time."""
    matvec = probe_matvec(POINT_PROBE_RUNS)
    return {"matvec_gb_per_s": matvec,
            "gemm_gflop_per_s": probe_gemm(*GEMM_SHAPES["prefill"], POINT_PROBE_RUNS),
            "ceiling": probe_ceiling(2, matvec["median"])}


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
            "ceiling": {"values": CEILING_VALUES, **probe_ceiling(POINT_PROBE_RUNS, matvec["median"])}}
