"""Routed experts streamed from disk within a memory budget (`--memory-budget`).

A mixture of experts is mostly routed experts that a given token never touches. With a budget
smaller than the model, everything else (attention, shared experts, dense layers, embedding,
head, norms) stays memory-mapped and resident, and the routed experts live in an ExpertCache:
a fixed number of *slots*, each holding one expert (its gate_up and down matrices), filled from
the checkpoint file on a miss with one read a matrix, in whole experts, into buffers the cache
owns. What was read is dropped from the page cache (posix_fadvise DONTNEED), so the budget holds
for the process's memory and the page cache it causes together.

Each layer's expert stacks are StreamedStacks: `stack[e]` is the slot holding expert e, a weight
of the checkpoint's own format, so the math multiplies by it unchanged. StreamingExecutor (the
cores' executor) computes a layer's routed experts in groups that fit the slots, each group read
first, and after layer i reads ahead what layer i+1 will probably choose (its router applied to
layer i's output) on a reader thread while layer i+1's attention computes. The slots are shared
memory made before the helper processes fork, so they multiply by what was read after.
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
import time

import numpy as np

from ds2cli.errors import Ds2Error
from ds2cli.model.attention import rms_norm
from ds2cli.model.config import DeepseekV2Config
from ds2cli.model.moe import route
from ds2cli.model.linear import float32
from ds2cli.parallel.executor import CoreExecutor
from ds2cli.weights import checkpoint, qcheckpoint
from ds2cli.weights.formats.base import QuantMatrix

KINDS = ("experts_gate_up", "experts_down")


class StreamingError(Ds2Error):
    """The budget cannot hold the model's always-used part, or reading an expert failed."""


def shared_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeroed memory shared with processes forked later (an anonymous MAP_SHARED mapping)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=dtype, count=int(np.prod(shape))).reshape(shape)


class ExpertCache:
    """`slots` experts in memory, read from the checkpoint's files on a miss, least recently
    used out first. `stats`: hits, misses, reads ahead and those that were used, bytes read."""

    def __init__(self, cfg: DeepseekV2Config, qc, tensors: dict, slots: int):
        self.cfg, self.slots = cfg, slots
        self.where: dict[tuple[int, str], tuple] = {}     # (layer, kind) -> (qweight info, scales info)
        self.formats: dict[str, type[QuantMatrix]] = {}
        for i in range(cfg.num_hidden_layers):
            if not cfg.is_moe_layer(i):
                continue
            shapes = qcheckpoint.layer_shapes(cfg, i)
            for kind in KINDS:
                f = qcheckpoint.format_for(qc, "mlp", kind, shapes["mlp", kind])
                if f is None:
                    raise StreamingError("--memory-budget streams a low-bit checkpoint's routed experts; "
                                         f"this one stores {kind} as floats")
                name = qcheckpoint.stored_name(i, "mlp", kind)
                self.where[i, kind] = (tensors[name + ".qweight"], tensors[name + ".scales"])
                self.formats[kind] = f
        if not self.where:
            raise StreamingError("--memory-budget streams routed experts; this model has none")
        E, first = cfg.n_routed_experts, min(i for i, _ in self.where)
        self.stacks = {}
        for kind, f in self.formats.items():
            q, s = self.where[first, kind]
            self.stacks[kind] = f(shared_array((slots, *q.shape[1:]), checkpoint.numpy_dtype(q.dtype)),
                                  shared_array((slots, *s.shape[1:]), checkpoint.numpy_dtype(s.dtype)))
        self.expert_bytes = sum((q.nbytes + s.nbytes) // E for q, s in (self.where[first, k] for k in KINDS))
        self.slot_of: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        self.free = list(range(slots - 1, -1, -1))
        self.ahead: set[tuple[int, int]] = set()           # read ahead, not yet used
        self.in_use: dict[tuple[int, int], int] = {}        # being multiplied by: not to be evicted
        self.lock = threading.Lock()
        self.files: dict = {}
        self.stats = {"hits": 0, "misses": 0, "read_ahead": 0, "read_ahead_used": 0, "bytes_read": 0,
                      "read_seconds": 0.0}

    def fd(self, path) -> int:
        if path not in self.files:
            try:
                self.files[path] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise StreamingError(f"cannot open {path}: {e.strerror}") from None
        return self.files[path]

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)
        self.files = {}

    def fetch(self, layer: int, experts, ahead: bool = False, use: bool = False) -> list[int]:
        """The slots holding `experts` of `layer`, each read on a miss. `use`: they are being
        multiplied by until `release`, so no other fetch may take their slots meanwhile. A fetch
        `ahead` (a guess) stops, quietly, where no slot is free to take."""
        with self.lock:
            out = []
            keep = {(layer, int(e)) for e in experts}
            for e in experts:
                key = (layer, int(e))
                slot = self.slot_of.get(key)
                if slot is not None:
                    self.slot_of.move_to_end(key)
                    if not ahead:
                        self.stats["hits"] += 1
                        if key in self.ahead:
                            self.ahead.discard(key)
                            self.stats["read_ahead_used"] += 1
                else:
                    slot = self.take_slot(keep)
                    if slot is None:
                        if ahead:
                            return out
                        raise StreamingError(f"the expert cache's {self.slots} slots cannot hold "
                                             f"{len(keep)} experts beside the {len(self.in_use)} in use")
                    self.read(layer, int(e), slot)
                    self.slot_of[key] = slot
                    if ahead:
                        self.ahead.add(key)
                        self.stats["read_ahead"] += 1
                    else:
                        self.stats["misses"] += 1
                if use:
                    self.in_use[key] = self.in_use.get(key, 0) + 1
                out.append(slot)
            return out

    def release(self, layer: int, experts) -> None:
        with self.lock:
            for e in experts:
                key = (layer, int(e))
                if self.in_use.get(key, 0) <= 1:
                    self.in_use.pop(key, None)
                else:
                    self.in_use[key] -= 1

    def holds(self, layer: int, e: int) -> bool:
        return (layer, int(e)) in self.slot_of

    def take_slot(self, keep: set) -> int | None:
        if self.free:
            return self.free.pop()
        for key in self.slot_of:             # least recently used first, never one asked for or in use
            if key not in keep and key not in self.in_use:
                self.ahead.discard(key)
                return self.slot_of.pop(key)
        return None

    def read(self, layer: int, e: int, slot: int) -> None:
        """Expert e of `layer` into `slot`: one read a tensor, then its pages dropped from the page cache."""
        t0 = time.perf_counter()
        E = self.cfg.n_routed_experts
        for kind in KINDS:
            stack = self.stacks[kind]
            for info, dst in zip(self.where[layer, kind], (stack.qweight[slot], stack.scales[slot])):
                n = info.nbytes // E
                at = info.offset + e * n
                fd = self.fd(info.file)
                view = memoryview(dst.reshape(-1).view(np.uint8))
                got = 0
                try:
                    while got < n:
                        k = os.preadv(fd, [view[got:]], at + got)
                        if k == 0:
                            raise StreamingError(f"{info.file} ends before expert {e} of layer {layer} "
                                                 f"(truncated after ds2 opened it?)")
                        got += k
                    os.posix_fadvise(fd, at, n, os.POSIX_FADV_DONTNEED)
                except OSError as err:
                    raise StreamingError(f"cannot read expert {e} of layer {layer} from {info.file}: "
                                         f"{err.strerror}") from None
                self.stats["bytes_read"] += n
        self.stats["read_seconds"] += time.perf_counter() - t0


