"""The experts part: where a MoE layer's routed experts live and are computed.

  Experts           resident in this process's memory, computed by the compute part
  StreamedExperts   read from disk into an ExpertCache's slots within a budget (--memory-budget),
                    computed as their reads land, the next layer's read ahead
(RemoteExperts, a cluster's share of them on other nodes, is in remote.py.) Each is told the
layer it runs (`run(i, ...)`), and hears when a pass starts and when each layer's attention and
output are known, for reading ahead.

A mixture of experts is mostly routed experts that a given token never touches. With a budget
smaller than the model, everything else stays resident and the routed experts live in an
ExpertCache (weights/expert_cache.py, where the slots, the reads and the budget are): the
streamed part computes a layer's routed experts as they land in slots (the shared experts while
the first are read), and guesses the next layer's experts twice (its router over layer i's
residual after attention, then over layer i's output) for reader threads to read while layer i
computes; a layer's own misses go to the head of their queue.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from ds2cli.model.attention import rms_norm
from ds2cli.model.linear import float32
from ds2cli.model.moe import gate, swiglu_all


class Experts:
    """Routed experts resident in memory: each computed by the compute part, all at once."""

    def start(self, model, compute) -> None:
        """The model's weights exist; `compute` (compute.py) runs the experts' products."""
        self.compute = compute

    def stop(self) -> None:
        """Release what start set up."""

    def stats(self) -> dict:
        """What the experts cost beyond computing (a streamed run: reads from disk)."""
        return {}

    def forward_pass(self) -> None:
        """A pass begins."""

    def take_traffic(self) -> dict:
        """What calls to other nodes cost since last asked (a cluster spread by experts)."""
        return {}

    def run(self, i: int, w, ids, xs, shared) -> list[np.ndarray]:
        """MoE layer i's routed experts `ids` over their rows xs[j], then its shared experts over
        `shared` (None: none): their outputs in that order."""
        tasks = [(x, w.experts_gate_up[e], w.experts_down[e]) for e, x in zip(ids, xs)]
        if shared is not None:
            tasks.append((shared, w.shared_gate_up, w.shared_down))
        return swiglu_all(self.compute, tasks)        # their products asked of the compute part together

    def after_attention(self, i: int, x: np.ndarray) -> None:
        """Layer i's attention is added to x, the residual its MLP reads."""

    def after_layer(self, i: int, x: np.ndarray) -> None:
        """Layer i's output is x."""


