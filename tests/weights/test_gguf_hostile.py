"""GGUF files whose counts, dimensions, offsets or metadata types lie: each is found before
anything is allocated or iterated, and ends as one error naming the tensor or key (a problem line
in `ds2 inspect`), never a hang, a traceback or garbage generated with exit 0. Every file is
built here from a reference checkpoint by tests/support/gguf_writer.py, then patched byte by byte."""

import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from conftest import REFERENCE
from support.gguf_writer import write_gguf
from ds2cli.errors import Ds2Error
from ds2cli.weights.gguf.checkpoint import open_model
from ds2cli.weights.gguf.file import GGUFError, GGUFFile, find

CASE = REFERENCE / "lite_like_plainq_yarn"


def tensor_info_at(raw: bytes, name: str) -> int:
    """Where the tensor info of `name` starts: its name's u64 length, then the name itself."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = raw.find(key)
    assert at > 0, name
    return at + len(key)


def patch_tensor(path: Path, name: str, dims=None, offset=None) -> None:
    """Rewrite a tensor info's dimensions (same count) or data offset in place."""
    raw = bytearray(path.read_bytes())
    at = tensor_info_at(bytes(raw), name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    if dims is not None:
        assert len(dims) == n_dims
        struct.pack_into(f"<{n_dims}Q", raw, at + 4, *dims)
    if offset is not None:
        struct.pack_into("<Q", raw, at + 4 + 8 * n_dims + 4, offset)
    path.write_bytes(bytes(raw))


def tensor_offset(path: Path, name: str) -> int:
    raw = path.read_bytes()
    at = tensor_info_at(raw, name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    return struct.unpack_from("<Q", raw, at + 4 + 8 * n_dims + 4)[0]


def tensor_dims(path: Path, name: str) -> list[int]:
    raw = path.read_bytes()
    at = tensor_info_at(raw, name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    return list(struct.unpack_from(f"<{n_dims}Q", raw, at + 4))


@pytest.fixture(scope="module")
def q8(tmp_path_factory) -> Path:
    return write_gguf(CASE, tmp_path_factory.mktemp("gguf") / "m.gguf", "Q8_0")


def copy(src: Path, tmp_path: Path) -> Path:
    out = tmp_path / "m.gguf"
    out.write_bytes(src.read_bytes())
    return out


def opened(path: Path):
    """Open the file as every command does; return the error or the model."""
    tracemalloc.start()
    try:
        model = open_model(path)
        model.tokenizer()
        model.generation_config
        return model, tracemalloc.get_traced_memory()[1]
    except Ds2Error as e:
        return e, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


EXPS = "blk.1.ffn_gate_exps.weight"


@pytest.mark.parametrize("spoil, message", [
    (lambda p: patch_tensor(p, EXPS, dims=[tensor_dims(p, EXPS)[0], 0, 10 ** 15]), "dimension of 0"),
    (lambda p: patch_tensor(p, "blk.0.attn_q.weight", dims=[33, tensor_dims(p, "blk.0.attn_q.weight")[1]]),
     "do not fit"),
    (lambda p: patch_tensor(p, EXPS, offset=tensor_offset(p, EXPS) + 1), "alignment"),
    (lambda p: patch_tensor(p, EXPS, offset=0), "overlap"),
    (lambda p: [patch_tensor(p, n, offset=0) for n in ("blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight")],
     "overlap"),
], ids=["zero_dim_huge_count", "blocks_do_not_fit", "misaligned", "expert_on_embedding", "experts_overlap"])
def test_tensor_infos_that_lie_are_errors_naming_the_tensor(q8, tmp_path, spoil, message):
    path = copy(q8, tmp_path)
    spoil(path)
    with pytest.raises(GGUFError, match=message):
        GGUFFile(find(path))


def meta(**kv):
    def add(w):
        for key, (kind, value) in kv.items():
            getattr(w, f"add_{kind}")(key, value)
    return add


@pytest.mark.slow
@pytest.mark.parametrize("metadata, message", [
    (meta(**{"deepseek2.expert_count": ("uint32", 10 ** 9)}), "expert_count is 1000000000"),
    (meta(**{"deepseek2.attention.head_count": ("uint32", 0)}), "head_count is 0"),
    (meta(**{"deepseek2.block_count": ("uint32", 100_000)}), "block_count is 100000"),
    (meta(**{"general.sampling.temp": ("string", "hot")}), "general.sampling.temp should be a number"),
    (meta(**{"tokenizer.ggml.token_type": ("array", ["1"] * 4)}), "token_type must be a list of integers"),
], ids=["expert_count_beyond_tensors", "zero_heads", "block_count_beyond_tensors", "sampling_type",
        "token_type_type"])
def test_metadata_that_lies_is_an_error_naming_the_key(tmp_path, metadata, message):
    path = write_gguf(CASE, tmp_path / "m.gguf", "F32", metadata=metadata)
    got, peak = opened(path)
    assert isinstance(got, Ds2Error) and message in str(got), got
    assert peak < 64 << 20                 # nothing was built per claimed expert


def test_a_duplicate_metadata_key_is_an_error(tmp_path):
    path = write_gguf(CASE, tmp_path / "m.gguf", "F32",
                      metadata=meta(**{"ds2test.aaaa": ("uint32", 1), "ds2test.bbbb": ("uint32", 2)}))
    path.write_bytes(path.read_bytes().replace(b"ds2test.bbbb", b"ds2test.aaaa"))
    with pytest.raises(GGUFError, match="Duplicate"):
        GGUFFile(find(path))


def run(*args):
    return subprocess.run([sys.executable, "-m", "ds2cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_the_cli_says_one_line_and_inspect_lists_the_problem(q8, tmp_path):
    path = copy(q8, tmp_path)
    patch_tensor(path, EXPS, offset=0)
    r = run("generate", "-m", path, "hi", "-n", "2")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "overlap" in lines[0] and r.stdout == ""
    r = run("inspect", path)
    assert r.returncode == 1 and "overlap" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_gguf_without_tensors_is_inspected_without_a_traceback(tmp_path):
    """Full metadata, not one tensor: inspect lists what is missing (exit 1), as JSON too."""
    import json
    from support.gguf_writer import gguf_tensors
    from ds2cli.model.config import DeepseekV2Config
    names = tuple(gguf_tensors(CASE, DeepseekV2Config.from_file(CASE / "config.json"), "split"))
    path = write_gguf(CASE, tmp_path / "empty.gguf", "F32", drop=names)
    r = run("inspect", path, "--json")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    report = json.loads(r.stdout)
    assert report["n_tensors"] == 0 and report["problems"] == [
        "empty.gguf: GGUF metadata deepseek2.expert_count is 16, but the file holds no expert tensors"]
    r = run("generate", "-m", path, "hi")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "no expert tensors" in r.stderr
