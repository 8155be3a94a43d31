"""Routed experts streamed from disk within a memory budget (`--memory-budget`).

A mixture of experts is mostly routed experts that a given token never touches. With a budget
smaller than the model, everything else (attention, shared experts, dense layers, embedding,
head, norms) stays resident, and the routed experts live in an ExpertCache: a fixed number of
*slots*, each holding one expert (its gate_up and down matrices), filled from the model's file
on a miss with one read a stored matrix, in whole experts, into buffers the cache owns. Where an
expert lies is its source's: StoredExperts for a ds2 low-bit checkpoint (here),
gguf/experts.GGUFExperts for a GGUF's stacked tensors (a Q8_0 expert's blocks become q8b's). What was read is dropped from the page cache (posix_fadvise DONTNEED), so the budget holds
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
import errno
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
ALIGN = 4096                        # O_DIRECT reads whole blocks into aligned memory: a page covers every disk


class StreamingError(Ds2Error):
    """The budget cannot hold the model's always-used part, or reading an expert failed."""


def shared_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeroed memory shared with processes forked later (an anonymous MAP_SHARED mapping)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=dtype, count=int(np.prod(shape))).reshape(shape)


class StoredExperts:
    """Where a ds2 low-bit checkpoint keeps each MoE layer's routed experts: every matrix's
    qweight and scales stacked (E, ...) in a safetensors file, so expert e of a matrix is one
    contiguous range of each, read straight into a slot. The checkpoint's other weights are views
    of the mapped files: streamed_weights copies them into memory of the process's own."""

    def __init__(self, cfg: DeepseekV2Config, qc, tensors: dict):
        self.where: dict[tuple[int, str], tuple] = {}     # (layer, kind) -> (qweight info, scales info)
        self.formats: dict[str, type[QuantMatrix]] = {}
        self.shapes: dict[str, tuple[int, int]] = {}      # kind -> one expert's (out, in)
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
                self.formats[kind], self.shapes[kind] = f, shapes["mlp", kind][1:]
        self.E = cfg.n_routed_experts
        self.paths = {info.file for info in tensors.values()}
        first = min((i for i, _ in self.where), default=None)
        self.read_bytes = 0 if first is None else \
            sum(info.nbytes // self.E for kind in KINDS for info in self.where[first, kind])   # an expert, from disk

    def read(self, layer: int, e: int, kind: str, qweight: np.ndarray, scales: np.ndarray, pread) -> None:
        """Expert e of `layer`'s `kind` into a slot's arrays: one read for each."""
        for info, dst in zip(self.where[layer, kind], (qweight, scales)):
            n = info.nbytes // self.E
            pread(info.file, info.offset + e * n, dst.reshape(-1).view(np.uint8), e, layer)


class ExpertCache:
    """`slots` experts in memory, read from the model's files on a miss, least recently used out
    first. `source` says where each expert lies and how its bytes fill a slot (StoredExperts, a
    ds2 low-bit checkpoint; gguf/experts.GGUFExperts, a GGUF's stacked tensors). `stats`: hits,
    misses, reads ahead and those that were used, bytes read from disk."""

    direct = True                   # O_DIRECT where the file system allows it (see docs/performance.md)

    def __init__(self, cfg: DeepseekV2Config, source, slots: int):
        self.cfg, self.source, self.slots = cfg, source, slots
        if not source.formats:
            raise StreamingError("--memory-budget streams routed experts; this model has none")
        self.stacks = {kind: f(shared_array(f.qweight_shape((slots, *source.shapes[kind])), f.qweight_dtype),
                               shared_array(f.scales_shape((slots, *source.shapes[kind])), f.scale_dtype))
                       for kind, f in source.formats.items()}
        self.expert_bytes = sum(f.nbytes_of(source.shapes[kind]) for kind, f in source.formats.items())
        self.slot_of: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        self.free = list(range(slots - 1, -1, -1))
        self.ahead: set[tuple[int, int]] = set()           # read ahead, not yet used
        self.in_use: dict[tuple[int, int], int] = {}        # being multiplied by: not to be evicted
        self.filling: dict[tuple[int, int], threading.Event] = {}   # being read into a slot, by whom waits
        self.lock = threading.Lock()
        self.local = threading.local()                   # each reading thread's aligned buffer
        self.files: dict = {}                             # path -> (fd, opened with O_DIRECT)
        self.stats = {"hits": 0, "misses": 0, "read_ahead": 0, "read_ahead_used": 0, "bytes_read": 0,
                      "read_seconds": 0.0}

    def fd(self, path) -> int:
        """The file's descriptor, opened once: with O_DIRECT where the file system allows it
        (`direct`), so a read goes from the disk into the reader's buffer without the page cache."""
        if path not in self.files:
            try:
                self.files[path] = self.open(path)
            except OSError as e:
                raise StreamingError(f"cannot open {path}: {e.strerror}") from None
        return self.files[path]

    def open(self, path) -> tuple[int, bool]:
        if self.direct and hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as e:
                if e.errno != errno.EINVAL:         # EINVAL: this file system has no O_DIRECT
                    raise
        return os.open(path, os.O_RDONLY), False

    def close(self) -> None:
        for fd, _ in self.files.values():
            os.close(fd)
        self.files = {}

    def fetch(self, layer: int, experts, ahead: bool = False, use: bool = False) -> list[int]:
        """The slots holding `experts` of `layer`, each read on a miss. `use`: they are being
        multiplied by until `release`, so no other fetch may take their slots meanwhile. A fetch
        `ahead` (a guess) stops, quietly, where no slot is free to take. Reads happen outside
        the lock, so the computing thread takes what is in the slots while the reader reads; an
        expert another thread is reading is waited for, never read twice."""
        out = []
        keep = {(layer, int(e)) for e in experts}
        for e in experts:
            key = (layer, int(e))
            while True:
                with self.lock:
                    slot = self.slot_of.get(key)
                    filling = self.filling.get(key)
                    if slot is not None:
                        self.slot_of.move_to_end(key)
                        if not ahead:
                            self.stats["hits"] += 1
                            if key in self.ahead:
                                self.ahead.discard(key)
                                self.stats["read_ahead_used"] += 1
                        if use:
                            self.in_use[key] = self.in_use.get(key, 0) + 1
                        break
                    if filling is None:
                        slot = self.take_slot(keep)
                        if slot is None and not ahead and self.filling:
                            filling = next(iter(self.filling.values()))   # a slot being filled: wait for it
                        elif slot is None:
                            if ahead:
                                return out
                            raise StreamingError(f"the expert cache's {self.slots} slots cannot hold "
                                                 f"{len(keep)} experts beside the {len(self.in_use)} in use")
                        else:
                            self.filling[key] = threading.Event()
                if filling is not None:             # another thread reads it (or the slot to take): wait, look again
                    filling.wait()
                    continue
                try:
                    seconds = self.read(layer, int(e), slot)
                except BaseException:              # a failed or interrupted read: its slot holds nothing
                    with self.lock:
                        self.free.append(slot)
                        self.filling.pop(key).set()
                    raise
                with self.lock:
                    self.filling.pop(key).set()
                    self.slot_of[key] = slot
                    self.stats["bytes_read"] += self.source.read_bytes
                    self.stats["read_seconds"] += seconds
                    if ahead:
                        self.ahead.add(key)
                        self.stats["read_ahead"] += 1
                    else:
                        self.stats["misses"] += 1
                    if use:
                        self.in_use[key] = self.in_use.get(key, 0) + 1
                break
            out.append(slot)
        return out

    def disk_rate(self, experts: int = 24, threads: int = 1, seed: int = 0) -> float:
        """Bytes a second the disk gives reading `experts` experts nobody asked for (spread over
        the layers, `threads` at once) into scratch memory, the way a miss reads them: the rate
        a streamed run's reads are held against (`ds2 bench --memory-budget`). The slots and
        their counts are untouched; what was read leaves no page cache (O_DIRECT or dropped)."""
        rng = np.random.default_rng(seed)
        layers = sorted({layer for layer, _ in self.source.where})
        todo = collections.deque((layers[j % len(layers)], int(rng.integers(self.cfg.n_routed_experts))) for j in range(experts))
        lock, failed = threading.Lock(), []

        def work():
            scratch = {kind: (np.empty_like(st.qweight[0]), np.empty_like(st.scales[0]))
                       for kind, st in self.stacks.items()}
            try:
                while True:
                    with lock:
                        if not todo or failed:
                            return
                        layer, e = todo.popleft()
                    for kind, (qweight, scales) in scratch.items():
                        self.source.read(layer, e, kind, qweight, scales, self.pread)
            except BaseException as err:  # noqa: BLE001 - raised below, on the calling thread
                failed.append(err)
        t0 = time.perf_counter()
        pool = [threading.Thread(target=work, name="ds2-disk-rate") for _ in range(max(1, threads))]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        if failed:
            raise failed[0]
        return experts * self.source.read_bytes / (time.perf_counter() - t0)

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
        """A free slot, or the least recently used one's, never one asked for or in use. Under `lock`."""
        if self.free:
            return self.free.pop()
        for key in self.slot_of:
            if key not in keep and key not in self.in_use:
                self.ahead.discard(key)
                return self.slot_of.pop(key)
        return None

    def read(self, layer: int, e: int, slot: int) -> float:
        """Expert e of `layer` into `slot`, each of its matrices as the source says; the seconds it took."""
        t0 = time.perf_counter()
        for kind, stack in self.stacks.items():
            self.source.read(layer, e, kind, stack.qweight[slot], stack.scales[slot], self.pread)
        return time.perf_counter() - t0

    def pread(self, path, at: int, view: np.ndarray, e: int, layer: int) -> None:
        """`view.nbytes` bytes of `path` from `at` into `view` (uint8). Opened with O_DIRECT: the
        whole blocks around them into this thread's aligned buffer, then copied (O_DIRECT reads
        only aligned blocks into aligned memory); otherwise straight into `view`, in as few reads
        as the kernel allows, their pages then dropped from the page cache."""
        n = view.nbytes
        try:
            fd, direct = self.fd(path)
            if direct:
                lo = at - at % ALIGN
                span = -(-(at + n - lo) // ALIGN) * ALIGN
                buf = self.bounce(span)
                got = self.read_into(fd, buf[:span], lo, at + n - lo)
                if got < at + n - lo:
                    raise EOFError
                view[...] = buf[at - lo:at - lo + n]
            else:
                if self.read_into(fd, memoryview(view), at, n) < n:
                    raise EOFError
                os.posix_fadvise(fd, at, n, os.POSIX_FADV_DONTNEED)
        except EOFError:
            raise StreamingError(f"{path} ends before expert {e} of layer {layer} "
                                 f"(truncated after ds2 opened it?)") from None
        except OSError as err:
            raise StreamingError(f"cannot read expert {e} of layer {layer} from {path}: "
                                 f"{err.strerror}") from None

    @staticmethod
    def read_into(fd: int, buf, at: int, need: int) -> int:
        """Read into `buf` from `at` until `need` bytes are in or the file ends; how many came."""
        buf = memoryview(buf).cast("B")
        got = 0
        while got < need:
            k = os.preadv(fd, [buf[got:]], at + got)
            if k == 0:
                break
            got += k
        return got

    def bounce(self, n: int) -> np.ndarray:
        """This thread's page-aligned buffer of at least n bytes (an anonymous mapping)."""
        buf = getattr(self.local, "buf", None)
        if buf is None or buf.nbytes < n:
            buf = self.local.buf = np.frombuffer(mmap.mmap(-1, n), np.uint8)
        return buf


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
        shared_out = None
        if shared is not None and not all(cache.holds(layer, e) for e in pending):
            shared_out = ffn(self, [(shared, w.shared_gate_up, w.shared_down)])    # while the reads run
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
        outs = [done[int(e)] for e in ids]
        if shared is not None:
            outs += shared_out or ffn(self, [(shared, w.shared_gate_up, w.shared_down)])
        return outs

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
