"""A GGUF checkpoint on disk: one file, a directory holding one, or the parts of a split file.

The files are read by the `gguf` package (llama.cpp's own reader, gguf-py), which memory-maps
them: its header parsing is reused as is, so ds2 does not carry a GGUF parser of its own. What
this module adds is what a user needs to hear when a file is not what it should be: a file is
recognised by its magic bytes, never by its name (ollama keeps its models as `sha256-...` blobs
without an extension); a missing part of a split file, a truncated file and a tensor type ds2
cannot read are errors that name the file and the tensor.
"""

from __future__ import annotations

import math
import mmap
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ds2cli.errors import CheckpointError

MAGIC = b"GGUF"
# gguf-split names the parts `<prefix>-00001-of-00003.gguf` and stores split.no / split.count
SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# The tensor types ds2 reads: the float types and the block types llama.cpp's common files use
# (a Q4_K_M file mixes Q4_K, Q5_0, Q6_K and Q8_0). gguf.quants dequantizes each in NumPy.
MAX_DIMS = 4                 # GGML_MAX_DIMS
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


class GGUFError(CheckpointError):
    """A GGUF file that cannot be read: not GGUF, truncated, a part missing, an unknown type."""


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def find(path: str | Path) -> list[Path] | None:
    """The GGUF file(s) `path` names, first part first; None when `path` is not a GGUF (a file
    without the magic, or a directory with a config.json or without any GGUF file)."""
    path = Path(path).expanduser()
    if path.is_file():
        return parts_of(path) if is_gguf(path) else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.is_file() and is_gguf(p))
    firsts = [p for p in found if not SPLIT_NAME.match(p.name) or SPLIT_NAME.match(p.name)["no"] == "00001"]
    if not found:
        return None
    if len(firsts) > 1:
        names = ", ".join(p.name for p in firsts)
        raise GGUFError(f"{path} holds several GGUF models ({names}): pass the one to load with -m {path}/NAME")
    return parts_of(firsts[0] if firsts else found[0])


def parts_of(path: Path) -> list[Path]:
    """All parts of a split GGUF given any one of them (a plain file is its only part)."""
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['prefix']}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(f"split GGUF {parts[0].name}: part{'s' * (len(missing) > 1)} "
                        f"{', '.join(missing)} missing from {path.parent}")
    return parts


def _reader_class():
    """gguf's GGUFReader, checking each tensor before the reader views it: the plain reader
    fails on an unknown type or a truncated file with a message that names neither the tensor
    nor the file. Imported when used: gguf costs ~0.2 s to import."""
    import gguf

    class Reader(gguf.GGUFReader):
        def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
            # The same views as GGUFReader._get, taken from a plain ndarray over the map: slicing
            # the np.memmap itself is slow, and a tokenizer's 200k strings and ids are read one
            # call each (DeepSeek-V2's vocabulary: 5.8 s with gguf's _get, 1.4 s with this one).
            raw = self.__dict__.get("_raw")
            if raw is None:
                raw = self.__dict__["_raw"] = self.data.view(np.ndarray)
            dtype = np.dtype(dtype)
            arr = raw[offset:offset + dtype.itemsize * int(count)]
            if dtype != np.uint8:
                arr = arr.view(dtype)
            order = self.byte_order if override_order is None else override_order
            if order == "I" or (order == "<" and sys.byteorder == "little"):
                return arr
            return arr.view(arr.dtype.newbyteorder(order))

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            """Every tensor's dimensions, type, alignment and bytes checked against the file and
            each other before the reader views any of them (Python ints: no overflow)."""
            spans = []
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    kind = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise GGUFError(f"tensor {name} has GGML type {int(raw_dtype[0])}, which gguf "
                                    f"does not know") from None
                shape = [int(d) for d in dims]                     # innermost first, as stored
                if not 1 <= len(shape) <= MAX_DIMS:
                    raise GGUFError(f"tensor {name} has {len(shape)} dimensions (GGUF allows 1 to {MAX_DIMS})")
                if min(shape) < 1:
                    raise GGUFError(f"tensor {name} has a dimension of 0 in {shape}: it holds nothing")
                block, size = gguf.GGML_QUANT_SIZES[kind]
                if shape[0] % block:
                    raise GGUFError(f"tensor {name} is {kind.name}, whose blocks of {block} values do not "
                                    f"fit its rows of {shape[0]}")
                rel = int(offset[0])
                if rel % self.alignment:
                    raise GGUFError(f"tensor {name} starts at data offset {rel}, not a multiple of the "
                                    f"file's alignment ({self.alignment})")
                start = start_offs + rel
                end = start + math.prod(shape) // block * size
                if end > len(self.data):
                    raise GGUFError(f"tensor {name} ends at byte {end}, past the end of the file "
                                    f"({len(self.data)} bytes): the file is truncated")
                spans.append((start, end, name))
            spans.sort()
            for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
                if start < end:
                    raise GGUFError(f"tensors {a} and {b} overlap in the file (bytes {start} to {end})")
            super()._build_tensors(start_offs, fields)

    return Reader


