"""How many cores a measurement used, for `ds2 bench` and `--stats`, two ways:

  given   the cores the model's machine gave each pass: execution/load.py's count of the cores
          other programs leave free, at most the machine's `threads` (--threads, else this
          process's cores, at most 8). --threads N is a bound, not a count.
  busy    CPU seconds a second of the measurement, of this process (all its threads, BLAS's
          included) and of its helper processes: the cores actually kept busy. Below `given`
          where the work waited (a core given but shared with another program counts for the
          share it got); a helper spinning for its next plan counts as busy, and so do BLAS's
          threads spinning after a call. Other threads' time is the kernel's count, which runs
          up to a scheduler tick behind: over a span of a few milliseconds, busy reads high.

A figure taken beside other work says so: fewer cores given, or fewer kept busy.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

from ds2cli.execution.compute import CoreCompute
from ds2cli.execution.executor import Executor
from ds2cli.execution.load import process_ticks

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100     # /proc/PID/stat's unit of CPU time


class CoresUsed:
    """The cores given and kept busy over the spans of one measurement:

        used = CoresUsed(model)
        with used.span():                   # the timed part, one span or several
            for token in ids:
                model.forward(...)
                used.after_pass()           # the cores this pass was given
        used.report()                       # {"threads": 2, "given": {...}, "busy": 1.93}

    `threads` and `given` are None for a model that runs on no machine of its own (the
    reference executor; a cluster's driver, whose stages run elsewhere)."""

    def __init__(self, model):
        ex = model.executor
        compute = ex.compute if isinstance(ex, Executor) else None
        self.machine = compute.machine if isinstance(compute, CoreCompute) else None
        self.given: list[int] = []
        self.wall = self.cpu = 0.0
        self.started: tuple[float, float, list[int]] | None = None    # (wall, CPU, helpers) at start

    def start(self) -> None:
        helpers = self.machine.helpers if self.machine is not None else None
        pids = helpers.pids() if helpers is not None else []
        self.started = (time.perf_counter(), cpu_seconds(pids), pids)

    def stop(self) -> None:
        if self.started is not None:
            t0, cpu0, pids = self.started
            self.wall += time.perf_counter() - t0
            self.cpu += cpu_seconds(pids) - cpu0
            self.started = None

    @contextlib.contextmanager
    def span(self):
        self.start()
        try:
            yield
        finally:
            self.stop()

    def after_pass(self) -> None:
        """Count the cores the pass that just ran was given."""
        if self.machine is not None:
            self.given.append(self.machine.workers.using)

    def report(self) -> dict:
        """{"threads", "given": {"min", "median", "max"} over the passes counted, "busy"}; a span
        still open counts up to now."""
        wall, cpu = self.wall, self.cpu
        if self.started is not None:
            t0, cpu0, pids = self.started
            wall, cpu = wall + time.perf_counter() - t0, cpu + cpu_seconds(pids) - cpu0
        given = ({"min": min(self.given), "median": statistics.median(self.given), "max": max(self.given)}
                 if self.given else None)
        return {"threads": self.machine.workers.n if self.machine is not None else None, "given": given,
                "busy": max(0.0, cpu) / wall if wall > 0 else 0.0}


def cpu_seconds(helpers: list[int]) -> float:
    """CPU seconds this process (all its threads, to the nanosecond) and the helper processes
    `helpers` have run. A helper is one thread: its time is /proc/PID/schedstat's first field
    (nanoseconds), or /proc/PID/stat's ticks where the kernel keeps no scheduler statistics; a
    helper that has ended counts nothing."""
    total = time.process_time()
    for pid in helpers:
        try:
            with open(f"/proc/{pid}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            total += (process_ticks([pid]) or 0) / TICK
    return total


def cores_text(reports: dict[str, dict]) -> str | None:
    """The --stats part: "cores 1.9 prefill, 1.6 decode (of 2)", each phase's busy cores and the
    cores the passes were given ("of 1-2" where that changed); None where no machine counted."""
    shown = {name: r for name, r in reports.items() if r["given"] is not None}
    if not shown:
        return None
    low, high = min(r["given"]["min"] for r in shown.values()), max(r["given"]["max"] for r in shown.values())
    given = f"{low}" if low == high else f"{low}-{high}"
    return "cores " + ", ".join(f"{r['busy']:.1f} {name}" for name, r in shown.items()) + f" (of {given})"
