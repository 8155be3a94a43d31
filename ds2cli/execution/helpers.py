"""Helper processes: the other cores of a decode step (and of any pass of few tokens).

Two threads that both call NumPy in short calls spend much of their time handing the GIL to
each other: the q8 decode kernel scales far better over processes than over threads
(docs/performance.md, "Why the constants are what they are"). So a one-token step, or a pass of a few tokens (cores.FEW_TOKENS),
hands the other cores' rows of each product to helper processes instead. A helper is forked from
this process once the weights exist, so it sees every weight at the same address: memory-mapped
files and copy-on-write pages are shared with it, never copied.

The protocol: this process sends the helpers a *plan*, one or more products at once (the
products that `Workers.together` gathered: a layer's experts, or q and kv beside each other). It
writes each product's x (k, in) into the shared memory of every helper that is idle, with the
plan's tables beside them: one row a product (matrix key, expert, in,
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
A matrix is known to a helper by its key in the machine's Registry, where the compute part
(compute.py) enters every weight of the model before the fork.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import signal
import threading
import time
import warnings
import weakref

import numpy as np

from ds2cli.execution.plans import (GRACE, HELPER_TIMEOUT, HELPER_VALUES, PLAN, PLAN_MIN_VALUES, TABLE_BYTES, TOKEN,
                                    Fence, Registry, UNIT_MIN_VALUES, cut_shapes, ends, plans, receive, shapes_of,
                                    shared_views)

CUTS = 1024           # plan shapes whose cut a Helpers object keeps (a decode step repeats ~10)


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
    """n helper processes, forked now; they know every matrix of `registry` whose key is below
    `horizon`. `workers`: the cores of the process forking them (cores.Workers)."""

    def __init__(self, n: int, registry: Registry, workers):
        self.registry, self.workers = registry, workers
        self.horizon = len(registry)
        self.failed = False          # a helper died or got stuck: the machine stops them all
        self.fence = Fence()
        self.timeout = HELPER_TIMEOUT     # a helper inside one plan this long is taken as stuck
        self.cuts: dict[tuple, tuple] = {}    # plan shapes -> their cut (shared: never changed)
        self.unit_min_values = UNIT_MIN_VALUES   # the smallest unit (plans.cut)
        self.plan_min_values = PLAN_MIN_VALUES   # a smaller plan runs here (plans.PLAN_MIN_VALUES)
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
                helper_main(parent, with_parent, jobs_r, self.claims, self.claims_w, shared, self.registry,
                            self.workers.blas)
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
        their y). A product (linear.Rows) has m (a matrix of the registry, with .span), x (in,)
        or (k, in), y (out,) or (k, out) and its alignment; its spans are set to the units its
        rows were computed in. Units run with BLAS at one thread here as in a helper: the same
        bits. A helper gone (killed, out of memory) or stuck sets `failed`: the caller carries
        on without them."""
        keys = [self.registry.key_of(p.m) if p.kernel is None else None for p in products]
        known = [(p, k) for p, k in zip(products, keys)
                 if k is not None and k[0] < self.horizon and ends(p, 0) <= HELPER_VALUES]
        if self.failed or not known or not self.lock.acquire(blocking=False):
            return products
        try:
            with contextlib.nullcontext() if self.workers.held else self.workers.blas.threads(1):
                for plan in plans(known):
                    self.run_plan(plan)
            if len(known) == len(products):
                return []
            ran = {id(p) for p, _ in known}
            return [p for p in products if id(p) not in ran]
        except OSError:
            self.failed = True
            return products
        finally:
            self.lock.release()

    def run_plan(self, keyed: list) -> None:
        """One plan, [(product, its key)]: its units are put up for the taking, this process
        takes its part, then it runs whatever the helpers are late with and copies their rows."""
        plan, keys = [p for p, _ in keyed], [k for _, k in keyed]
        units = self.cut(plan)
        for p in plan:
            p.spans = []
        for j, a, b in units:
            plan[j].spans.append((a, b))
        if sum((b - a) * plan[j].row_values for j, a, b in units) < self.plan_min_values:
            for p in plan:
                p.whole()
            return
        ready = self.send(plan, keys, units, self.workers.using - 1)
        if not ready:                    # no helper takes part: the same units, here, in order
            for j, a, b in units:
                plan[j].span(a, b)
            self.settled = self.seq
            return
        sizes = np.array([(b - a) * plan[j].row_values for j, a, b in units])
        mine = np.zeros(len(units), bool)
        self.take(plan, units, sizes, mine)
        self.finish(plan, units, sizes, mine, ready)

    def cut(self, plan: list) -> tuple:
        """plans.cut, each plan shape's cut worked out once (at most CUTS shapes kept)."""
        shapes = shapes_of(plan)
        units = self.cuts.get(shapes)
        if units is None:
            if len(self.cuts) >= CUTS:
                self.cuts.clear()
            units = self.cuts[shapes] = cut_shapes(shapes, self.workers.n, self.unit_min_values)
        return units

    def send(self, plan: list, keys: list, units: list, most: int) -> list[Helper]:
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
                h.table[row] = (*keys[row], inp, out, k, at, at + inp * k)
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
        `timeout` (stopped, or stuck)."""
        now = time.perf_counter()
        for h in self.procs:
            if h.idle:
                continue
            with contextlib.suppress(ChildProcessError):
                if os.waitid(os.P_PID, h.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    raise OSError("a helper process exited")
            if now - h.sent_at > self.timeout:
                raise OSError(f"a helper process was inside one plan for {self.timeout:.0f} s")

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
            self.fence()                                 # the marks read before the rows
            for u in got:
                j, a, b = units[u]
                p = plan[j]
                out, k, y_at = p.y.shape[-1], p.x.size // p.x.shape[-1], int(h.table[j, 6])
                p.y.reshape(k, out)[:, a:b] = h.values[y_at:y_at + k * out].reshape(k, out)[:, a:b]
                mine[u] = True                           # (counted once)
                self.helper_units += 1
        self.settled = seq


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


def helper_main(parent: int, with_parent: bool, jobs: int, claims: int, claims_w: int, shared: mmap.mmap,
                registry: Registry, blas) -> None:
    """A helper's life: take units of each plan it is sent until the job pipe closes (this
    process's parent exited or stopped it). Ctrl-C is the parent's to handle; the helper dies
    with the parent. `registry`: its copy of the parent's, `blas`: its BLAS (cores.Blas)."""
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
    fence = Fence()             # its own (held, whatever a thread of the parent did with its own)
    os.set_blocking(jobs, False)
    for c in blas.controllers():
        c.set_num_threads(1)
    table, units, finished, status, values = shared_views(shared)
    while (message := receive(jobs, PLAN.size, parked=lambda: status[3] == 1)) is not None:
        seq, n, n_units = PLAN.unpack(message)
        status[0] = seq
        try:
            take_units(table[:n].tolist(), units[:n_units].tolist(), seq, claims, claims_w, registry,
                       values, finished, fence)
        except Exception:    # noqa: BLE001 - any failure (a matrix gone too): the parent runs the rows
            status[2] = seq
        status[1] = seq


