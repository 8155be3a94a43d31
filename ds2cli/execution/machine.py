"""The machine a model runs on, as one object: the cores this process uses (a thread pool), BLAS's
threads, the forked helper processes and the registry of matrices they read. Made once, with
the environment read then (DS2_HELPERS), and handed to what needs it: two models in one
process each have their own, and a test gives it what it wants to try (`threads`, `helpers`).
"""

from __future__ import annotations

import contextlib
import os
import sys

from ds2cli.execution.cores import Blas, Workers, allowed_cores
from ds2cli.execution.helpers import Helpers, private_bytes
from ds2cli.execution.load import Load
from ds2cli.execution.plans import Registry


class Machine:
    """This process's cores (`threads` at most: --threads) and, where they pay, helper
    processes for few-token passes over low-bit weights. `helpers`: whether to use them (None:
    on Linux with more than one core unless DS2_HELPERS=0; macOS's system libraries,
    Accelerate among them, are not safe in a forked child). `load`: how busy the CPUs are."""

    def __init__(self, threads: int | None = None, helpers: bool | None = None, load: Load | None = None,
                 environ=None):
        environ = os.environ if environ is None else environ
        n = min(threads, allowed_cores()) if threads else allowed_cores()
        self.workers = Workers(max(1, n), load=load, blas=Blas())
        if helpers is None:
            helpers = sys.platform.startswith("linux") and environ.get("DS2_HELPERS", "1") != "0"
        self.helpers_allowed = helpers and self.workers.n > 1
        self.registry = Registry()

    @property
    def helpers(self) -> Helpers | None:
        """The helper processes while they run."""
        return self.workers.helpers

    def register(self, weights) -> None:
        """Name every weight that helpers can multiply by (`span`) to them."""
        for w in weights:
            if hasattr(w, "span"):
                self.registry.add(w)

    def start_helpers(self) -> None:
        """Fork the helper processes anew: they then know every matrix registered, and the
        helpers forked before, which would keep an earlier model's memory alive in their copy
        of this process, are gone. Forked right after the load, the copy holds no scratch
        buffers or caches of this process yet. A fork that fails leaves threads alone."""
        self.stop_helpers()
        if self.helpers_allowed and not self.workers.helpers_failed:
            try:
                self.workers.helpers = Helpers(self.workers.n - 1, self.registry, self.workers)
            except OSError:
                self.helpers_allowed = False

    def stop_helpers(self) -> None:
        if self.workers.helpers is not None:
            self.workers.helpers.stop()
            self.workers.helpers = None

    def forward_pass(self, low_bit: bool, tokens: int):
        """What a pass of `tokens` tokens runs in (cores.Workers.forward_pass); once helpers have
        failed (one died, one got stuck: Workers stopped them), threads from then on."""
        if self.workers.helpers_failed:
            self.helpers_allowed = False
        return self.workers.forward_pass(low_bit, tokens, self.helpers_allowed)

    def helper_private_bytes(self) -> int:
        """Resident memory of the helpers that this process does not also map (helpers.private_bytes)."""
        return private_bytes(self.helpers.pids()) if self.helpers is not None else 0

    @contextlib.contextmanager
    def blas_threads(self, n: int):
        with self.workers.blas.threads(n):
            yield
