"""Helper processes: the other cores of a decode step (and of any pass of few tokens).

Two threads that both call NumPy in short calls spend much of their time handing the GIL to
each other: the q8 decode kernel scales far better over processes than over threads
(docs/performance.md, "Why the constants are what they are"). So a one-token step, or a pass of a few tokens (cores.FEW_TOKENS),
hands the other cores' rows of each product to helper processes instead. A helper is forked from
this process once the weights exist, so it sees every weight at the same address: memory-mapped
files and copy-on-write pages are shared with it, never copied.

The protocol: this process sends the helpers a *plan*, one or more products at once (the
products that `cores.together` gathered: a layer's experts, or q and kv beside each other). It
writes each product's x (k, in) into the shared memory of every helper that is idle, with the
plan's tables beside them: one row a product (matrix key, expert, a stack of heads after it, in,
out, k, where x is, where y goes) and one row a *unit* of work (a product's rows a..b). Then it
puts one token a unit into a pipe that every process reads (the claims pipe) and sends each of
those helpers one small PLAN message. From then on every process, this one included, takes the
next token, runs that unit's rows and takes another, until the pipe is empty: a pipe hands each
token to exactly one reader, so the units are shared out as each process is free. A helper
writes a unit's rows into its y's in the shared memory and marks the unit finished there; this
process copies the finished units' rows into place.

This process never waits for a helper that has not started: a helper that the kernel has not
scheduled (another program has its core) takes no token, and this process takes them all. It
waits for a unit a helper took only as long as that unit should take (GRACE times this
process's own pace), then runs the unit itself: a helper descheduled in the middle of a unit
loses it, and its late rows are never read. A helper still inside an earlier plan is left out
of the next one (its memory is not written while it may read it); a token of a later plan that
it reads, it puts back. Whoever runs a unit, its rows are the same bits (`cut`).
A matrix is known to a helper by its key (`register`), given before the fork by the executor
(executor.py) to every weight of the model it runs.
"""

from __future__ import annotations

import contextlib
import functools
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
from ds2cli.parallel.absorbed import AbsorbedQuery

_matrices: list[weakref.ref] = []    # a matrix's key -> the matrix, in this and every helper
_helpers_failed = False               # a helper died or could not start: threads from then on
PLAN = struct.Struct("<qqq")          # seq, products and units in the plan (the tables' first rows)
ENTRY = 8                             # a product's row: key, expert (-1: none), then (-1: none; a
                                      # stack of heads over the product's output, absorbed.AbsorbedQuery),
                                      # in, out, k, x's offset and y's offset in the values (float32 units)
UNIT = 3                              # a unit's row: its product's row, rows a, b
TOKEN = struct.Struct("<ii")          # in the claims pipe: the plan's seq (mod 2**31), a unit
PLAN_PRODUCTS = 64                    # a plan holds at most this many products ...
PLAN_UNITS = 512                      # ... and units: a plan's tokens are one pipe write of at
                                      # most PIPE_BUF (4096) bytes, which Linux writes whole
HELPER_VALUES = 1 << 23               # float32 values of shared memory a helper: the x's, then the
                                      # y's (32 MB reserved, touched only as far as a plan reaches)
HELPER_SPIN = 0.01                    # seconds a process polls for its next message (receive)
HELPER_TIMEOUT = 60.0                 # a helper inside one plan this long is taken as stuck
STATUS = 4                            # a helper's status row: the last plan it started, the last it
                                      # ended, the last in which a unit failed (its rows: this process's),
                                      # 1 while it is parked (`park`)
GRACE = 2.0                           # a unit a helper took is waited for this many times as long as
                                      # this process takes for as many weights, then run here
