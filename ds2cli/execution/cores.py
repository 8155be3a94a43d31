"""The cores a pass runs on: a pool of threads, BLAS thread control, and splitting work.

  Workers.split(product)      a product's rows (linear.Rows) cut between the cores: the helper
                              processes in a few-token pass, else threads
  Workers.map(fn, items)      [fn(item) for item in items], the items shared across the cores
  Workers.heads(n, tokens)    [0, n) as slices the cores may run at once (independent heads)
  Workers.key_slices(S, T)    a long cache's positions [0, S) as one slice a core, few tokens
  Workers.spread(fn, items)   [fn(item) for item in items], each item on a core of its own, now
  Workers.together()          a block of independent products, sent to the helpers at once
  Workers.forward_pass(...)   what a pass runs in: the free cores counted, BLAS held
Whether sharing pays is decided here: only while a low-bit forward pass holds BLAS at one thread
(`forward_pass`), and not in a pass of few tokens whose products the helper processes
(helpers.py) already split; the costliest items go first, so the cores finish together. A
Workers object is made by the machine (machine.py) and lives as long as it: nothing here is
process-wide.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ds2cli.model.linear import FEW_TOKENS, Rows
from ds2cli.execution.load import Load

# A product of fewer weights x tokens than one of the helpers' units runs whole where it is asked:
# whoever took it would take it as one unit, and handing it on costs more than it does.
SPLIT_MIN_VALUES = 1 << 19     # plans.UNIT_MIN_VALUES (plans sits above this module)

# A few-token pass (a decode step) attends to a cache of at least this many positions a share of
# the keys a core: below it, handing the halves to a thread costs more than streaming them alone.
SHARED_KEYS = 2048


class Blas:
    """The BLAS library's thread count, set and restored (threadpoolctl, imported when first
    used: it costs 30 ms)."""

    def __init__(self):
        self._controllers: list | None = None
        self.own: list[int] | None = None      # BLAS's own counts, kept to restore by `follow`
        self.set_to: int | None = None         # the count `follow` set (None: BLAS's own)

    def controllers(self) -> list:
        if self._controllers is None:
            from threadpoolctl import ThreadpoolController
            self._controllers = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
        return self._controllers

    @contextlib.contextmanager
    def threads(self, n: int):
        """BLAS at n threads for the block, restored after."""
        controllers = self.controllers()
        before = [c.num_threads for c in controllers]
        for c in controllers:
            c.set_num_threads(n)
        try:
            yield
        finally:
            for c, k in zip(controllers, before):
                c.set_num_threads(k)

    def follow(self, want: int | None) -> None:
        """BLAS's threads at `want` (None: its own count again), set only when that changes."""
        if want == self.set_to:
            return
        if self.own is None:
            self.own = [c.num_threads for c in self.controllers()]
        for c, own in zip(self.controllers(), self.own):
            c.set_num_threads(own if want is None else want)
        self.set_to = want


