"""The helper processes' protocol, as data: a plan's tables in each helper's shared memory, the
cut of a plan's products into units, the registry that names matrices to a helper, and the
pipe messages. helpers.py runs it; docs there.
"""

from __future__ import annotations

import mmap
import os
import select
import struct
import threading
import time
import weakref

import numpy as np

PLAN = struct.Struct("<qqq")          # seq, products and units in the plan (the tables' first rows)
ENTRY = 7                             # a product's row: key, expert (-1: none), in, out, k, x's
                                      # offset and y's offset in the values (float32 units)
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
# A plan of fewer weights x tokens than this runs here, each product whole: sending it, the
# helper's claim and the copy back cost 50-70 us (bench/plan_cost.py), what a unit of
# UNIT_MIN_VALUES takes at the q8 rate, so half of such a plan handed on saves nothing (a
# small model's plans: ds2-tiny's 8-bit decode on two quiet cores was 0.81x of one core's,
# bench/busy.py --busy 0). V2-Lite's smallest plans, one layer's W_UK or W_UV (16 heads of
# 128 x 512), are this size and still shared. A one-token product's rows are the same bits
# whole or cut (see above).
PLAN_MIN_VALUES = 2 * UNIT_MIN_VALUES


class Registry:
    """The matrices helper processes can multiply by, each known by a key: a helper forked later
    finds the same matrix under it (its copy of this object). A stacked weight's expert view is
    known by its stack's key and the expert (the view's `origin`). Weak references: a matrix
    dropped is not kept alive here."""

    def __init__(self):
        self.matrices: list[weakref.ref] = []
        self.keys: dict[int, int] = {}            # id(matrix) -> key

    def __len__(self) -> int:
        return len(self.matrices)

    def add(self, m) -> None:
        if self.key_of(m) is None:
            self.keys[id(m)] = len(self.matrices)
            self.matrices.append(weakref.ref(m))

    def key_of(self, m) -> tuple[int, int] | None:
        """(key, expert or -1) of a registered matrix or an expert view of one; else None."""
        k = self.keys.get(id(m))
        if k is not None and self.matrices[k]() is m:
            return k, -1
        origin = getattr(m, "origin", None)       # (stack, e): an expert's view of a stack
        if origin is not None:
            k = self.key_of(origin[0])
            if k is not None and k[1] == -1:
                return k[0], origin[1]
        return None

    def matrix(self, key: int, expert: int):
        m = self.matrices[key]()                  # a low-bit weight (weights/formats) or linear.Heads
        return m[expert] if expert >= 0 else m


class Fence:
    """A memory barrier between a process's accesses to the shared memory before it and after it:
    a helper's rows are visible before its mark that they are finished, and the parent reads
    the marks before the rows. x86 keeps stores in order anyway; weaker machines (ARM) need the
    release and the acquire (a lock's) between them. Each process makes its own."""

    def __init__(self):
        self.lock = threading.Lock()
        self.lock.acquire()

    def __call__(self) -> None:
        self.lock.release()
        self.lock.acquire()


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


def shapes_of(plan: list) -> tuple:
    """What a plan's cut depends on: each product's (rows, weights x tokens a row, alignment, tokens)."""
    return tuple((p.rows, p.row_values, p.align, p.x.size // p.x.shape[-1]) for p in plan)


def cut(plan: list, processes: int, min_values: int = UNIT_MIN_VALUES) -> tuple[tuple[int, int, int], ...]:
    """A plan's units, (product's row in the plan, a, b), in order; each product's rows a..b
    start at multiples of its alignment. Guided (see UNIT_SPLIT): the plan's weights x tokens
    still to cut divided by UNIT_SPLIT x the process's cores (`processes`: the pool's
    bound, cores.Workers.n), and at least UNIT_MIN_VALUES weights (so
    a unit of several tokens is as many rows as a one-token one's: a GEMM of few rows is slow)
    and 2/PLAN_UNITS of the plan (so a plan never has more than PLAN_UNITS units: the floors
    give at most PLAN_UNITS / 2, each product's last partial unit one more, PLAN_PRODUCTS in
    all). The cut depends on the shapes and that bound alone, never on the timing nor on the processes taking
    part (a decode step's plans repeat their shapes every step: Helpers keeps each shape's
    cut, 20-30 us a plan of experts)."""
    return cut_shapes(shapes_of(plan), processes, min_values)


def cut_shapes(shapes: tuple, processes: int, min_values: int = UNIT_MIN_VALUES) -> tuple[tuple[int, int, int], ...]:
    """cut, for the products' (rows, weights x tokens a row, alignment, tokens)."""
    left = sum(rows * values for rows, values, _, _ in shapes)
    floor = max(min_values, 2 * left // PLAN_UNITS)
    units = []
    for j, (rows, values, align, tokens) in enumerate(shapes):
        least = max(floor, min_values * tokens)
        a = 0
        while a < rows:
            want = max(least, left // (UNIT_SPLIT * processes))
            b = min(rows, a + max(align, want // values // align * align))
            units.append((j, a, b))
            left -= (b - a) * values
            a = b
    return tuple(units)                    # shared by every plan of these shapes: not to be changed


def ends(p, at: int) -> int:
    """Where product p's x and y end in a helper's shared memory if they start at `at`."""
    return at + (p.x.shape[-1] + p.y.shape[-1]) * (p.x.size // p.x.shape[-1])


def plans(keyed: list) -> list[list]:
    """The products [(product, key)] in order, as plans that each fit a helper's tables and
    shared memory."""
    out, at = [[]], 0
    for item in keyed:
        p = item[0]
        if out[-1] and (len(out[-1]) == PLAN_PRODUCTS or ends(p, at) > HELPER_VALUES):
            out.append([])
            at = 0
        out[-1].append(item)
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