# A plan's units: guided self-scheduling, each unit 1/(UNIT_SPLIT x the cores) of the
# plan's work still to cut (the cores the process may use, `--threads` or its CPUs, not those
# free at the moment), so the first are large (few tokens to take) and the last small (the
# processes finish within a small unit of each other), never below UNIT_MIN_VALUES weights (two
# decode row blocks, 2 MB widened) and never across two products (docs/performance.md, "Why the
# constants are what they are"). The cut depends on the shapes and that bound alone, never on
# how many processes take part nor on the timing, so whoever takes a unit, its rows come out the same
# bits: a one-token unit's rows are each one dot product with the token, which OpenBLAS's gemv
# gives as the same bits wherever the cut falls (tests/parallel checks every cut of q8, q4,
# bf16, q8b); a unit of several tokens is GEMM tiles, the same for the same rows.
UNIT_SPLIT = 1
UNIT_MIN_VALUES = 1 << 19


def helpers_wanted() -> bool:
    """Whether few-token passes split their products across helper processes: on Linux (macOS's
    system libraries, Accelerate among them, are not safe to use in a forked child, which is why
    Python's multiprocessing no longer forks there), with more than one core; DS2_HELPERS=0
    turns them off, and threads are used instead."""
    return (sys.platform.startswith("linux") and cores.workers().n > 1 and not _helpers_failed
            and os.environ.get("DS2_HELPERS", "1") != "0")


TABLE_BYTES = 8 * (ENTRY * PLAN_PRODUCTS + UNIT * PLAN_UNITS + PLAN_UNITS + STATUS)


