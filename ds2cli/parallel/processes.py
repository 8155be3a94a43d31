"""Helper processes: the other cores of a decode step (and of any pass of few tokens).

Two threads that both call NumPy in short calls spend much of their time handing the GIL to
each other (measured: the q8 decode kernel run on two cores scaled 1.3-1.6x as two threads and
1.9x as two processes). So a one-token step, or a pass of a few tokens (cores.FEW_TOKENS),
hands the other cores' rows of each product to helper processes instead. A helper is forked from
this process once the weights exist, so it sees every weight at the same address: memory-mapped
files and copy-on-write pages are shared with it, never copied.

The protocol: this process sends a helper a *plan*, one or more products at once (the products
that `cores.together` gathered: a layer's experts, or q and kv beside each other). It writes
each product's x (k, in) into the helper's shared memory, the plan's table beside them (one row
a product: matrix key, expert, rows a..b, in, out, k, where x is, where y goes), and one small
PLAN message (seq, products) on the helper's job pipe; then it runs its own rows of every
product while the helper runs its rows, writes them into its y's in the shared memory and
answers DONE (seq, ok, seconds). One message and one wait a plan, not one a product: the
message, the helper's wake-up and the wait for the slower process are paid once for all of
them. How many rows each process takes follows the seconds each took (SHARE_WEIGHT below).
A matrix is known to a helper by its key (`register`), given before the fork.
"""

from __future__ import annotations

import contextlib
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

import numpy as np

from ds2cli.parallel import cores
from ds2cli.parallel.cores import split_shares

_matrices: list[weakref.ref] = []    # a matrix's key -> the matrix, in this and every helper
_helpers_failed = False               # a helper died or could not start: threads from then on
PLAN = struct.Struct("<qq")           # seq, products in the plan (its first rows of the table)
ENTRY = 9                             # a table row: key, expert (-1: none), rows a, b, in, out, k,
                                      # x's offset and y's offset in the values (float32 units)
DONE = struct.Struct("<qqd")          # seq, 1 if the rows are in shared memory (0 if not), the
                                      # seconds the helper spent on them
PLAN_PRODUCTS = 1024                  # a plan's table holds at most this many products (72 KB)
HELPER_VALUES = 1 << 23               # float32 values of shared memory a helper: the x's, then the
                                      # y's (32 MB reserved, touched only as far as a plan reaches)
HELPER_SPIN = 0.01                    # seconds a process polls for its next message (receive)
HELPER_TIMEOUT = 60.0                 # a helper silent this long on one matvec is taken as stuck
# Each process's share of a one-token plan's rows follows how fast it ran the last ones (an
# average of the weights a second, weighing each new plan this much): a core that another
# program also uses, or that waits on memory more, gets fewer rows, so that the processes finish
# together (the 4-layer slice at 8 bits, 2 cores: this process ran its spans at 2.6 G weights/s,
# its helper at 3.3, and waited 6 ms a step for it with even halves). Only one token's: its rows
# are each one dot product with the token, which OpenBLAS's gemv gives as the same bits whoever
# computes them (measured here for every cut of q8, q4, bf16 and q8b), so the split does not show
# in the results; a plan of several tokens (GEMM tiles, whose bits depend on the cut) is split
# evenly, always the same way, so that its results do not depend on the timing. A share never
# falls below SHARE_FLOOR of an even one, so every core keeps being timed.
SHARE_WEIGHT = 0.2
SHARE_FLOOR = 0.25


def helpers_wanted() -> bool:
    """Whether few-token passes split their products across helper processes: on Linux (macOS's
    system libraries, Accelerate among them, are not safe to use in a forked child, which is why
    Python's multiprocessing no longer forks there), with more than one core; DS2_HELPERS=0
    turns them off, and threads are used instead."""
    return (sys.platform.startswith("linux") and cores.workers().n > 1 and not _helpers_failed
            and os.environ.get("DS2_HELPERS", "1") != "0")


TABLE_BYTES = 8 * ENTRY * PLAN_PRODUCTS


def shared_views(shared: mmap.mmap) -> tuple[np.ndarray, np.ndarray]:
    """A helper's shared memory as its plan table (PLAN_PRODUCTS, ENTRY) int64 and its values."""
    table = np.frombuffer(shared, np.int64, ENTRY * PLAN_PRODUCTS).reshape(PLAN_PRODUCTS, ENTRY)
    return table, np.frombuffer(shared, np.float32, HELPER_VALUES, offset=TABLE_BYTES)


class Helper:
    """One forked helper, from this process's side: its pid, its two pipes and its memory."""

    def __init__(self, pid: int, jobs: int, done: int, shared: mmap.mmap):
        self.pid, self.jobs, self.done, self.shared = pid, jobs, done, shared
        self.table, self.values = shared_views(shared)
        self.closed = False


