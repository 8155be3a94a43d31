"""Routed experts streamed from disk within a memory budget (`--memory-budget`).

A mixture of experts is mostly routed experts that a given token never touches. With a budget
smaller than the model, everything else (attention, shared experts, dense layers, embedding,
head, norms) stays resident, and the routed experts live in an ExpertCache: a fixed number of
*slots*, each holding one expert (its gate_up and down matrices), filled from the model's file
on a miss with one read a stored matrix, in whole experts, into buffers the cache owns. Where an
expert lies is its source's: StoredExperts for a ds2 low-bit checkpoint (here),
gguf/experts.GGUFExperts for a GGUF's stacked tensors (a Q8_0 expert's blocks become q8b's).
Reads bypass the page cache (O_DIRECT; where the file system refuses it, the pages read are
dropped after, posix_fadvise DONTNEED), so the budget holds for the process's memory and the
page cache it causes together. They happen outside the cache's lock: the computing thread takes
what is in the slots while readers read.

Each layer's expert stacks are StreamedStacks: `stack[e]` is the slot holding expert e, a weight
of the checkpoint's own format, so the math multiplies by it unchanged. StreamingExecutor (the
cores' executor) computes a layer's routed experts as they land in slots (the shared experts
while the first are read), and guesses the next layer's experts twice (its router over layer
i's residual after attention, then over layer i's output) for reader threads to read while
layer i computes; a layer's own misses go to the head of their queue. The slots are shared
memory made before the helper processes fork, so they multiply by what was read after."""
from __future__ import annotations

import collections
import mmap
import os
import threading

import numpy as np

from ds2cli.model.attention import rms_norm
from ds2cli.model.config import DeepseekV2Config
from ds2cli.model.moe import route
from ds2cli.model.linear import float32
from ds2cli.parallel.executor import CoreExecutor
from ds2cli.weights.expert_cache import KINDS, ExpertCache, StreamedStack
from ds2cli.weights.formats.base import QuantMatrix