class StreamedStack:
    """A layer's routed experts of one kind (E, out, in), held in the ExpertCache's slots:
    `stack[e]` is expert e's matrix, read first if it is not in a slot."""

    def __init__(self, cache: ExpertCache, layer: int, kind: str, shape: tuple[int, ...]):
        self.cache, self.layer, self.kind, self.shape = cache, layer, kind, shape

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return self.cache.expert_bytes * len(self) // 2

    @property
    def stacks(self) -> tuple:
        """What helper processes must know before they fork: the slots' stack (once per kind)."""
        return (self.cache.stacks[self.kind],)

    def __getitem__(self, e) -> QuantMatrix:
        slot, = self.cache.fetch(self.layer, [int(e)])
        return self.cache.stacks[self.kind][slot]


class StreamingExecutor(CoreExecutor):
    """The cores, with each MoE layer's routed experts read into the cache's slots a group at a
    time, and reads ahead on a reader thread: after layer i, the experts layers i+1 and i+2 will
    probably choose (their routers applied to layer i's output; i+1 first), so that the disk is
    busy while layer i+1 computes; a layer waits only for its own reads."""

    AHEAD = 1                       # layers read ahead of the one computing (2 read 30% more, and was slower)

    def __init__(self, cache: ExpertCache):
        super().__init__()
        self.cache = cache
        self.model = None
        self.queue: collections.deque = collections.deque()   # (layer, experts) to read, in order
        self.busy: tuple | None = None                        # what the reader reads now
        self.cond = threading.Condition()
        self.failed: BaseException | None = None
        self.reader: threading.Thread | None = None

    def start(self, model) -> None:
        self.model = model
        super().start(model)

    def stop(self) -> None:
        self.settle()
        self.cache.close()
        super().stop()

    def stats(self) -> dict:
        return dict(self.cache.stats, slots=self.cache.slots)

    def forward_pass(self, tokens: int):
        self.settle()               # a new pass: the last one's reads ahead are moot
        return super().forward_pass(tokens)

    def settle(self) -> None:
        """No read queued or running, and no failure kept from a pass that has ended (it was
        raised there, or it was a guess nobody needed)."""
        with self.cond:
            self.queue.clear()
            while self.busy is not None:
                self.cond.wait(timeout=1.0)
            self.failed = None

    def read_ahead(self, layer: int, experts) -> None:
        """Queue `experts` of `layer` for the reader thread (started on first use)."""
        with self.cond:
            self.queue.append((layer, [int(e) for e in experts]))
            if self.reader is None or not self.reader.is_alive():
                self.reader = threading.Thread(target=self.read_queue, name="ds2-read-ahead", daemon=True)
                self.reader.start()
            self.cond.notify_all()

    def read_queue(self) -> None:
        while True:
            with self.cond:
                if not self.queue or self.failed is not None:
                    self.busy = None
                    self.cond.notify_all()
                    return
                self.busy = self.queue.popleft()
            layer, experts = self.busy
            try:
                for e in experts:          # one at a time: a layer's own fetch waits one read at most
                    got = self.cache.fetch(layer, [e], ahead=True)
                    with self.cond:
                        self.cond.notify_all()      # a layer waiting for this expert may go on
                    if not got:
                        break
            except BaseException as err:   # noqa: BLE001 - raised where the pass waits for it
                with self.cond:
                    self.failed = err
            with self.cond:
                self.busy = None
                self.cond.notify_all()

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
        while pending:
            now = [e for e in pending if cache.holds(layer, e)][:room]
            if not now:
                if self.coming(layer, pending):
                    self.wait_progress()
                    continue
                now = pending[:1]                   # nobody reads it: read it now
                if len(pending) > 1:                # ... and have the reader read the rest meanwhile
                    self.read_ahead(layer, pending[1:room])
            slots = cache.fetch(layer, now, use=True)
            try:
                for e, y in zip(now, ffn(self, [(x_of[e], gate_up[s], down[s]) for e, s in zip(now, slots)])):
                    done[e] = y
            finally:
                cache.release(layer, now)
            pending = [e for e in pending if e not in done]
        self.wait_for(layer)                        # reads of this layer the pass did not need
        outs = [done[int(e)] for e in ids]
        if shared is not None:
            outs += ffn(self, [(shared, w.shared_gate_up, w.shared_down)])
        return outs

    def todo(self) -> list[tuple]:
        """The reader's (layer, experts) still to read, the one it reads now first. Under `cond`."""
        return ([self.busy] if self.busy else []) + list(self.queue)

    def coming(self, layer: int, experts: list[int]) -> bool:
        """Whether the reader has any of `experts` of `layer` still to read."""
        with self.cond:
            if self.failed is not None:
                return False
            todo = self.todo()
        wanted = set(experts)
        return any(l == layer and wanted & set(es) for l, es in todo)

    def wait_progress(self) -> None:
        """Until the reader reads one more expert (or stops); raise what it met."""
        with self.cond:
            if self.busy is not None or self.queue:
                self.cond.wait(timeout=1.0)
            if self.failed is not None:
                failed, self.failed = self.failed, None
                self.queue.clear()
                raise failed

    def after_layer(self, i: int, x: np.ndarray) -> None:
        """Layer i's output is known: queue what the next layers' routers pick for it, the
        nearest first, each at most what the slots hold beside the reads already queued."""
        layers, cfg = self.model.layers, self.model.config
        for j in range(i + 1, min(i + 1 + self.AHEAD, len(layers))):
            nxt = layers[j]
            if nxt is None or not nxt.is_moe:
                continue
            h = rms_norm(x, nxt.post_attention_layernorm, cfg.rms_norm_eps)
            idx, _ = route(h, float32(nxt.mlp.gate), cfg, nxt.mlp.e_score_correction_bias)
            wanted = [int(e) for e in np.unique(idx) if not self.cache.holds(j, e)]
            if wanted:
                self.read_ahead(j, wanted[:max(1, self.cache.slots // (2 * self.AHEAD))])


def streamed_weights(weights: dict, cfg: DeepseekV2Config, qc, tensors: dict, slots: int) -> ExpertCache:
    """Replace each MoE layer's routed expert stacks in `weights` (qcheckpoint.load_weights'
    memory-mapped ones) with StreamedStacks over one ExpertCache of `slots` experts, and read
    every other weight into memory of this process's own: the budget then holds no page cache of
    the files (dropped as they are read), and a file changed under the run fails a read with an
    error instead of a fault on a mapped page."""
    cache = ExpertCache(cfg, qc, tensors, slots)
    for i, layer in enumerate(weights["layers"]):
        if layer is not None:
            for _, part in layer.parts():
                for key, w in list(part.items()):
                    part[key] = StreamedStack(cache, i, key, w.shape) if key in KINDS and layer.is_moe else owned(w)
            layer.input_layernorm = owned(layer.input_layernorm)
            layer.post_attention_layernorm = owned(layer.post_attention_layernorm)
    tied = weights["lm_head"] is weights["embed_tokens"]
    for key in ("embed_tokens", "norm", "lm_head"):
        weights[key] = owned(weights[key])
    if tied:
        weights["lm_head"] = weights["embed_tokens"]
    for path in {info.file for info in tensors.values()}:
        drop_cached(path)
    return cache


def owned(w):
    """A memory-mapped weight (array, or weight object over arrays) as a copy in this process."""
    if w is None:
        return None
    if isinstance(w, np.ndarray):
        return np.array(w)
    if isinstance(w, QuantMatrix):
        return type(w)(np.array(w.qweight), np.array(w.scales))
    return type(w)(np.array(w.w))            # formats.Dense, linear.Heads: one array, .w


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
