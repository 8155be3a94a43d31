"""Fuzz the safetensors header of a real shard: whatever the bytes, reading the header and
loading the checkpoint raise nothing but a Ds2Error, never read more than the file holds, keep
memory within a small multiple of the file size, and finish quickly.

The shard is the smallest of the 10-shard reference case lite_like_plainq_yarn (21 bf16 tensors),
so a mutant that survives validation is loaded for real. Seeded (derandomize) and offline.
"""

import contextlib
import json
import shutil
import signal
import struct
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds2cli
from ds2cli.weights import checkpoint
from ds2cli.errors import Ds2Error

CASE = Path(__file__).parents[1] / "data" / "reference" / "lite_like_plainq_yarn"
SHARD = "model-00010-of-00010.safetensors"
ORIGINAL = (CASE / SHARD).read_bytes()
(HEADER_LEN,) = struct.unpack("<Q", ORIGINAL[:8])
HEADER = json.loads(ORIGINAL[8:8 + HEADER_LEN])
NAMES = [n for n in HEADER if n != "__metadata__"]
SECONDS_PER_CASE = 5
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return Path(shutil.copytree(CASE, tmp_path_factory.mktemp("fuzz") / "model",
                                ignore=shutil.ignore_patterns("ref.npz")))


@contextlib.contextmanager
def time_limit(seconds: float):
    """Turn a hang into a failure: SIGALRM raises in the main thread after `seconds`."""
    def expire(signum, frame):
        raise TimeoutError(f"a fuzz case took more than {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class RecordingFile:
    """A file whose read sizes are recorded, to check no read is sized beyond the file."""

    def __init__(self, f, reads: list[int]):
        self._f, self._reads = f, reads

    def read(self, n: int = -1) -> bytes:
        self._reads.append(n)
        return self._f.read(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


class RecordingShards(checkpoint.LocalShards):
    """A folder's shards whose files record every read's size (the header is read within limits)."""

    def __init__(self, model_dir: Path, reads: list[int]):
        super().__init__(model_dir)
        self.reads = reads

    def open(self, name: str):
        return RecordingFile(super().open(name), self.reads)


def check(model_dir: Path, data: bytes) -> None:
    """The properties, for one mutated shard."""
    path = model_dir / SHARD
    path.write_bytes(data)
    reads: list[int] = []
    with time_limit(SECONDS_PER_CASE):
        tracemalloc.start()
        try:
            checkpoint.read_header(path, RecordingShards(model_dir, reads))
        except Ds2Error as e:
            assert str(e)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    assert reads and all(0 <= n <= max(8, len(data)) for n in reads), reads  # 8: the length prefix
    assert peak < 4 * len(data) + 256 * 1024, f"read_header peaked at {peak} bytes for a {len(data)}-byte file"
    with time_limit(SECONDS_PER_CASE):
        try:
            ds2cli.load(model_dir)
        except Ds2Error as e:
            assert str(e)


# ---- raw bytes: flips, insertions, deletions; a new length prefix, truncation ----

JSONISH = st.sampled_from(b'0123456789[]{},":-.eE \\ntfn')
BYTE = st.one_of(JSONISH, st.integers(0, 255))
position = st.integers(0, 8 + HEADER_LEN + 16)
# a digit changed into another digit keeps the JSON valid and moves an offset or a dimension
DIGITS = [8 + i for i, b in enumerate(ORIGINAL[8:8 + HEADER_LEN]) if chr(b).isdigit()]
edit = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(DIGITS), st.sampled_from(b"0123456789")),
    st.tuples(st.just("set"), position, BYTE),
    st.tuples(st.just("insert"), position, st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), position, st.integers(1, 8)),
)


def apply_bytes(edits) -> bytes:
    data = bytearray(ORIGINAL)
    for kind, at, arg in edits:
        if kind == "set":
            data[at] = arg
        elif kind == "insert":
            data[at:at] = arg
        else:
            del data[at:at + arg]
    return bytes(data)


@pytest.mark.slow
@FUZZ
@given(edits=st.lists(edit, min_size=1, max_size=6))
def test_mutated_header_bytes(model_dir, edits):
    check(model_dir, apply_bytes(edits))