class StreamedExperts(Experts):
    """Each MoE layer's routed experts computed from an ExpertCache's slots as they land
    (weights/expert_cache.py, `cache`), and reads ahead on reader threads: after layer i's
    attention and again after layer i, the experts layer i+1 will probably choose (its router
    over layer i's residual), so that the disk is busy while layers i and i+1 compute; a layer
    waits only for its own reads."""

    AHEAD = 1                       # layers read ahead of the one computing (2 read 30% more, and was slower)
    READERS = 2                     # threads reading at once (see docs/performance.md)
    EARLY = True                    # guess the next layer's experts after attention too (see after_attention)

    def __init__(self, cache):
        super().__init__()
        self.cache = cache
        self.model = None
        self.queue: collections.deque = collections.deque()   # (layer, expert) to read, in order
        self.busy: list[tuple[int, int]] = []                 # what the readers read now
        self.cond = threading.Condition()
        self.failed: BaseException | None = None
        self.readers: list[threading.Thread] = []
        self.gates: dict[int, np.ndarray] = {}                # layer -> its router's weights as float32
        self.reading = 0                                      # reader threads running (or starting)

    def start(self, model, compute) -> None:
        super().start(model, compute)
        self.model = model

    def stop(self) -> None:
        self.settle()
        for reader in self.readers:
            reader.join()
        self.readers = []
        self.cache.close()

    def stats(self) -> dict:
        return dict(self.cache.stats, slots=self.cache.slots)

    def forward_pass(self) -> None:
        self.settle()               # a new pass: the last one's reads ahead are moot

    def disk_rate(self) -> float:
        """Bytes a second the disk gives expert reads alone, as many at once as the readers."""
        self.settle()
        return self.cache.disk_rate(threads=self.READERS)

    def settle(self) -> None:
        """No read queued or running, and no failure kept from a pass that has ended (it was
        raised there, or it was a guess nobody needed)."""
        with self.cond:
            self.queue.clear()
            while self.busy:
                self.cond.wait(timeout=1.0)
            self.failed = None

    def read_ahead(self, layer: int, experts, first: bool = False) -> None:
        """Queue `experts` of `layer` for the reader threads (started as there is work for them);
        `first`: before what is queued (a layer's own misses go before the next layer's guesses)."""
        with self.cond:
            items = [(layer, int(e)) for e in experts]
            if first:
                self.queue.extendleft(reversed(items))
            else:
                self.queue.extend(items)
            self.readers = [r for r in self.readers if r.is_alive()]
            while self.reading < min(self.READERS, len(self.queue) + len(self.busy)):
                self.reading += 1          # a reader that found the queue empty has said so under cond
                reader = threading.Thread(target=self.read_queue, name="ds2-read-ahead", daemon=True)
                self.readers.append(reader)
                reader.start()
            self.cond.notify_all()

    def read_queue(self) -> None:
        """A reader thread: experts from the queue, one at a time, until it is empty."""
        while True:
            with self.cond:
                if not self.queue or self.failed is not None:
                    self.reading -= 1
                    self.cond.notify_all()
                    return
                item = self.queue.popleft()
                self.busy.append(item)
            layer, e = item
            try:
                got = self.cache.fetch(layer, [e], ahead=True)
            except BaseException as err:   # noqa: BLE001 - raised where the pass waits for it
                got = None
                with self.cond:
                    self.failed = err
            with self.cond:
                self.busy.remove(item)
                if got == []:              # no slot to take: the rest of the layer's guesses neither
                    self.queue = collections.deque(q for q in self.queue if q[0] != layer)
                self.cond.notify_all()      # a layer waiting for this expert may go on

    def wait_for(self, layer: int | None) -> None:
        """Until the reader has read every queued expert of layers up to `layer` (None: all);
        then raise what it met, if it failed."""
        def pending() -> bool:
            return any(layer is None or item[0] <= layer for item in self.todo())
        with self.cond:
            while self.failed is None and pending():
                self.cond.wait()
            if self.failed is not None:
                failed, self.failed = self.failed, None
                self.queue.clear()
                raise failed

    def run(self, layer: int, w, ids, xs, shared) -> list[np.ndarray]:
        """The layer's routed experts, each computed as soon as it is in a slot: those the cache
        holds first, then those the reader brings as it brings them, so computing overlaps
        reading; an expert nobody is reading is read here. Returned in the order of `ids`, the
        shared experts' output last (computed while the first reads run)."""
        cache = self.cache

        def ffn(tasks: list) -> list[np.ndarray]:
            return swiglu_all(self.compute, tasks)
        x_of = {int(e): x for e, x in zip(ids, xs)}
        pending, done = [int(e) for e in ids], {}
        gate_up, down = cache.stacks["experts_gate_up"], cache.stacks["experts_down"]
        room = max(1, cache.slots // 2)             # in use at once, so the reader has slots too
        shared_out = [] if shared is None else ffn([(shared, w.shared_gate_up, w.shared_down)])  # as reads run
        while pending:
            now = [e for e in pending if cache.holds(layer, e)][:room]
            if not now:
                unread = self.hurry(layer, pending[:room])
                if not unread:                      # every one is queued or being read
                    self.wait_progress()
                    continue
                now = unread[:1]                    # nobody reads it: read it now
                if len(unread) > 1:                 # ... and have the readers read the rest meanwhile
                    self.read_ahead(layer, unread[1:], first=True)
            slots = cache.fetch(layer, now, use=True)
            try:
                for e, y in zip(now, ffn([(x_of[e], gate_up[s], down[s]) for e, s in zip(now, slots)])):
                    done[e] = y
            finally:
                cache.release(layer, now)
            pending = [e for e in pending if e not in done]
        self.wait_for(layer)                        # reads of this layer the pass did not need
        return [done[int(e)] for e in ids] + shared_out

    def todo(self) -> list[tuple[int, int]]:
        """The readers' (layer, expert) still to read, those being read first. Under `cond`."""
        return self.busy + list(self.queue)

    def hurry(self, layer: int, experts: list[int]) -> list[int]:
        """Move those of `experts` (of `layer`) that are queued to the queue's head, as a layer
        waits for them (the next layer's guesses wait behind); return those nobody reads."""
        with self.cond:
            mine = [item for item in self.queue if item[0] == layer and item[1] in experts]
            if mine:
                self.queue = collections.deque(mine + [item for item in self.queue if item not in mine])
            known = {e for l, e in self.busy + mine if l == layer}
        return [e for e in experts if e not in known]

    def wait_progress(self) -> None:
        """Until a reader reads one more expert (or they stop); raise what it met."""
        with self.cond:
            if self.busy or self.queue:
                self.cond.wait(timeout=1.0)
            if self.failed is not None:
                failed, self.failed = self.failed, None
                self.queue.clear()
                raise failed

    def after_attention(self, i: int, x: np.ndarray) -> None:
        """Layer i's attention is added: guess what the next MoE layer will pick from this
        residual, before layer i's MLP adds to it, so that the disk reads for layer i+1 while
        layer i's experts compute (the guess made after the layer only adds what this missed)."""
        if self.EARLY:
            self.guess(i, x)

    def after_layer(self, i: int, x: np.ndarray) -> None:
        """Layer i's output is known: queue what the next layers' routers pick for it, the
        nearest first, each at most what the slots hold beside the reads already queued."""
        self.guess(i, x)

    def widened(self, j: int) -> np.ndarray:
        """Layer j's router weights as float32, widened once (a guess is two a layer a step)."""
        if j not in self.gates:
            self.gates[j] = float32(self.model.layers[j].mlp.gate)
        return self.gates[j]

    def guess(self, i: int, x: np.ndarray) -> None:
        layers, cfg = self.model.layers, self.model.config
        for j in range(i + 1, min(i + 1 + self.AHEAD, len(layers))):
            nxt = layers[j]
            if nxt is None or not nxt.is_moe or nxt.post_attention_layernorm is None:
                continue        # not a MoE layer, or computed on another node (spread by experts)
            idx, _ = gate(rms_norm(x, nxt.post_attention_layernorm, cfg.rms_norm_eps), nxt.mlp, cfg,
                          self.widened(j))    # the same norm and router the layer will run
            share = self.cache.share          # the experts here (a node's share), counted from its first
            mine = [int(e) - share.start for e in np.unique(idx) if int(e) in share]
            with self.cond:
                queued = {e for l, e in self.todo() if l == j}
            room = max(1, self.cache.slots // (2 * self.AHEAD)) - len(queued)
            wanted = [e for e in mine if not self.cache.holds(j, e) and e not in queued]
            if wanted and room > 0:
                self.read_ahead(j, wanted[:room])