def shared_views(shared: mmap.mmap) -> tuple[np.ndarray, ...]:
    """A helper's shared memory as its plan's tables, int64: products (PLAN_PRODUCTS, ENTRY),
    units (PLAN_UNITS, UNIT), the plan in which it last finished each unit (PLAN_UNITS,), its
    status (STATUS,); then its float32 values."""
    tables = np.frombuffer(shared, np.int64, TABLE_BYTES // 8)
    products, units = ENTRY * PLAN_PRODUCTS, UNIT * PLAN_UNITS
    finished = products + units
    return (tables[:products].reshape(PLAN_PRODUCTS, ENTRY), tables[products:finished].reshape(PLAN_UNITS, UNIT),
            tables[finished:finished + PLAN_UNITS], tables[finished + PLAN_UNITS:],
            np.frombuffer(shared, np.float32, HELPER_VALUES, offset=TABLE_BYTES))


class Helper:
    """One forked helper, from this process's side: its pid, its pipe and its memory."""

    def __init__(self, pid: int, jobs: int, shared: mmap.mmap):
        self.pid, self.jobs, self.shared = pid, jobs, shared
        self.table, self.units, self.finished, self.status, self.values = shared_views(shared)
        self.closed = False
        self.sent = 0                # the last plan whose PLAN message it was sent ...
        self.sent_at = 0.0           # ... and when
        self.clean = 0               # the last plan of its that ended with every unit run by
                                     # whoever took it (none taken back)

    @property
    def idle(self) -> bool:
        """Its memory may be written: it has ended every plan it was sent, or it started the last
        one (its PLAN message is read, none waits in the pipe) and that one ended clean, so every
        unit it took is finished and all it may still do of that plan is find the pipe empty (or
        a later plan's token, which it puts back)."""
        return int(self.status[1]) == self.sent or (self.clean == self.sent and int(self.status[0]) == self.sent)


class Helpers:
    """n helper processes, forked now; they know every matrix whose key is below `horizon`."""

    def __init__(self, n: int):
        self.horizon = len(_matrices)
        self.seq = 0                 # plans sent
        self.settled = 0             # the last plan whose every unit was run
        self.products = 0            # products the plans held
        self.units = 0               # units the plans held
        self.helper_units = 0        # units the helpers ran (the rest: this process)
        self.taken_back = 0          # units a helper took but this process ran, the helper late
        self.pace = 1e-9             # seconds a weight x token takes this process (its own units)
        self.lock = threading.Lock()
        self.procs: list[Helper] = []
        self.claims, self.claims_w = os.pipe()    # every process reads it (and may put a token back)
        os.set_blocking(self.claims, False)
        self.fds = [self.claims, self.claims_w]
        try:
            for _ in range(n):
                self.procs.append(self.fork())
        except OSError:
            self.stop()
            raise
        weakref.finalize(self, stop_helpers, list(self.procs), self.fds)

    def wanted(self) -> bool:
        return helpers_wanted()

    def pids(self) -> list[int]:
        return [h.pid for h in self.procs]

    def fork(self) -> Helper:
        shared = mmap.mmap(-1, TABLE_BYTES + 4 * HELPER_VALUES)   # anonymous, shared across the fork
        jobs_r, jobs_w = os.pipe()
        parent = os.getpid()
        # Linux documents PR_SET_PDEATHSIG as sent when the forking *thread* ends, and only the
        # main thread's end is the process's end
        with_parent = threading.current_thread() is threading.main_thread()
        with warnings.catch_warnings():     # Python 3.12+ warns of forking with threads alive:
            warnings.simplefilter("ignore", DeprecationWarning)   # the child takes no lock of theirs
            pid = os.fork()
        if pid == 0:
            try:
                for fd in (jobs_w, *(h.jobs for h in self.procs)):
                    os.close(fd)
                helper_main(parent, with_parent, jobs_r, self.claims, self.claims_w, shared)
            finally:
                os._exit(0)
        os.close(jobs_r)
        return Helper(pid, jobs_w, shared)

    def stop(self) -> None:
        stop_helpers(self.procs, self.fds)
        self.procs = []

    def run(self, products: list) -> list:
        """Each product's rows cut into units (`cut`) that this process and the idle helpers
        take as each is free, in as few plans as the shared memory allows (one for a decode
        step's); returns the products left to the caller: those the helpers do not know, or all
        of them if the helpers are busy with another thread's pass or one of them is gone (the
        caller runs them on threads, writing again whatever this process already wrote into
        their y). A product (cores.Rows) has m (with .key and .span), x (in,) or (k, in), y
        (out,) or (k, out) and its alignment; its spans are set to the units its rows were
        computed in. Units run with BLAS at one thread here as in a helper: the same bits."""
        global _helpers_failed
        known = [p for p in products if getattr(p.m, "key", None) is not None and p.kernel is None
                 and p.m.key[0] < self.horizon and then(p) < self.horizon and ends(p, 0) <= HELPER_VALUES]
        if not known or not self.lock.acquire(blocking=False):
            return products
        try:
            with contextlib.nullcontext() if cores.workers().held else cores.blas_threads(1):
                for plan in plans(known):
                    self.run_plan(plan)
            if len(known) == len(products):
                return []
            ran = {id(p) for p in known}
            return [p for p in products if id(p) not in ran]
        except OSError:      # a helper is gone (killed, out of memory) or stuck: carry on without
            _helpers_failed = True                                                # them
            return products
        finally:
            self.lock.release()
            if _helpers_failed:
                stop_helpers_now()

    def run_plan(self, plan: list) -> None:
        """One plan: its units are put up for the taking, this process takes its part, then it
        runs whatever the helpers are late with and copies their rows."""
        units = cut(plan)
        for p in plan:
            p.spans = []
        for j, a, b in units:
            plan[j].spans.append((a, b))
        ready = self.send(plan, units, cores.workers().using - 1)
        if not ready:                    # no helper takes part: the same units, here, in order
            for j, a, b in units:
                plan[j].span(a, b)
            self.settled = self.seq
            return
        sizes = np.array([(b - a) * plan[j].row_values for j, a, b in units])
        mine = np.zeros(len(units), bool)
        self.take(plan, units, sizes, mine)
        self.finish(plan, units, sizes, mine, ready)

    def send(self, plan: list, units: list, most: int) -> list[Helper]:
        """The plan's x's and tables into the shared memory of at most `most` idle helpers, a
        token a unit into the claims pipe, then the PLAN message to each of them; returns them."""
        self.check()
        self.seq += 1
        self.products += len(plan)
        self.units += len(units)
        ready = [h for h in self.procs if h.idle][:max(0, most)]
        if not ready:
            return ready
        for h in ready:
            at = 0
            for row, p in enumerate(plan):
                inp, out = p.x.shape[-1], p.y.shape[-1]
                k = p.x.size // inp
                h.values[at:at + inp * k] = p.x.reshape(-1)
                h.table[row] = (*p.m.key, then(p), inp, out, k, at, at + inp * k)
                at = ends(p, at)
            h.units[:len(units)] = units
        tag = self.seq % 2 ** 31
        os.write(self.claims_w, b"".join(TOKEN.pack(tag, u) for u in range(len(units))))
        now = time.perf_counter()
        for h in ready:
            h.status[3] = 0
            os.write(h.jobs, PLAN.pack(self.seq, len(plan), len(units)))
            h.sent, h.sent_at = self.seq, now
        return ready

    def park(self) -> None:
        """The helpers sleep until their next plan instead of spinning for it: this process is
        about to run work of its own on every core (threads), which a spinning helper would
        slow. The next plan sent to a helper unparks it."""
        for h in self.procs:
            h.status[3] = 1

    def check(self) -> None:
        """OSError if a helper still inside a plan has exited, or has been inside it longer than
        HELPER_TIMEOUT (stopped, or stuck)."""
        now = time.perf_counter()
        for h in self.procs:
            if h.idle:
                continue
            with contextlib.suppress(ChildProcessError):
                if os.waitid(os.P_PID, h.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    raise OSError("a helper process exited")
            if now - h.sent_at > HELPER_TIMEOUT:
                raise OSError(f"a helper process was inside one plan for {HELPER_TIMEOUT:.0f} s")

    def claim(self) -> int | None:
        """The next unit of this plan from the claims pipe (an earlier plan's tokens, left by a
        Ctrl-C or put back late, are dropped), or None once it is empty."""
        tag = self.seq % 2 ** 31
        while True:
            try:
                token = os.read(self.claims, TOKEN.size)
            except BlockingIOError:
                return None
            seq, unit = TOKEN.unpack(token)
            if seq == tag:
                return unit

    def take(self, plan: list, units: list, sizes: np.ndarray, mine: np.ndarray) -> None:
        """This process's part of the plan: units from the pipe until none is left, timed."""
        start, ran = time.perf_counter(), 0
        while (u := self.claim()) is not None:
            self.run_unit(plan, units, u, mine)
            ran += sizes[u]
        if ran:
            self.pace = (time.perf_counter() - start) / ran

    def run_unit(self, plan: list, units: list, u: int, mine: np.ndarray) -> None:
        j, a, b = units[u]
        plan[j].span(a, b)
        mine[u] = True

    def finish(self, plan: list, units: list, sizes: np.ndarray, mine: np.ndarray, ready: list[Helper]) -> None:
        """Wait for the units the helpers took, each at most GRACE times as long as this
        process would take for it, then run the rest here; copy the helpers' rows into place."""
        n, seq = len(units), self.seq
        done = mine.copy()
        deadline, clean = None, False
        while True:
            for h in ready:
                done |= h.finished[:n] == seq
            if done.all():
                clean = True             # every unit finished by whoever took it
                break
            if (u := self.claim()) is not None:        # a token put back by a helper
                self.run_unit(plan, units, u, mine)
                done[u] = True
                continue
            now = time.perf_counter()
            if deadline is None:
                deadline = now + GRACE * self.pace * sizes[~done].max()
            if now > deadline or any(h.status[2] == seq for h in ready):
                for u in np.flatnonzero(~done).tolist():
                    self.run_unit(plan, units, u, mine)
                    self.taken_back += 1
                break
            os.sched_yield()
        for h in ready:
            h.clean = seq if clean else h.clean
            got = np.flatnonzero((h.finished[:n] == seq) & ~mine).tolist()
            fence()                                      # the marks read before the rows
            for u in got:
                j, a, b = units[u]
                p = plan[j]
                out, k, y_at = p.y.shape[-1], p.x.size // p.x.shape[-1], int(h.table[j, 7])
                p.y.reshape(k, out)[:, a:b] = h.values[y_at:y_at + k * out].reshape(k, out)[:, a:b]
                mine[u] = True                           # (counted once)
                self.helper_units += 1
        self.settled = seq


def cut(plan: list, processes: int = 0) -> tuple[tuple[int, int, int], ...]:
    """A plan's units, (product's row in the plan, a, b), in order; each product's rows a..b
    start at multiples of its alignment. Guided (see UNIT_SPLIT): the plan's weights x tokens
    still to cut divided by UNIT_SPLIT x the process's cores (`processes`, default the pool's
    bound, cores.Workers.n), and at least UNIT_MIN_VALUES weights (so
    a unit of several tokens is as many rows as a one-token one's: a GEMM of few rows is slow)
    and 2/PLAN_UNITS of the plan (so a plan never has more than PLAN_UNITS units: the floors
    give at most PLAN_UNITS / 2, each product's last partial unit one more, PLAN_PRODUCTS in
    all). The cut depends on the shapes and that bound alone, never on the timing nor on the processes taking
    part; a decode step's plans repeat their
    shapes every step, so each shape's cut is worked out once (20-30 us a plan of experts)."""
    return cut_shapes(tuple((p.rows, p.row_values, p.align, p.x.size // p.x.shape[-1]) for p in plan),
                      processes or cores.workers().n)


@functools.lru_cache(maxsize=1024)
def cut_shapes(shapes: tuple, processes: int) -> tuple[tuple[int, int, int], ...]:
    """cut, for the products' (rows, weights x tokens a row, alignment, tokens)."""
    left = sum(rows * values for rows, values, _, _ in shapes)
    floor = max(UNIT_MIN_VALUES, 2 * left // PLAN_UNITS)
    units = []
    for j, (rows, values, align, tokens) in enumerate(shapes):
        least = max(floor, UNIT_MIN_VALUES * tokens)
        a = 0
        while a < rows:
            want = max(least, left // (UNIT_SPLIT * processes))
            b = min(rows, a + max(align, want // values // align * align))
            units.append((j, a, b))
            left -= (b - a) * values
            a = b
    return tuple(units)                    # shared by every plan of these shapes: not to be changed


_fence = threading.Lock()
_fence.acquire()


def fence() -> None:
    """A memory barrier between a process's accesses to the shared memory before it and after it:
    a helper's rows are visible before its mark that they are finished, and the parent reads
    the marks before the rows. x86 keeps stores in order anyway; weaker machines (ARM) need the
    release and the acquire (a lock's) between them."""
    _fence.release()
    _fence.acquire()


def then(p) -> int:
    """The key of the stack of heads product p's matrix multiplies its output by, -1 if none."""
    return getattr(p.m, "then", -1)


def ends(p, at: int) -> int:
    """Where product p's x and y end in a helper's shared memory if they start at `at`."""
    return at + (p.x.shape[-1] + p.y.shape[-1]) * (p.x.size // p.x.shape[-1])


def plans(products: list) -> list[list]:
    """The products in order, as plans that each fit a helper's tables and shared memory."""
    out, at = [[]], 0
    for p in products:
        if out[-1] and (len(out[-1]) == PLAN_PRODUCTS or ends(p, at) > HELPER_VALUES):
            out.append([])
            at = 0
        out[-1].append(p)
        at = ends(p, at)
    return out


def receive(fd: int, size: int, timeout: float | None = None, parked=None) -> bytes | None:
    """The next message of `size` bytes from a non-blocking pipe, None once it is closed;
    TimeoutError after `timeout` seconds without one.

    Polls for HELPER_SPIN seconds before sleeping in select: a process that sleeps between a
    step's plans can be woken up a scheduler tick late, which costs more than the matvec it
    waits for, and a decode step sends the next plan well within the spin. It sleeps at once
    while `parked()` is true: the parent then runs work of its own on every core (a long
    cache's attention), and a spinning helper would take one of them. Messages are shorter than
    PIPE_BUF, so each is written, and read, whole."""
    start = time.perf_counter()
    sleep = None
    while True:
        try:
            return os.read(fd, size) or None
        except BlockingIOError:
            waited = time.perf_counter() - start
            if waited > HELPER_SPIN or (parked is not None and parked()):
                if sleep is None:
                    sleep = select.poll()
                    sleep.register(fd, select.POLLIN)
                if timeout is not None and waited > timeout:
                    raise TimeoutError(f"no message in {timeout:.0f} s") from None
                sleep.poll(None if timeout is None else 1000 * (timeout - waited) + 1)


def stop_helpers(procs: list[Helper], fds: list[int]) -> None:
    """Close the helpers' pipes and the claims pipe (`fds`, emptied), end the helpers and reap
    them. A helper holds nothing to clean up (it writes no file), and one that is stuck must not
    hold this process up: SIGKILL."""
    procs = [h for h in procs if not h.closed]
    for fd in fds:          # once only: a closed descriptor's number may be reused by then
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
    for h in procs:
        h.closed = True
        with contextlib.suppress(OSError):
            os.close(h.jobs)
        with contextlib.suppress(OSError):
            os.kill(h.pid, signal.SIGKILL)
    for h in procs:
        with contextlib.suppress(OSError):
            os.waitpid(h.pid, 0)


def helper_main(parent: int, with_parent: bool, jobs: int, claims: int, claims_w: int, shared: mmap.mmap) -> None:
    """A helper's life: take units of each plan it is sent until the job pipe closes (this
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
    global _fence
    _fence = threading.Lock()             # (held, whatever a thread of the parent did with its own)
    _fence.acquire()
    os.set_blocking(jobs, False)
    for c in cores.blas_controllers():
        c.set_num_threads(1)
    table, units, finished, status, values = shared_views(shared)
    while (message := receive(jobs, PLAN.size, parked=lambda: status[3] == 1)) is not None:
        seq, n, n_units = PLAN.unpack(message)
        status[0] = seq
        products, cuts, tag = table[:n].tolist(), units[:n_units].tolist(), seq % 2 ** 31
        matrices: dict[int, object] = {}
        try:
            while True:
                try:
                    token = os.read(claims, TOKEN.size)
                except BlockingIOError:
                    break                                                   # every unit is taken
                token_seq, u = TOKEN.unpack(token)
                if token_seq != tag:
                    if 0 < (token_seq - tag) % 2 ** 31 < 2 ** 30:   # a later plan's (this one was
                        os.write(claims_w, token)                    # over before this helper
                        break                                        # started): not its to run
                    continue                                         # an earlier one's (Ctrl-C)
                j, a, b = cuts[u]
                key, expert, heads, inp, out, k, x_at, y_at = products[j]
                if j not in matrices:
                    m = _matrices[key]()          # a low-bit weight (weights/formats) or linear.Heads
                    m = m[expert] if expert >= 0 else m
                    matrices[j] = AbsorbedQuery(m, _matrices[heads]()) if heads >= 0 else m
                matrices[j].span(values[x_at:x_at + inp * k].reshape(k, inp),
                                 values[y_at:y_at + out * k].reshape(k, out), a, b)
                fence()                             # its rows are seen before the mark
                finished[u] = seq
        except Exception:    # noqa: BLE001 - any failure (a matrix gone too): the parent runs the rows
            status[2] = seq
        status[1] = seq


def start_helpers(weights=()) -> None:
    """Fork the helper processes anew (the executor calls this once a low-bit model is loaded),
    `weights` registered first (those without a key): they then know every matrix registered,
    and the helpers of an earlier model, which would keep its memory alive in their copy of
    this process, are gone. Forking right after the load also means the copy holds no scratch
    buffers or caches of this process yet."""
    global _helpers_failed
    for w in weights:
        if hasattr(w, "span") and getattr(w, "key", None) is None:
            w.key = (register(w), -1)
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