class StreamingExecutor(CoreExecutor):
    """The cores, with each MoE layer's routed experts computed from the cache's slots as they
    land, and reads ahead on reader threads: after layer i's attention and again after layer i,
    the experts layer i+1 will probably choose (its router over layer i's residual), so that
    the disk is busy while layer i and i+1 compute; a layer waits only for its own reads."""

    AHEAD = 1                       # layers read ahead of the one computing (2 read 30% more, and was slower)
    READERS = 2                     # threads reading at once (see docs/performance.md)
    EARLY = True                    # guess the next layer's experts after attention too (see after_attention)

    def __init__(self, cache: ExpertCache):
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

    def start(self, model) -> None:
        self.model = model
        super().start(model)

    def stop(self) -> None:
        self.settle()
        for reader in self.readers:
            reader.join()
        self.readers = []
        self.cache.close()
        super().stop()

    def stats(self) -> dict:
        return dict(self.cache.stats, slots=self.cache.slots)

    def disk_rate(self) -> float:
        """Bytes a second the disk gives expert reads alone, as many at once as the readers."""
        self.settle()
        return self.cache.disk_rate(threads=self.READERS)

    def forward_pass(self, tokens: int):
        self.settle()               # a new pass: the last one's reads ahead are moot
        return super().forward_pass(tokens)

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

    def experts(self, w, ids, xs, shared, ffn):
        """The layer's routed experts, each computed as soon as it is in a slot: those the cache
        holds first, then those the reader brings as it brings them, so computing overlaps
        reading; an expert nobody is reading is read here. Returned in the order of `ids`."""
        stack = w.experts_gate_up
        if not isinstance(stack, StreamedStack):
            return super().experts(w, ids, xs, shared, ffn)
        layer, cache = stack.layer, self.cache
        x_of = {int(e): x for e, x in zip(ids, xs)}
        pending, done = [int(e) for e in ids], {}
        gate_up, down = cache.stacks["experts_gate_up"], cache.stacks["experts_down"]
        room = max(1, cache.slots // 2)             # in use at once, so the reader has slots too
        shared_out = [] if shared is None else ffn(self, [(shared, w.shared_gate_up, w.shared_down)])  # as reads run
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
                for e, y in zip(now, ffn(self, [(x_of[e], gate_up[s], down[s]) for e, s in zip(now, slots)])):
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

    def gate(self, j: int) -> np.ndarray:
        """Layer j's router weights as float32, widened once (a guess is two a layer a step)."""
        if j not in self.gates:
            self.gates[j] = float32(self.model.layers[j].mlp.gate)
        return self.gates[j]

    def guess(self, i: int, x: np.ndarray) -> None:
        layers, cfg = self.model.layers, self.model.config
        for j in range(i + 1, min(i + 1 + self.AHEAD, len(layers))):
            nxt = layers[j]
            if nxt is None or not nxt.is_moe:
                continue
            h = rms_norm(x, nxt.post_attention_layernorm, cfg.rms_norm_eps)
            idx, _ = route(h, self.gate(j), cfg, nxt.mlp.e_score_correction_bias)
            with self.cond:
                queued = {e for l, e in self.todo() if l == j}
            room = max(1, self.cache.slots // (2 * self.AHEAD)) - len(queued)
            wanted = [int(e) for e in np.unique(idx) if not self.cache.holds(j, e) and int(e) not in queued]
            if wanted and room > 0:
                self.read_ahead(j, wanted[:room])


def streamed_weights(weights: dict, cfg: DeepseekV2Config, source, slots: int) -> ExpertCache:
    """Put StreamedStacks over one ExpertCache of `slots` experts in place of each MoE layer's
    routed expert stacks in `weights` (qcheckpoint.load_weights' memory-mapped ones, or None
    where the loader left them out), and read the other weights that are views of a mapped file
    (a low-bit checkpoint's, a GGUF's float norms) into memory of this process's own: the budget then holds no page
    cache of the files (dropped as they are read), and a file changed under the run fails a read
    with an error instead of a fault on a mapped page."""
    cache = ExpertCache(cfg, source, slots)
    keep = owned
    E = cfg.n_routed_experts
    for i, layer in enumerate(weights["layers"]):
        if layer is not None:
            for _, part in layer.parts():
                for key, w in list(part.items()):
                    if not (layer.is_moe and key in KINDS):      # those are replaced: never copied
                        part[key] = keep(w)
            for key in KINDS if layer.is_moe else ():
                layer.mlp[key] = StreamedStack(cache, i, key, (E, *source.shapes[key]))
            layer.input_layernorm = keep(layer.input_layernorm)
            layer.post_attention_layernorm = keep(layer.post_attention_layernorm)
    tied = weights["lm_head"] is weights["embed_tokens"]
    for key in ("embed_tokens", "norm", "lm_head"):
        weights[key] = keep(weights[key])
    if tied:
        weights["lm_head"] = weights["embed_tokens"]
    for path in source.paths:
        drop_cached(path)
    return cache


def owned(w):
    """A weight (array, or weight object over arrays) whose memory is a view of a mapped file, as
    a copy in this process; one that owns its memory already, itself (not copied twice)."""
    if w is None:
        return None
    if isinstance(w, np.ndarray):
        return np.array(w) if file_backed(w) else w
    if isinstance(w, QuantMatrix):
        return w if not (file_backed(w.qweight) or file_backed(w.scales)) else \
            type(w)(np.array(w.qweight), np.array(w.scales))
    return type(w)(np.array(w.w)) if file_backed(w.w) else w      # formats.Dense, linear.Heads: one array, .w


def file_backed(a: np.ndarray) -> bool:
    """Whether `a` views a memory-mapped file (np.memmap, or an mmap.mmap of a file), at any depth."""
    while a is not None:
        if isinstance(a, np.memmap) or (isinstance(a, mmap.mmap) and not is_anonymous(a)):
            return True
        a = getattr(a, "base", None) if isinstance(a, np.ndarray) else getattr(a, "obj", None)
    return False


def is_anonymous(m: mmap.mmap) -> bool:
    try:
        m.size()            # a mapping of a file knows the file's size; an anonymous one raises
        return False
    except OSError:
        return True


def drop_cached(path) -> None:
    """Ask the kernel to drop a file's pages from the page cache (they were copied)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