class Helpers:
    """n helper processes, forked now; they know every matrix whose key is below `horizon`."""

    def __init__(self, n: int):
        self.horizon = len(_matrices)
        self.seq = 0                 # plans sent
        self.products = 0            # products the plans held
        self.speeds = [1.0] * (n + 1)  # G weights a second of this process, then of each helper
        self.lock = threading.Lock()
        self.procs: list[Helper] = []
        try:
            for _ in range(n):
                self.procs.append(self.fork())
        except OSError:
            self.stop()
            raise
        weakref.finalize(self, stop_helpers, list(self.procs))

    def wanted(self) -> bool:
        return helpers_wanted()

    def fork(self) -> Helper:
        shared = mmap.mmap(-1, TABLE_BYTES + 4 * HELPER_VALUES)   # anonymous, shared across the fork
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
                helper_main(parent, with_parent, jobs_r, done_w, shared)
            finally:
                os._exit(0)
        os.close(jobs_r)
        os.close(done_w)
        os.set_blocking(done_r, False)
        return Helper(pid, jobs_w, done_r, shared)

    def stop(self) -> None:
        stop_helpers(self.procs)
        self.procs = []

    def run(self, products: list) -> list:
        """Each product's rows split by the processes' shares (`shares`), the first span here and
        one on each helper, in as few plans as the shared memory allows (one for a decode
        step's); returns the products left to the caller: those the helpers do not know, or all
        of them if the helpers are busy with another thread's pass or one of them is gone (the
        caller runs them on threads, writing again whatever this process already wrote into
        their y). A product (cores.Rows) has m (with .key and .span), x (in,) or (k, in),
        y (out,) or (k, out) and its alignment; this sets its spans."""
        global _helpers_failed
        known = [p for p in products if p.m.key[0] < self.horizon and ends(p, 0) <= HELPER_VALUES]
        if not known or not self.lock.acquire(blocking=False):
            return products
        adapt = all(p.x.size == p.x.shape[-1] for p in known)              # one token each
        shares = self.shares() if adapt else [1 / len(self.speeds)] * len(self.speeds)
        for p in known:
            p.spans = split_shares(p.rows, shares, p.align)
        try:
            for plan in plans(known):
                self.run_plan(plan, adapt)
            return [p for p in products if not any(p is q for q in known)]
        except OSError:      # a helper is gone (killed, out of memory) or stuck: carry on without
            _helpers_failed = True                                                # them
            return products
        finally:
            self.lock.release()
            if _helpers_failed:
                stop_helpers_now()

    def run_plan(self, plan: list, timed: bool = True) -> None:
        """One plan: every helper is sent its rows of every product, this process runs its own,
        then it reads theirs; with `timed`, each process's time updates its speed."""
        self.send(plan)
        t0 = time.perf_counter()
        for p in plan:
            a, b = p.spans[0]
            if b > a:
                p.m.span(p.x, p.y, a, b)
        if timed:
            self.timed(0, plan, time.perf_counter() - t0)
        self.collect(plan, timed)

    def shares(self) -> list[float]:
        """Each process's share of the next plan's rows, by its speed on the last ones."""
        floor = SHARE_FLOOR * sum(self.speeds) / len(self.speeds)
        speeds = [max(floor, v) for v in self.speeds]
        return [v / sum(speeds) for v in speeds]

    def timed(self, i: int, plan: list, seconds: float) -> None:
        """Process i (0: this one) ran its spans of the plan in `seconds`: its speed, averaged."""
        values = sum((p.spans[i][1] - p.spans[i][0]) * p.x.size for p in plan)
        if values and seconds > 0:
            self.speeds[i] += SHARE_WEIGHT * (values / seconds / 1e9 - self.speeds[i])

    def send(self, plan: list) -> None:
        """Each helper's rows of the plan, its x's and table into its shared memory, then the
        PLAN message."""
        self.seq += 1
        self.products += len(plan)
        for i, h in enumerate(self.procs, start=1):
            at = 0
            for row, p in enumerate(plan):
                inp, out = p.x.shape[-1], p.y.shape[-1]
                k = p.x.size // inp
                a, b = p.spans[i]
                h.values[at:at + inp * k] = p.x.reshape(-1)
                h.table[row] = (*p.m.key, a, b, inp, out, k, at, at + inp * k)
                at = ends(p, at)
            os.write(h.jobs, PLAN.pack(self.seq, len(plan)))

    def collect(self, plan: list, timed: bool = True) -> None:
        """Wait for each helper's answer and copy its rows into the plan's y's (or, if it could
        not run them, run them here)."""
        for i, h in enumerate(self.procs, start=1):
            ok, seconds = self.wait(h)
            if ok and timed:
                self.timed(i, plan, seconds)
            for row, p in enumerate(plan):
                a, b = p.spans[i]
                if b <= a:
                    continue
                if ok:
                    out, k, y_at = p.y.shape[-1], p.x.size // p.x.shape[-1], int(h.table[row, 8])
                    p.y.reshape(k, out)[:, a:b] = h.values[y_at:y_at + k * out].reshape(k, out)[:, a:b]
                else:
                    p.m.span(p.x, p.y, a, b)

    def wait(self, h: Helper) -> tuple[bool, float]:
        """Read h's replies up to this plan's (an interrupted pass leaves its reply unread):
        whether it ran its rows, and in how many seconds."""
        while True:
            reply = receive(h.done, DONE.size, HELPER_TIMEOUT)
            if reply is None:
                raise OSError("a helper process exited")
            seq, ok, seconds = DONE.unpack(reply)
            if seq == self.seq:
                return bool(ok), seconds


