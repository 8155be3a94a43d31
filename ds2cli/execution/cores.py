"""The cores a pass runs on: the worker pool, BLAS thread control, and splitting work: the
implementation of the executor (executor.py) that the math is handed.

  split(n, tokens)         [0, n) as slices that the cores may run at once (independent heads)
  map(fn, items, cost)     [fn(item) for item in items], the items shared across the cores
  split_keys(S, tokens)    a long cache's positions [0, S) as one slice a core, for a few-token pass
  spread(fn, items)        [fn(item) for item in items], each item on a core of its own, now
  together()               a block of independent products, sent to the helper processes at once
Whether sharing pays is decided here: only while a low-bit forward pass holds BLAS at one thread
(`forward_pass`), and not in a pass of few tokens whose products the helper processes
(processes.py) already split; the costliest items go first, so the cores finish together. A
product's rows (linear.Rows, from its weight's `product`) are cut by `Workers.split`: between
the helper processes in a few-token pass, else between threads.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ds2cli.model.linear import FEW_TOKENS, Rows
from ds2cli.parallel.load import Load

# A pass of at most FEW_TOKENS tokens (a decode step, a verification pass, a short prompt) splits
# each low-bit product's rows across the cores, helper processes included; a longer pass shares
# whole items (experts, heads) across the cores instead.
__all__ = ["FEW_TOKENS", "Rows", "Workers", "workers", "forward_pass", "kernel_threads", "blas_threads",
           "together", "split_rows", "split", "split_keys", "spread", "map"]

# A few-token pass (a decode step) attends to a cache of at least this many positions a share of
# the keys a core: below it, handing the halves to a thread costs more than streaming them alone.
SHARED_KEYS = 2048


class Workers:
    """The cores a kernel splits its row blocks over: the calling thread plus a small pool."""

    def __init__(self, n: int | None = None):
        self.n = n or max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                 else (os.cpu_count() or 1), 8))
        self.using = self.n              # the cores this pass uses: n, or fewer while other programs
                                         # keep some busy (load.py, read as each forward pass starts)
        self.load = Load()
        self.blas_set = None             # BLAS threads blas_follow set (None: BLAS's own count,
        self.blas_own = None             # which this keeps to restore)
        self.pool = ThreadPoolExecutor(self.n - 1, thread_name_prefix="ds2-kernel") if self.n > 1 else None
        self.local = threading.local()   # .inside: this thread already runs one of several parts
        self.held = 0                    # > 0 while a low-bit forward pass holds BLAS (forward_pass)
        self.few = 0                     # > 0 while that pass has at most FEW_TOKENS tokens
        self.helpers = None              # the helper processes (parallel/processes.py) while they run
        self.helpers_on = False          # whether they take this pass's products (DS2_HELPERS and the
                                         # platform, read once as each forward pass starts)

    @property
    def inside(self) -> bool:
        """This thread already runs one of several parts (see part)."""
        return getattr(self.local, "inside", False)

    @property
    def parts(self) -> int:
        """How many parts to split work into here: one inside a part (which runs on its core
        alone, so more parts would only add calls), else one a core this pass uses."""
        return 1 if self.inside else min(self.n, self.using)

    def blas_follow(self) -> None:
        """BLAS's threads follow the cores this pass uses (a float32 pass's products are BLAS
        calls): set when that changes, BLAS's own count again once every core is free."""
        want = None if self.using >= self.n else self.using
        if want == self.blas_set:
            return
        if self.blas_own is None:
            self.blas_own = [c.num_threads for c in blas_controllers()]
        for c, own in zip(blas_controllers(), self.blas_own):
            c.set_num_threads(own if want is None else want)
        self.blas_set = want

    def run(self, fn, spans: list[tuple[int, int]]) -> None:
        """fn(start, stop) over each span, shared between this thread and the pool (`share`).

        While the spans run, BLAS is held to one thread: each span already has a core, and
        OpenBLAS's own threads would fight over the same cores (docs/performance.md, "Why the
        constants are what they are")."""
        if self.pool is None or len(spans) < 2 or self.inside:
            for span in spans:
                fn(*span)
            return
        if self.few and self.helpers_running():
            self.helpers.park()          # a few-token pass's own work on the cores: no helper spins
        with contextlib.nullcontext() if self.held else blas_threads(1):   # held: already one
            self.share(lambda k: fn(*spans[k]), len(spans), len(spans))

    def share(self, fn, count: int, lanes: int) -> None:
        """fn(k) for k in range(count), each k run once by whichever of this thread and up to
        lanes - 1 pool threads is free first. This thread waits only for the k's another thread
        has started: a pool thread that the kernel schedules late (another program has its
        core) finds every k taken and returns, so its work is never waited for. An exception
        stops the taking (Ctrl-C): this thread's own is raised at once, another thread's once
        the k's started are done."""
        lock = threading.Condition()
        state = {"next": 0, "running": 0, "error": None}

        def lane(here: bool = False) -> None:
            while True:
                with lock:
                    if state["next"] >= count or state["error"] is not None:
                        return
                    k = state["next"]
                    state["next"] += 1
                    state["running"] += 1
                try:
                    fn(k)
                except BaseException as e:   # noqa: BLE001 - the calling thread's own: raised now
                    with lock:
                        state["running"] -= 1
                        state["error"] = e if state["error"] is None else state["error"]
                        lock.notify_all()
                    if here:
                        raise
                    return
                with lock:
                    state["running"] -= 1
                    lock.notify_all()

        for _ in range(min(lanes, count) - 1):
            self.pool.submit(self.part, lane)
        self.part(lane, True)
        with lock:
            while state["running"]:
                lock.wait()
        if state["error"] is not None:
            raise state["error"]

    def split(self, product: Rows) -> None:
        """Compute a product's rows, a share a core: with the helper processes in a pass of few
        tokens (inside `together`, when the block ends, with the block's other products), else
        on threads, now."""
        product.spans = split_rows(product.rows, self.parts, product.align)
        if len(product.spans) > 1 and self.helpers_ready():
            batch = getattr(self.local, "batch", None)
            if batch is not None:
                batch.append(product)
                return
            self.run_products([product])
            return
        self.run(product.span, product.spans)

    def run_products(self, products: list[Rows]) -> None:
        """Products' spans over the helper processes at once; whatever they leave, on threads
        (all of them if the helpers were stopped meanwhile: a helper died, another model loaded)."""
        helpers = self.helpers
        for product in helpers.run(products) if helpers is not None and products else products:
            self.run(product.span, product.spans)

    def helpers_ready(self) -> bool:
        """This thread's products go to the helper processes: a few-token low-bit pass's, not
        from inside a part (which runs on its core alone)."""
        return bool(self.held and self.few and not self.inside and self.helpers_running())

    def part(self, fn, *args):
        """Run one of several parts: a kernel called inside it runs on this thread alone."""
        self.local.inside = True
        try:
            return fn(*args)
        finally:
            self.local.inside = False

    def helpers_running(self) -> bool:
        """Helper processes take the other cores' rows of a few-token pass's products (parallel/processes.py).
        Asked before every product: so it reads the flag `forward_pass` set, not the environment
        (1-2 us a call, some 30 calls a layer)."""
        return self.helpers is not None and self.helpers_on

    @property
    def lanes(self) -> int:
        """How many items `map` runs at once here: one a core this pass uses in a low-bit forward
        pass, else 1 (in a pass of few tokens with helper processes, each product is split
        across them instead)."""
        if self.pool is None or not self.held or self.inside or (self.few and self.helpers_running()):
            return 1
        return min(self.n, self.using)

    def map(self, fn, items) -> list:
        """[fn(item) for item in items], the items shared across the cores while a low-bit
        forward pass holds BLAS at one thread: each core takes the next item when it is free
        and runs it with kernels on that core alone (`share`). In order, on this thread,
        otherwise, and in a pass of few tokens that has helper processes, whose products are
        each split across the processes instead (a decode step's six experts are too small to
        share out whole)."""
        items = list(items)
        if self.lanes < 2 or len(items) < 2:
            return [fn(item) for item in items]
        out = [None] * len(items)

        def one(k: int) -> None:
            out[k] = fn(items[k])
        self.share(one, len(items), self.lanes)
        return out