def take_units(products: list, cuts: list, seq: int, claims: int, claims_w: int, registry: Registry,
               values: np.ndarray, finished: np.ndarray, fence: Fence) -> None:
    """A helper's part of plan `seq`: units from the claims pipe until it is empty, each unit's
    rows written into its y in the shared memory, then marked finished."""
    tag = seq % 2 ** 31
    matrices: dict[int, object] = {}
    while True:
        try:
            token = os.read(claims, TOKEN.size)
        except BlockingIOError:
            return                                                      # every unit is taken
        token_seq, u = TOKEN.unpack(token)
        if token_seq != tag:
            if 0 < (token_seq - tag) % 2 ** 31 < 2 ** 30:   # a later plan's (this one was over
                os.write(claims_w, token)                    # before this helper started): not
                return                                       # its to run
            continue                                         # an earlier one's (Ctrl-C)
        j, a, b = cuts[u]
        key, expert, inp, out, k, x_at, y_at = products[j]
        if j not in matrices:
            matrices[j] = registry.matrix(key, expert)
        matrices[j].span(values[x_at:x_at + inp * k].reshape(k, inp),
                         values[y_at:y_at + out * k].reshape(k, out), a, b)
        fence()                                     # its rows are seen before the mark
        finished[u] = seq


def private_bytes(pids) -> int:
    """Resident memory of the processes `pids` (helpers) that their parent does not also map:
    their scratch, the pages of its heap they wrote since the fork, and the weight pages only
    they have read (a decode step reads each matrix's rows split between the processes). Added
    to the parent's RSS it counts every resident page once. Linux only (0 elsewhere)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as f:
            total += sum(int(line.split()[1]) * 1024 for line in f
                         if line.startswith(("Private_Clean:", "Private_Dirty:")))
    return total
