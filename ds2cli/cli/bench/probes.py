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
# multiplying by one token, every core at once, over a matrix past the caches. It is what a
# decode step's products could reach in NumPy at best; ds2's kernels do the same work plus their
# own bookkeeping, so decode's share of this ceiling is how much of NumPy's speed ds2 keeps.
CEILING_VALUES = 64 << 20       # weights in each probe matrix: 64M, past any CPU cache in every format
CEILING_ROW = 4096              # values a row
CEILING_BLOCK_ROWS = 16         # rows widened at once: 16 x 4096 float32 = 256 KB, L2-sized
CEILING_FORMATS = ("f32", "bf16", "q8", "q4")


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
    if fmt == "bf16":
        u32 = buf.view(np.uint32)
        np.copyto(u32, block)
        u32 <<= 16                         # bfloat16 is the top half of a float32
    elif fmt == "q8":
        np.copyto(buf, block)              # int8 -> float32
    else:
        half = block.shape[1]
        np.bitwise_and(block, 15, out=tmp)
        np.copyto(buf[:, :half], tmp)
        np.right_shift(block, 4, out=tmp)
        np.copyto(buf[:, half:], tmp)
        buf -= 8.0
    buf @ x


def probe_ceiling(runs: int) -> dict:
    """G weights/s a format's plain NumPy widen-and-multiply reaches on every core (threads over
    row blocks, BLAS at one thread each), per format: the ceiling of a decode step's products."""
    from concurrent.futures import ThreadPoolExecutor
    from ds2cli.parallel import cores
    n = cores.workers().n
    rows = CEILING_VALUES // CEILING_ROW
    x = np.ones(CEILING_ROW, np.float32)
    out = {}
    with ThreadPoolExecutor(n) as pool, cores.blas_threads(1):
        for fmt in CEILING_FORMATS:
            w = _ceiling_matrix(fmt, rows)
            spans = [(k * rows // n, (k + 1) * rows // n) for k in range(n)]

            def lane(span, fmt=fmt, w=w) -> None:
                buf = np.empty((CEILING_BLOCK_ROWS, CEILING_ROW), np.float32)
                tmp = np.empty((CEILING_BLOCK_ROWS, CEILING_ROW // 2), np.uint8)
                for r in range(span[0], span[1], CEILING_BLOCK_ROWS):
                    _widen_and_multiply(fmt, w[r:r + CEILING_BLOCK_ROWS], x, buf, tmp)

            def one_pass() -> None:
                list(pool.map(lane, spans))
            one_pass()                              # pages and threads warm, outside the timing
            out[fmt] = summary([CEILING_VALUES / seconds(one_pass) / 1e9 for _ in range(runs)])
            del w
    return out


def probe_beside() -> dict:
    """Both probes again, right before a measurement: on a shared machine the speed drifts within
    a run, and a ratio only means something against a probe taken at the same time."""
    return {"matvec_gb_per_s": probe_matvec(POINT_PROBE_RUNS),
            "gemm_gflop_per_s": probe_gemm(*GEMM_SHAPES["prefill"], POINT_PROBE_RUNS),
            "ceiling_g_weights_per_s": probe_ceiling(2)}


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
    return {"matvec": {"shape": [MATVEC_N, MATVEC_N], "gb_per_s": probe_matvec(PROBE_RUNS)},
            "gemm": {name: {"shape": list(shape), "gflop_per_s": probe_gemm(*shape, PROBE_RUNS)}
                     for name, shape in GEMM_SHAPES.items()},
            "ceiling": {"values": CEILING_VALUES, "g_weights_per_s": probe_ceiling(POINT_PROBE_RUNS)}}