class Workers:
    """The cores a kernel splits its row blocks over: the calling thread plus a small pool."""

    def __init__(self, n: int | None = None, load: Load | None = None, blas: Blas | None = None):
        self.n = n or allowed_cores()
        self.shared_keys = SHARED_KEYS   # a few-token pass splits a cache of this many keys or more
        self.split_min_values = SPLIT_MIN_VALUES   # a smaller product runs whole where it is asked (split)
        self.using = self.n              # the cores this pass uses: n, or fewer while other programs
                                         # keep some busy (load.py, read as each forward pass starts)
        self.load = load or Load()
        self.blas = blas or Blas()
        self.pool = ThreadPoolExecutor(self.n - 1, thread_name_prefix="ds2-kernel") if self.n > 1 else None
        self.local = threading.local()   # .inside: this thread already runs one of several parts
        self.held = 0                    # > 0 while a low-bit forward pass holds BLAS (forward_pass)
        self.few = 0                     # > 0 while that pass has at most FEW_TOKENS tokens
        self.helpers = None              # the helper processes (helpers.py) while they run
        self.helpers_failed = False      # they failed once (a helper died): never again
        self.helpers_on = False          # whether they take this pass's products (set by the
                                         # machine's forward_pass)

    @property
    def inside(self) -> bool:
        """This thread already runs one of several parts (see part)."""
        return getattr(self.local, "inside", False)

    @property
    def parts(self) -> int:
        """How many parts to split work into here: one inside a part (which runs on its core
        alone, so more parts would only add calls), else one a core this pass uses."""
        return 1 if self.inside else min(self.n, self.using)

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
        with contextlib.nullcontext() if self.held else self.blas.threads(1):   # held: already one
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
        on threads, now. A product smaller than one of the helpers' units runs whole here: it
        would be one unit for whoever took it, and handing it on costs more than it does (a
        small model's heads, 8K weights each)."""
        if product.rows * product.row_values < self.split_min_values:
            product.whole()
            return
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
        left = helpers.run(products) if helpers is not None and products else products
        if helpers is not None and helpers.failed:      # one died or got stuck: threads from now on
            helpers.stop()
            self.helpers, self.helpers_failed = None, True
        for product in left:
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
        """Helper processes take the other cores' rows of a few-token pass's products (helpers.py).
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


    def forward_pass(self, low_bit: bool, tokens: int, helpers_wanted: bool):
        """What a forward pass of `tokens` tokens runs in: the cores other programs leave free
        counted first (load.py), float32's BLAS threads held to them. Over low-bit weights: BLAS
        held at one thread throughout, and a pass of at most FEW_TOKENS tokens marked as one
        whose products the helper processes share (`helpers_wanted`). OpenBLAS's idle threads
        keep spinning for a while after each call, and a spinning BLAS thread takes a core from
        the low-bit kernels' own threads (docs/performance.md, "Why the constants are what they
        are")."""
        if self.n < 2:
            return contextlib.nullcontext()
        self.using = self.load.free(self.n, self.helpers.pids() if self.helpers is not None else ())
        if not low_bit:         # float32 products: BLAS's own threads, as many as the cores free
            self.blas.follow(None if self.using >= self.n else self.using)
            return contextlib.nullcontext()
        self.helpers_on = self.helpers is not None and helpers_wanted
        return self.holding(tokens <= FEW_TOKENS)

    @contextlib.contextmanager
    def holding(self, few: bool):
        with self.blas.threads(1):
            self.held += 1
            self.few += few
            try:
                yield
            finally:
                self.held -= 1
                self.few -= few

    @contextlib.contextmanager
    def together(self):
        """Products started in the block are independent of each other: in a pass of few tokens
        whose products the helper processes share, their row spans are gathered (split) and sent
        as one plan when the block ends, one message and one wait for all of them instead of one
        each. Their outputs are complete once the block has ended, not before."""
        if getattr(self.local, "batch", None) is not None or not self.helpers_ready():
            yield
            return
        self.local.batch = batch = []
        try:
            yield
        finally:
            self.local.batch = None
        if batch:
            self.run_products(batch)

    def heads(self, n: int, tokens: int) -> list[slice]:
        """[0, n) as consecutive slices, one for each core that may run them at once: several in a
        low-bit prefill (lanes), else the whole (a decode step's attention is too small to be
        worth splitting, and a few-token pass splits its products instead)."""
        return [slice(a, b) for a, b in split_rows(n, self.lanes if tokens > 1 else 1, 1)]

    def key_slices(self, S: int, tokens: int) -> list[slice]:
        """[0, S) cached positions as consecutive slices for `spread`: one a core when a pass of
        few tokens attends to a long cache (its products are split across the cores already, and
        its attention, a stream over the whole latent, would otherwise run on one), else the whole."""
        parts = self.parts if tokens <= FEW_TOKENS and S >= self.shared_keys and not self.inside else 1
        return [slice(a, b) for a, b in split_rows(S, parts, 1)]

    def spread(self, fn, items) -> list:
        """[fn(item) for item in items], the first on this thread and each other on a core of its
        own, BLAS at one thread meanwhile (run): for items that split one piece of work evenly,
        such as key_slices' slices."""
        items = list(items)
        out = [None] * len(items)

        def one(k: int, _stop: int) -> None:
            out[k] = fn(items[k])
        self.run(one, [(k, k + 1) for k in range(len(items))])
        return out

    def map_costliest(self, fn, items, cost) -> list:
        """map, the costliest items (one number each in `cost`) started first, results in order."""
        items = list(items)
        first = sorted(range(len(items)), key=lambda j: -cost[j])
        done = dict(zip(first, self.map(lambda j: fn(items[j]), first)))
        return [done[j] for j in range(len(items))]


def allowed_cores() -> int:
    """The cores this process may run on, at most 8 (more pay nothing on the products' sizes)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, 8))


def split_rows(rows: int, parts: int, g: int) -> list[tuple[int, int]]:
    """`parts` spans of whole groups covering [0, rows)."""
    groups = -(-rows // g)
    bounds = [min(rows, g * (groups * k // parts)) for k in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
