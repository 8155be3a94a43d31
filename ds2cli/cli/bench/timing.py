"""The two primitives every measurement uses: the seconds one call takes, and the summary of a
run's samples that every figure reports."""

from __future__ import annotations

import statistics
import time


def summary(samples: list[float]) -> dict:
    samples = [float(s) for s in samples]
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples), "runs": samples}


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
