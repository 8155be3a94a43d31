"""The expert cache of a streamed run (`--memory-budget`, weights/streaming.py): a fixed number
of *slots*, each holding one routed expert (its gate_up and down matrices) in shared memory,
filled from the model's file on a miss with one read a stored matrix into the slot. Where an
expert lies is its source's: StoredExperts for a ds2 low-bit checkpoint (here),
gguf/experts.GGUFExperts for a GGUF's stacked tensors. Reads bypass the page cache (O_DIRECT,
through an aligned buffer; where the file system refuses it, the pages read are dropped after)
and happen outside the cache's lock: one thread takes what is in the slots while others read,
and an expert being read is waited for, never read twice. A StreamedStack is a layer's experts
of one kind as the math sees them: `stack[e]` the slot holding expert e."""

from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np

from ds2cli.errors import Ds2Error
from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights import qcheckpoint
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
        # what ds2 quantize recorded for each expert (weights/checksums.py), checked on an
        # expert's first read in this process: a file changed after it was written is an error,
        # not another model's answers. Later reads of the same expert are not checked (hashing
        # every read would cost decode about what the reads do; docs/performance.md).
        self.sums: dict[str, list[str]] = {}
        self.checked: set[tuple[int, int, str]] = set()
        if self.where:
            from ds2cli.weights.checksums import recorded
            record = recorded(Path(next(iter(self.paths))).parent) or {}
            for (i, kind) in self.where:
                for part in ("qweight", "scales"):
                    name = f"{qcheckpoint.stored_name(i, 'mlp', kind)}.{part}"
                    if isinstance(record.get(name), list) and len(record[name]) == self.E:
                        self.sums[name] = record[name]
        first = min((i for i, _ in self.where), default=None)
        self.read_bytes = 0 if first is None else \
            sum(info.nbytes // self.E for kind in KINDS for info in self.where[first, kind])   # an expert, from disk

    def read(self, layer: int, e: int, kind: str, qweight: np.ndarray, scales: np.ndarray, pread,
             check: bool = True) -> None:
        """Expert e of `layer`'s `kind` into a slot's arrays: one read for each, checked against
        its recorded checksum on its first read (`check`: False for reads nobody uses)."""
        for part, info, dst in zip(("qweight", "scales"), self.where[layer, kind], (qweight, scales)):
            n = info.nbytes // self.E
            raw = dst.reshape(-1).view(np.uint8)
            pread(info.file, info.offset + e * n, raw, e, layer)
            if check:
                self.check(layer, e, kind, part, raw, info.file)

    def check(self, layer: int, e: int, kind: str, part: str, raw: np.ndarray, path) -> None:
        """The bytes just read of expert e against the checksum ds2 quantize recorded, once."""
        name = f"{qcheckpoint.stored_name(layer, 'mlp', kind)}.{part}"
        if name not in self.sums or (layer, e, name) in self.checked:
            return
        from ds2cli.weights.checksums import digest
        if digest(memoryview(raw)) != self.sums[name][e]:
            raise StreamingError(f"{path}: expert {e} of layer {layer} ({name}) does not match the checksum "
                                 f"ds2 quantize recorded (the file changed after it was written?); "
                                 f"ds2 inspect --verify checks the whole checkpoint")
        self.checked.add((layer, e, name))


class ExpertCache:
    """`slots` experts in memory, read from the model's files on a miss, least recently used out
    first. `source` says where each expert lies and how its bytes fill a slot (StoredExperts, a
    ds2 low-bit checkpoint; gguf/experts.GGUFExperts, a GGUF's stacked tensors). `stats`: hits,
    misses, reads ahead and those that were used, bytes read from disk."""

    direct = True                   # O_DIRECT where the file system allows it (see docs/performance.md)

    def __init__(self, cfg: DeepseekV2Config, source, slots: int, share: range | None = None):
        """`share`: the routed experts of each MoE layer it serves (default: all); expert e of
        a layer here is share.start + e of the checkpoint's (a node of a cluster spread by experts)."""
        self.cfg, self.source, self.slots = cfg, source, slots
        self.share = range(cfg.n_routed_experts or 0) if share is None else share
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
        self.buffers = Buffers()                          # aligned, for O_DIRECT reads
        self.files: dict = {}                             # path -> (fd, opened with O_DIRECT)
        self.opening = threading.Lock()
        self.system = os          # the calls it opens and reads files with (open, preadv); a test's own
        self.stats = {"hits": 0, "misses": 0, "read_ahead": 0, "read_ahead_used": 0, "bytes_read": 0,
                      "read_seconds": 0.0}

    def fd(self, path) -> tuple[int, bool]:
        """The file's descriptor, opened once: with O_DIRECT where the file system allows it
        (`direct`), so a read goes from the disk into the reader's buffer without the page cache."""
        with self.opening:                  # reading threads open files too: each file once
            if path not in self.files:
                try:
                    self.files[path] = self.open(path)
                except OSError as e:
                    raise StreamingError(f"cannot open {path}: {e.strerror}") from None
            return self.files[path]

    def open(self, path) -> tuple[int, bool]:
        if self.direct and hasattr(os, "O_DIRECT"):
            try:
                return self.system.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as e:
                if e.errno != errno.EINVAL:         # EINVAL: this file system has no O_DIRECT
                    raise
        return self.system.open(path, os.O_RDONLY), False

    def close(self) -> None:
        with self.opening:
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
        try:
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
        except BaseException:               # Ctrl-C or a failed read: what this call marked in use is not
            if use:
                self.release(layer, list(experts)[:len(out)])
            raise
        return out

    def disk_rate(self, experts: int = 24, threads: int = 1, seed: int = 0) -> float:
        """Bytes a second the disk gives reading `experts` experts nobody asked for (spread over
        the layers, `threads` at once) into scratch memory, the way a miss reads them: the rate
        a streamed run's reads are held against (`ds2 bench --memory-budget`). The slots and
        their counts are untouched; what was read leaves no page cache (O_DIRECT or dropped)."""
        rng = np.random.default_rng(seed)
        layers = sorted({layer for layer, _ in self.source.where})
        todo = collections.deque((layers[j % len(layers)], self.share.start + int(rng.integers(len(self.share))))
                                 for j in range(experts))
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
                        self.source.read(layer, e, kind, qweight, scales, self.pread, check=False)
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
            self.source.read(layer, self.share.start + e, kind, stack.qweight[slot], stack.scales[slot], self.pread)
        return time.perf_counter() - t0

    def pread(self, path, at: int, view: np.ndarray, e: int, layer: int) -> None:
        """`view.nbytes` bytes of `path` from `at` into `view` (uint8). Opened with O_DIRECT: the
        whole blocks around them into an aligned buffer lent for the read, then copied (O_DIRECT reads
        only aligned blocks into aligned memory); otherwise straight into `view`, in as few reads
        as the kernel allows, their pages then dropped from the page cache."""
        n = view.nbytes
        try:
            fd, direct = self.fd(path)
            if direct:
                lo = at - at % ALIGN
                span = -(-(at + n - lo) // ALIGN) * ALIGN
                with self.buffers.lend(span) as buf:
                    if self.read_into(fd, buf[:span], lo, at + n - lo) < at + n - lo:
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

    def read_into(self, fd: int, buf, at: int, need: int) -> int:
        """Read into `buf` from `at` until `need` bytes are in or the file ends; how many came."""
        buf = memoryview(buf).cast("B")
        got = 0
        while got < need:
            k = self.system.preadv(fd, [buf[got:]], at + got)
            if k == 0:
                break
            got += k
        return got


class Buffers:
    """Page-aligned buffers (anonymous mappings) lent to reading threads and given back: made
    once, not by every reader thread that starts (a fresh 6 MB buffer faults 1,400 pages)."""

    def __init__(self):
        self.free: list[np.ndarray] = []
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def lend(self, n: int):
        with self.lock:
            fits = [i for i, b in enumerate(self.free) if b.nbytes >= n]
            buf = self.free.pop(fits[0]) if fits else np.frombuffer(mmap.mmap(-1, n), np.uint8)
        try:
            yield buf
        finally:
            with self.lock:
                self.free.append(buf)


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