_workers: Workers | None = None
_blas = None


def workers() -> Workers:
    global _workers
    if _workers is None:
        _workers = Workers()
    return _workers


def use_workers(pool: Workers) -> None:
    """Replace this process's cores (a forked helper runs on its one core alone)."""
    global _workers
    _workers = pool


@contextlib.contextmanager
def forward_pass(low_bit: bool, tokens: int):
    """What a forward pass of `tokens` tokens runs in: the cores other programs leave free
    counted first (load.py), float32's BLAS threads held to them. Over low-bit weights: BLAS held at one
    thread throughout, and a pass of at most FEW_TOKENS tokens marked as one whose products the
    helper processes share. OpenBLAS's idle threads keep spinning for a while after each call,
    and a spinning BLAS thread takes a core from the low-bit kernels' own threads (the figures:
    docs/performance.md, "Why the constants are what they are")."""
    pool = workers()
    if pool.n < 2:
        yield
        return
    pool.using = pool.load.free(pool.n, pool.helpers.pids() if pool.helpers is not None else ())
    if not low_bit:             # float32 products: BLAS's own threads, as many as the cores free
        pool.blas_follow()
        yield
        return
    few = tokens <= FEW_TOKENS
    pool.helpers_on = pool.helpers is not None and pool.helpers.wanted()
    with blas_threads(1):
        pool.held += 1
        pool.few += few
        try:
            yield
        finally:
            pool.held -= 1
            pool.few -= few