@settings(FUZZ, max_examples=60)
@given(length=st.none() | st.integers(0, 2**64 - 1) | st.integers(0, len(ORIGINAL)),
       cut=st.integers(0, len(ORIGINAL)))
def test_mutated_length_prefix_and_truncation(model_dir, length, cut):
    data = ORIGINAL if length is None else struct.pack("<Q", length) + ORIGINAL[8:]
    check(model_dir, data[:cut])


# ---- valid JSON, hostile values: the header parses but its entries lie ----

huge_ints = st.sampled_from([-1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, 10**4000])
ints = st.integers(-10, 300_000) | huge_ints
# Placeholders that apply_entries swaps for raw JSON json.dumps cannot write: an integer of
# 5000 digits (Python refuses to parse it) and nesting 5000 deep (a RecursionError).
RAW = {b'"<huge>"': b"9" * 5000, b'"<deep>"': b"[" * 5000 + b"]" * 5000}
scalars = st.none() | st.booleans() | ints | st.floats() | st.text(max_size=6) | st.sampled_from(
    [*checkpoint.DTYPE_SIZES, "F12", "bf16", "", "<huge>", "<deep>"])
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
FIELDS = ["shape", "data_offsets", "dtype"]
field_value = st.one_of(
    st.tuples(st.just("shape"), st.lists(ints, max_size=5) | st.lists(st.integers(0, 128), max_size=3)),
    st.tuples(st.just("data_offsets"), st.lists(ints, max_size=3)),
    st.tuples(st.just("dtype"), st.sampled_from([*checkpoint.DTYPE_SIZES, "F12", "", "f32"])),
    st.tuples(st.sampled_from(FIELDS), values),
    st.tuples(st.sampled_from(["shape", "data_offsets"]), st.lists(ints | st.sampled_from(["<huge>", "<deep>"]),
                                                                   min_size=1, max_size=3)),
)
entry_edit = st.one_of(
    st.tuples(st.just("field"), st.integers(0, len(NAMES) - 1), field_value),
    st.tuples(st.just("shift"), st.integers(0, len(NAMES) - 1), st.tuples(st.integers(0, 1), st.integers(-4096, 4096))),
    st.tuples(st.just("drop_field"), st.integers(0, len(NAMES) - 1), st.sampled_from(FIELDS)),
    st.tuples(st.just("drop"), st.integers(0, len(NAMES) - 1), st.none()),
    st.tuples(st.just("copy"), st.integers(0, len(NAMES) - 1), st.integers(0, len(NAMES) - 1)),
    st.tuples(st.just("replace"), st.integers(0, len(NAMES) - 1), values),
    st.tuples(st.just("metadata"), st.integers(0, 0), values),
)


def apply_entries(edits) -> bytes:
    header = json.loads(json.dumps(HEADER))
    for kind, i, arg in edits:
        name = NAMES[i]
        if name not in header and kind != "metadata":
            continue
        if kind == "field" and isinstance(header[name], dict):
            header[name][arg[0]] = arg[1]
        elif kind == "shift" and isinstance(header[name], dict):
            offs = header[name].get("data_offsets")
            if isinstance(offs, list) and len(offs) == 2 and all(isinstance(v, int) for v in offs):
                offs[arg[0]] += arg[1]
        elif kind == "drop_field" and isinstance(header[name], dict):
            header[name].pop(arg, None)
        elif kind == "drop":
            del header[name]
        elif kind == "copy":
            header[NAMES[arg]] = header[name]
        elif kind == "replace":
            header[name] = arg
        elif kind == "metadata":
            header["__metadata__"] = arg
    head = json.dumps(header).encode()
    for placeholder, raw in RAW.items():
        head = head.replace(placeholder, raw)
    return struct.pack("<Q", len(head)) + head + ORIGINAL[8 + HEADER_LEN:]


@pytest.mark.slow
@FUZZ
@given(edits=st.lists(entry_edit, min_size=1, max_size=4))
def test_hostile_header_entries(model_dir, edits):
    check(model_dir, apply_entries(edits))


def test_the_unmutated_shard_loads(model_dir):
    (model_dir / SHARD).write_bytes(ORIGINAL)
    assert len(checkpoint.read_header(model_dir / SHARD)) == len(NAMES)
    assert ds2cli.load(model_dir).config.num_hidden_layers == 4