def ends(p, at: int) -> int:
    """Where product p's x and y end in a helper's shared memory if they start at `at`."""
    return at + (p.x.shape[-1] + p.y.shape[-1]) * (p.x.size // p.x.shape[-1])


def plans(products: list) -> list[list]:
    """The products in order, as plans that each fit a helper's table and shared memory."""
    out, at = [[]], 0
    for p in products:
        if out[-1] and (len(out[-1]) == PLAN_PRODUCTS or ends(p, at) > HELPER_VALUES):
            out.append([])
            at = 0
        out[-1].append(p)
        at = ends(p, at)
    return out


def receive(fd: int, size: int, timeout: float | None = None) -> bytes | None:
    """The next message of `size` bytes from a non-blocking pipe, None once it is closed;
    TimeoutError after `timeout` seconds without one.

    Polls for HELPER_SPIN seconds before sleeping in select: a process that sleeps between a
    step's plans is woken up to a millisecond late on this VM (a 2816x2048 q4 matvec split
    over two processes took 2.4 ms, median, against 1.2 ms for either half), and a decode step
    sends the next plan well within the spin. Messages are shorter than PIPE_BUF, so each is
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


def helper_main(parent: int, with_parent: bool, jobs: int, done: int, shared: mmap.mmap) -> None:
    """A helper's life: run its rows of each plan it is sent until the job pipe closes (this
    process's parent exited or stopped it). Ctrl-C is the parent's to handle; the helper dies
    with the parent."""
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
    cores.use_workers(cores.Workers(1))   # one core, no pool, no lock another thread holds
    os.set_blocking(jobs, False)
    for c in cores.blas_controllers():
        c.set_num_threads(1)
    table, values = shared_views(shared)
    while (message := receive(jobs, PLAN.size)) is not None:
        seq, n = PLAN.unpack(message)
        t0 = time.perf_counter()
        try:
            for key, expert, a, b, inp, out, k, x_at, y_at in table[:n].tolist():
                if b > a:
                    m = _matrices[key]()                                    # a QuantMatrix (quant.py)
                    m = m[expert] if expert >= 0 else m
                    m.span(values[x_at:x_at + inp * k].reshape(k, inp), values[y_at:y_at + out * k].reshape(k, out), a, b)
            ok = 1
        except Exception:    # noqa: BLE001 - any failure (a matrix gone too): the parent runs the rows
            ok = 0
        os.write(done, DONE.pack(seq, ok, time.perf_counter() - t0))


def start_helpers() -> None:
    """Fork the helper processes anew (loader.load calls this once a low-bit model is loaded):
    they then know every matrix alive, and the helpers of an earlier model, which would keep
    its memory alive in their copy of this process, are gone. Forking right after the load also
    means the copy holds no scratch buffers or caches of this process yet."""
    global _helpers_failed
    stop_helpers_now()
    if helpers_wanted():
        try:
            cores.workers().helpers = Helpers(cores.workers().n - 1)
        except OSError:
            _helpers_failed = True


def running() -> "Helpers | None":
    """The helper processes of this process, if they were started."""
    return cores.workers().helpers


def stop_helpers_now() -> None:
    pool = cores.workers()
    if pool.helpers is not None:
        pool.helpers.stop()
        pool.helpers = None


def helper_private_bytes() -> int:
    """Resident memory of the helpers that this process does not also map: their scratch, the
    pages of this process's heap they wrote since the fork, and the weight pages only they have
    read (a decode step reads each matrix's rows split between the processes). Added to this
    process's RSS it counts every resident page once. Linux only (0 elsewhere)."""
    total = 0
    for h in running().procs if running() is not None else []:
        with contextlib.suppress(OSError), open(f"/proc/{h.pid}/smaps_rollup") as f:
            total += sum(int(line.split()[1]) * 1024 for line in f
                         if line.startswith(("Private_Clean:", "Private_Dirty:")))
    return total


def register(matrix) -> int:
    """A new matrix's key: how a helper process, forked later, finds the same matrix."""
    _matrices.append(weakref.ref(matrix))
    return len(_matrices) - 1