@contextlib.contextmanager
def kernel_threads(n: int):
    """Use at most n cores in the low-bit kernels for the block (the CLI's --threads)."""
    pool = workers()
    before = pool.n
    pool.n = max(1, min(n, before))
    try:
        yield
    finally:
        pool.n = before


@contextlib.contextmanager
def blas_threads(n: int):
    """Set the BLAS library's thread count for the block, and restore it after."""
    controllers = blas_controllers()
    before = [c.num_threads for c in controllers]
    for c in controllers:
        c.set_num_threads(n)
    try:
        yield
    finally:
        for c, k in zip(controllers, before):
            c.set_num_threads(k)


def blas_controllers() -> list:
    global _blas
    if _blas is None:
        from threadpoolctl import ThreadpoolController
        _blas = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
    return _blas


@contextlib.contextmanager
def together():
    """Products started in the block are independent of each other: in a pass of few tokens
    whose products the helper processes share, their row spans are gathered (Workers.split) and
    sent as one plan when the block ends, one message and one wait for all of them instead of
    one each. Their outputs are complete once the block has ended, not before."""
    pool = workers()
    if getattr(pool.local, "batch", None) is not None or not pool.helpers_ready():
        yield
        return
    pool.local.batch = batch = []
    try:
        yield
    finally:
        pool.local.batch = None
    pool.run_products(batch)


def split_rows(rows: int, parts: int, g: int) -> list[tuple[int, int]]:
    """`parts` spans of whole groups covering [0, rows)."""
    groups = -(-rows // g)
    bounds = [min(rows, g * (groups * k // parts)) for k in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def split(n: int, tokens: int) -> list[slice]:
    """[0, n) as consecutive slices, one for each core that may run them at once: several in a
    low-bit prefill (Workers.lanes), else the whole (a decode step's attention is too small to be
    worth splitting, and a few-token pass splits its products instead)."""
    return [slice(a, b) for a, b in split_rows(n, workers().lanes if tokens > 1 else 1, 1)]


def split_keys(S: int, tokens: int) -> list[slice]:
    """[0, S) cached positions as consecutive slices for `spread`: one a core when a pass of few
    tokens attends to a long cache (its products are split across the cores already, and its
    attention, a stream over the whole latent, would otherwise run on one), else the whole."""
    parts = workers().parts if tokens <= FEW_TOKENS and S >= SHARED_KEYS and not workers().inside else 1
    return [slice(a, b) for a, b in split_rows(S, parts, 1)]


def spread(fn, items) -> list:
    """[fn(item) for item in items], the first on this thread and each other on a core of its
    own, BLAS at one thread meanwhile (Workers.run): for items that split one piece of work
    evenly, such as split_keys' slices."""
    items = list(items)
    out = [None] * len(items)

    def one(k: int, _stop: int) -> None:
        out[k] = fn(items[k])
    workers().run(one, [(k, k + 1) for k in range(len(items))])
    return out


def map(fn, items, cost=None) -> list:  # noqa: A001 - the execution interface's own map
    """[fn(item) for item in items], in that order, the items shared across the cores where that
    pays (Workers.map); with `cost` (one number per item), the costliest are started first."""
    items = list(items)
    if cost is None:
        return workers().map(fn, items)
    first = sorted(range(len(items)), key=lambda j: -cost[j])
    done = dict(zip(first, workers().map(lambda j: fn(items[j]), first)))
    return [done[j] for j in range(len(items))]
