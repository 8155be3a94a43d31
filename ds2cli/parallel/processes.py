"""Helper processes: the other cores of a decode step (and of any pass of few tokens).

Two threads that both call NumPy in short calls spend much of their time handing the GIL to
each other (measured: the q8 decode kernel run on two cores scaled 1.3-1.6x as two threads and
1.9x as two processes). So a one-token step, or a pass of a few tokens (cores.FEW_TOKENS),
hands the other cores' rows of each product to helper processes instead. A helper is forked from this process once the weights exist, so it
sees every weight at the same address: memory-mapped files and copy-on-write pages are shared
with it, never copied. For each matvec this process writes x into the helper's shared memory,
sends it one small message through a pipe (which matrix, which rows), runs its own rows, and
reads the helper's rows back from the shared memory.

The protocol: a JOB message (seq, matrix key, expert, rows a..b, in, out, k) on the helper's job
pipe, x (k, in) in its shared memory; the helper writes its columns a..b of y (k, out) beside x
and answers DONE (seq, ok).
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

_matrices: list[weakref.ref] = []    # a matrix's key -> the matrix, in this and every helper
_helpers_failed = False               # a helper died or could not start: threads from then on
JOB = struct.Struct("<qqqqqqqq")      # seq, key, expert (-1: none), rows a, b, in, out, k
DONE = struct.Struct("<qq")           # seq, 1 if the rows are in shared memory, 0 if not
HELPER_VALUES = 1 << 23               # float32 values of shared memory a helper: x, then y (32 MB
                                      # reserved, touched only as far as a product's k rows reach)
HELPER_SPIN = 0.01                    # seconds a process polls for its next message (receive)
HELPER_TIMEOUT = 60.0                 # a helper silent this long on one matvec is taken as stuck


def helpers_wanted() -> bool:
    """Whether few-token passes split their products across helper processes: on Linux (macOS's
    system libraries, Accelerate among them, are not safe to use in a forked child, which is why
    Python's multiprocessing no longer forks there), with more than one core; DS2_HELPERS=0
    turns them off, and threads are used instead."""
    return (sys.platform.startswith("linux") and cores.workers().n > 1 and not _helpers_failed
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

    def wanted(self) -> bool:
        return helpers_wanted()

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

    def matvec(self, m, x: np.ndarray, y: np.ndarray, spans: list[tuple[int, int]], span) -> bool:
        """Rows spans[0] here, spans[1:] on the helpers; False (nothing done) if they are busy
        with another thread's step or cannot take the matrix."""
        global _helpers_failed
        key, expert = m.key
        inp, out = x.shape[-1], y.shape[-1]
        k = x.size // inp        # x (in,) or (k, in), y (out,) or (k, out): k tokens at once
        if key >= self.horizon or (inp + out) * k > HELPER_VALUES or not self.lock.acquire(blocking=False):
            return False
        try:
            self.seq += 1
            sent = []
            for h, (a, b) in zip(self.procs, spans[1:]):
                h.values[:inp * k] = x.reshape(-1)
                os.write(h.jobs, JOB.pack(self.seq, key, expert, a, b, inp, out, k))
                sent.append((h, a, b))
            span(x, y, *spans[0])
            for h, a, b in sent:
                if self.wait(h):
                    y[..., a:b] = h.values[k * inp:k * (inp + out)].reshape(y.shape)[..., a:b]
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
    """Raised by Helpers.matvec when a helper dies; the caller then runs the matvec itself."""


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
    while (job := receive(jobs, JOB.size)) is not None:
        seq, key, expert, a, b, inp, out, k = JOB.unpack(job)
        ok = 0
        try:
            m = _matrices[key]() if key < len(_matrices) else None   # a QuantMatrix (quant.py)
            if m is not None:
                m = m[expert] if expert >= 0 else m
                x, y = values[:inp * k], values[inp * k:(inp + out) * k]
                m.span(x.reshape(k, inp), y.reshape(k, out), a, b)
                ok = 1
        except Exception:    # noqa: BLE001 - any failure: the parent runs the rows itself
            ok = 0
        os.write(done, DONE.pack(seq, ok))


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


def helpers_for() -> Helpers | None:
    """The helper processes, if this product is in a pass of few tokens (a decode step, a
    verification pass, a short prompt: cores.FEW_TOKENS); Helpers.matvec declines a matrix they
    do not know."""
    pool = cores.workers()
    if pool.helpers is None or not (pool.held and pool.few) or pool.inside or not helpers_wanted():
        return None
    return pool.helpers


def register(matrix) -> int:
    """A new matrix's key: how a helper process, forked later, finds the same matrix."""
    _matrices.append(weakref.ref(matrix))
    return len(_matrices) - 1
