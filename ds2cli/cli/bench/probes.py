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


def probe_beside() -> dict:
    """Both probes again, right before a measurement: on a shared machine the speed drifts within
    a run, and a ratio only means something against a probe taken at the same time."""
    return {"matvec_gb_per_s": probe_matvec(POINT_PROBE_RUNS),
            "gemm_gflop_per_s": probe_gemm(*GEMM_SHAPES["prefill"], POINT_PROBE_RUNS)}


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
    console.info("probing memory bandwidth and GEMM throughput")
    return {"matvec": {"shape": [MATVEC_N, MATVEC_N], "gb_per_s": probe_matvec(PROBE_RUNS)},
            "gemm": {name: {"shape": list(shape), "gflop_per_s": probe_gemm(*shape, PROBE_RUNS)}
                     for name, shape in GEMM_SHAPES.items()}}