class GGUFFile:
    """The parts of one GGUF model, read: `fields` (the first part's metadata, name -> value),
    `tensors` (name -> gguf ReaderTensor, over all parts), `part_of` (name -> the part holding
    it: its data_offset counts from that file's start), `paths`, `nbytes` on disk."""

    def __init__(self, paths: list[Path]):
        self.paths = paths
        self.fields: dict[str, Any] = {}
        self.tensors: dict = {}
        self.part_of: dict[str, Path] = {}
        self.maps: dict = {}
        Reader = _reader_class()
        for k, path in enumerate(paths):
            try:
                reader = Reader(path)
            except GGUFError as e:
                raise GGUFError(f"{path.name}: {e}") from None
            except (ValueError, IndexError, OverflowError, TypeError, UnicodeDecodeError, KeyError) as e:
                # KeyError: gguf's reader on a duplicate metadata key
                raise GGUFError(f"{path.name} is not a readable GGUF file (truncated or corrupt header: {e})") from None
            except OSError as e:
                raise GGUFError(f"cannot read {path}: {e.strerror or e}") from None
            if k == 0:
                self.fields = {name: field_value(f) for name, f in reader.fields.items()}
            for t in reader.tensors:
                self.tensors[t.name] = t
                self.part_of[t.name] = path
                self.maps[t.name] = reader.data._mmap     # np.memmap's mmap: see release()
        count = self.fields.get("split.count")
        if count is not None and count != len(paths):
            raise GGUFError(f"{paths[0].name} says it is split in {count} parts, but {len(paths)} were found")
        self.nbytes = sum(p.stat().st_size for p in paths)

    @property
    def name(self) -> str:
        return self.paths[0].name

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def release(self, name: str, index: int | None = None) -> None:
        """Drop a tensor's pages (with `index`, one expert's slab of a stacked tensor) from this
        process once it has been converted. The file stays mapped, and every page read would
        count in the process's RSS until the end: a 16.7 GB Q8_0 file would show as 16.7 GB
        beside the 15.9 GB of weights converted from it (the pages stay in the page cache;
        MADV_DONTNEED only unmaps them from this process, and a page shared with the next slab
        is read back from the cache)."""
        m, t = self.maps.get(name), self.tensors.get(name)
        if m is None or not hasattr(m, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        first, n_bytes = t.data_offset, int(t.n_bytes)
        if index is not None:
            n_bytes //= t.data.shape[0]
            first += index * n_bytes
        start = first - first % mmap.PAGESIZE
        length = first + n_bytes - start
        try:
            m.madvise(mmap.MADV_DONTNEED, start, length)
        except (OSError, ValueError):
            pass                                          # only memory accounting is at stake

    def unsupported(self) -> list[str]:
        """Every tensor whose type ds2 cannot read, one message each."""
        return [f"tensor {name} has type {t.tensor_type.name}, which ds2 does not read "
                f"(it reads {', '.join(SUPPORTED_TYPES)})"
                for name, t in self.tensors.items() if t.tensor_type.name not in SUPPORTED_TYPES]


def field_value(field) -> Any:
    """A metadata field as a Python value: str, int, float, bool, or a list of them."""
    import gguf
    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return field.contents()
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", "replace")
    return field.contents()


# gguf.quants.dequantize works through a tensor in groups of 16 rows and concatenates them:
# its own block math, handed chunks of this many values into a preallocated output instead,
# gives the same floats several times faster (docs/performance.md, "Why the constants are what
# they are"), and dequantizing is what a GGUF load spends its time on.
DEQUANTIZE_CHUNK_VALUES = 1 << 18


def dequantize(tensor, index: int | None = None) -> np.ndarray:
    """A tensor (or the `index`th slab of a stacked one) as float32 in NumPy order: GGUF lists
    dimensions innermost first, and gguf's reader already hands them out reversed, so a 2-D
    weight comes out (out, in) as Hugging Face stores it."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import _type_traits, dequantize as gguf_dequantize, quant_shape_from_byte_shape
    data = tensor.data if index is None else tensor.data[index]
    kind = tensor.tensor_type
    if kind.name not in SUPPORTED_TYPES:
        raise GGUFError(f"tensor {tensor.name} has type {kind.name}, which ds2 does not read "
                        f"(it reads {', '.join(SUPPORTED_TYPES)})")
    if kind in (T.F32, T.F16) or data.ndim == 0:
        return np.ascontiguousarray(gguf_dequantize(data, kind), dtype=np.float32)
    traits = _type_traits[kind]
    rows = data.reshape(-1, data.shape[-1])                                  # (n, bytes a row)
    width = quant_shape_from_byte_shape(rows.shape, kind)[-1]
    out = np.empty((rows.shape[0], width), np.float32)                       # (n, values a row)
    step = max(1, DEQUANTIZE_CHUNK_VALUES // width)
    for i in range(0, rows.shape[0], step):
        out[i:i + step] = traits.dequantize_rows(rows[i:i + step])
    return out.reshape(*data.shape[:-1], width)
