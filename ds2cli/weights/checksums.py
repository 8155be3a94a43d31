"""Checksums of a checkpoint's tensors: what `ds2 quantize` records in the index it writes
(model.safetensors.index.json's "checksums"), and the stored bytes checked against them
(`ds2 inspect --verify`).

A checksum is BLAKE2b with a 16-byte digest of a tensor's raw bytes as stored. A stack of
routed experts, (E, ...) in one tensor, gets one for each expert (its [e] slice), so that a
wrong expert is named and a reader of one expert can check it alone. The index, a .json beside
the shards, is hashed whole by weights/fingerprint.py: a cluster's nodes compare these records
without reading a weight. The stored bytes are read through a memory map, a chunk at a time,
never converted or copied.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import numpy as np

from ds2cli.errors import CheckpointError
from ds2cli.json_files import read_json_object
from ds2cli.weights.checkpoint import INDEX_NAME, TensorInfo

ALGORITHM = "blake2b-128"
CHUNK = 16 << 20              # bytes hashed at a time: the GIL is released for each (hashlib does)


def digest(data: memoryview) -> str:
    """The hex checksum of `data`, hashed CHUNK bytes at a time."""
    h = hashlib.blake2b(digest_size=16)
    for at in range(0, len(data), CHUNK):
        h.update(data[at:at + CHUNK])
    return h.hexdigest()


def of_array(a: np.ndarray, stacked: bool) -> str | list[str]:
    """The checksum of an array's bytes as a safetensors file stores them (C order); a stack of
    experts (`stacked`): one for each a[e]."""
    raw = np.ascontiguousarray(a)
    if stacked:
        return [digest(memoryview(raw[e].reshape(-1).view(np.uint8))) for e in range(raw.shape[0])]
    return digest(memoryview(raw.reshape(-1).view(np.uint8)))


def of_arrays(arrays: Iterable[tuple[str, np.ndarray]], stacked: Callable[[str], bool]) -> dict:
    """{name: checksum, or a stack's list of them} for the (name, array) pairs a shard holds."""
    return {name: of_array(a, stacked(name)) for name, a in arrays}


def index_record(checksums: dict) -> dict:
    """What the index holds under "checksums"."""
    return {"algorithm": ALGORITHM, "tensors": dict(sorted(checksums.items()))}


def recorded(model_dir: Path) -> dict | None:
    """{name: checksum or list} recorded in the directory's index, or None when it records none
    (a float checkpoint, or a ds2 checkpoint written before checksums were)."""
    index = Path(model_dir) / INDEX_NAME
    record = read_json_object(index, CheckpointError).get("checksums") if index.is_file() else None
    if record is None:
        return None
    algorithm = record.get("algorithm") if isinstance(record, dict) else record
    if algorithm != ALGORITHM:
        raise CheckpointError(f"{INDEX_NAME}: checksums of an algorithm ds2 does not know "
                              f"({json.dumps(algorithm)[:40]}; it writes {ALGORITHM})")
    tensors = record.get("tensors")
    if not isinstance(tensors, dict) or not all(
            isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(x, str) for x in v))
            for v in tensors.values()):
        raise CheckpointError(f"{INDEX_NAME}: checksums.tensors must map each tensor to a checksum or a list of them")
    return tensors


@dataclasses.dataclass
class Verified:
    """What `verify` found: the tensors whose bytes match, the routed experts all of whose
    tensors do (each counted once however many tensors it spans), and one line a problem."""
    tensors: int = 0
    experts: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return {"tensors_verified": self.tensors, "experts_verified": self.experts, "failed": len(self.problems)}


class Unit(NamedTuple):
    """A tensor's bytes, or one expert's of a stack, and the checksum recorded for them."""
    name: str
    expert: int | None
    file: Path
    start: int
    size: int
    want: str


def verify(tensors: dict[str, TensorInfo], checksums: dict, workers: int | None = None) -> Verified:
    """Every tensor's stored bytes against its recorded checksum (a stack's experts each against
    its own), read by memory map, several at once (hashing releases the GIL); a tensor with no
    checksum, or a checksum with no tensor, is a problem too."""
    out, units = Verified(), []
    for name in sorted(set(tensors) | set(checksums)):
        t, want = tensors.get(name), checksums.get(name)
        if t is None:
            out.problems.append(f"tensor {name} has a checksum but is not in the checkpoint")
        elif want is None:
            out.problems.append(f"tensor {name} has no checksum in {INDEX_NAME}")
        elif isinstance(want, str):
            units.append(Unit(name, None, t.file, t.offset, t.nbytes, want))
        elif not t.shape or t.shape[0] != len(want) or t.nbytes % len(want):
            out.problems.append(f"tensor {name} has {len(want)} expert checksums for a stack of shape {list(t.shape)}")
        else:
            size = t.nbytes // len(want)
            units += [Unit(name, e, t.file, t.offset + e * size, size, w) for e, w in enumerate(want)]
    wrong = [u for u, ok in zip(units, matches(units, workers)) if not ok]
    out.problems += [f"tensor {u.name}{'' if u.expert is None else f' expert {u.expert}'} does not match "
                     f"its checksum" for u in wrong]
    out.tensors = len({u.name for u in units} - {u.name for u in wrong})
    out.experts = len({expert_of(u) for u in units if u.expert is not None} - {expert_of(u) for u in wrong})
    return out


def expert_of(u: Unit) -> tuple[str, int | None]:
    """Which expert a unit is part of: its layer's MoE block (the name without its matrix and
    part, `model.layers.3.mlp` of `model.layers.3.mlp.experts_down.qweight`) and its index."""
    return u.name.rsplit(".", 2)[0], u.expert


def matches(units: list[Unit], workers: int | None = None) -> list[bool]:
    """Whether each unit's bytes hash to its checksum: each file mapped once, units hashed on
    `workers` threads (default: the cores, at most 4). A file shorter than a unit's end fails it."""
    maps: dict[Path, mmap.mmap | None] = {}
    try:
        for file in sorted({u.file for u in units}):
            try:
                with open(file, "rb") as f:
                    maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else None
            except (OSError, ValueError) as e:
                raise CheckpointError(f"cannot map {file}: {getattr(e, 'strerror', None) or e}") from None

        def match(u: Unit) -> bool:
            m = maps[u.file]
            if m is None or u.start + u.size > len(m):
                return False
            with memoryview(m)[u.start:u.start + u.size] as view:
                return digest(view) == u.want

        with ThreadPoolExecutor(workers or min(4, os.cpu_count() or 1)) as pool:
            return list(pool.map(match, units))
    finally:
        for m in maps.values():
            if m is not None:
                m.close()
