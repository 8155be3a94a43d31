"""Weights are what they claim: `ds2 quantize` records a checksum per tensor (per expert in a
stack of routed experts) in its index; `ds2 inspect --verify` reads the stored bytes by memory
map and names the tensor, or the expert, that differs; the fingerprint a cluster's nodes compare
covers those checksums, so a copy of other weights with the same shapes is another checkpoint."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ds2cli.cli.main import main
from ds2cli.errors import CheckpointError
from ds2cli.weights import checkpoint, checksums, qcheckpoint
from ds2cli.weights.fingerprint import fingerprint
from ds2cli.weights.source import bundled_model_dir

STACK = "model.layers.1.mlp.experts_down.qweight"


def write_shard(tmp_path: Path) -> tuple[dict, dict]:
    """A shard with a stack of four experts and a plain tensor, and the checksums quantize records."""
    rng = np.random.default_rng(0)
    arrays = [(STACK, rng.integers(-128, 128, (4, 16, 8), dtype=np.int8)),
              ("model.norm.weight", rng.standard_normal(32).astype(np.float32))]
    qcheckpoint.write_safetensors(tmp_path / "model.safetensors", arrays)
    sums = checksums.of_arrays(arrays, qcheckpoint.is_expert_stack)
    return checkpoint.read_header(tmp_path / "model.safetensors"), sums


def flip_byte(t: checkpoint.TensorInfo, at: int) -> None:
    """One bit of the stored tensor `t`, `at` bytes into it, flipped: the file keeps its size."""
    with open(t.file, "r+b") as f:
        f.seek(t.offset + at)
        b = f.read(1)[0]
        f.seek(t.offset + at)
        f.write(bytes([b ^ 1]))


def test_a_stack_gets_one_checksum_an_expert_and_a_tensor_one():
    assert qcheckpoint.is_expert_stack(STACK) and qcheckpoint.is_expert_stack("model.layers.3.mlp.experts_gate_up.scales")
    assert not qcheckpoint.is_expert_stack("model.layers.3.mlp.shared_gate_up.qweight")
    a = np.arange(4 * 6, dtype=np.int8).reshape(4, 6)
    per_expert = checksums.of_array(a, stacked=True)
    assert len(per_expert) == 4 and per_expert[2] == checksums.digest(memoryview(a[2].tobytes()))
    assert checksums.of_array(a, stacked=False) == checksums.digest(memoryview(a.tobytes()))
    assert checksums.of_array(np.asfortranarray(a), False) == checksums.of_array(a, False)   # as stored: C order


def test_stored_bytes_that_match_are_counted(tmp_path):
    tensors, sums = write_shard(tmp_path)
    v = checksums.verify(tensors, sums)
    assert (v.tensors, v.experts, v.problems) == (2, 4, [])


def test_the_expert_or_tensor_whose_bytes_differ_is_named(tmp_path):
    tensors, sums = write_shard(tmp_path)
    flip_byte(tensors[STACK], 2 * 16 * 8 + 5)          # expert 2's sixth byte
    flip_byte(tensors["model.norm.weight"], 0)
    v = checksums.verify(tensors, sums, workers=2)
    assert v.problems == ["tensor model.layers.1.mlp.experts_down.qweight expert 2 does not match its checksum",
                          "tensor model.norm.weight does not match its checksum"]
    assert (v.tensors, v.experts) == (0, 3)


def test_a_tensor_without_its_checksum_and_a_checksum_without_its_tensor_are_problems(tmp_path):
    tensors, sums = write_shard(tmp_path)
    sums = {**{k: v for k, v in sums.items() if k != "model.norm.weight"}, "lm_head.qweight": "00" * 16}
    sums[STACK] = sums[STACK][:3]
    v = checksums.verify(tensors, sums)
    assert v.problems == ["tensor lm_head.qweight has a checksum but is not in the checkpoint",
                          "tensor model.layers.1.mlp.experts_down.qweight has 3 expert checksums for a stack of "
                          "shape [4, 16, 8]",
                          "tensor model.norm.weight has no checksum in model.safetensors.index.json"]


def test_the_index_record_is_read_as_untrusted(tmp_path):
    assert checksums.recorded(tmp_path) is None                 # no index
    index = tmp_path / checkpoint.INDEX_NAME
    index.write_text(json.dumps({"weight_map": {}}))
    assert checksums.recorded(tmp_path) is None                 # an index without checksums
    index.write_text(json.dumps({"weight_map": {}, "checksums": {"algorithm": "md5", "tensors": {}}}))
    with pytest.raises(CheckpointError, match="checksums of an algorithm ds2 does not know"):
        checksums.recorded(tmp_path)
    index.write_text(json.dumps({"weight_map": {}, "checksums": {"algorithm": checksums.ALGORITHM,
                                                                 "tensors": {"a": 3}}}))
    with pytest.raises(CheckpointError, match="must map each tensor to a checksum"):
        checksums.recorded(tmp_path)


# ---- through the commands, on ds2-tiny's 8-bit copy ----

@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    dst = tmp_path_factory.mktemp("verify") / "tiny-q8"
    r = CliRunner().invoke(main, ["quantize", str(bundled_model_dir()), str(dst), "--bits", "8"])
    assert r.exit_code == 0, r.stderr
    return dst


@pytest.mark.slow
def test_quantize_records_every_tensor_and_each_expert(q8):
    record = json.loads((q8 / checkpoint.INDEX_NAME).read_text())["checksums"]
    stored = checkpoint.read_headers(q8)
    assert record["algorithm"] == checksums.ALGORITHM and set(record["tensors"]) == set(stored)
    stacks = {n: v for n, v in record["tensors"].items() if isinstance(v, list)}
    assert len(stacks) == 5 * 4 and all(len(v) == 8 for v in stacks.values())   # 5 MoE layers, 8 experts


@pytest.mark.slow
def test_inspect_verify_passes_then_names_the_corrupted_expert(q8, tmp_path):
    r = CliRunner().invoke(main, ["inspect", str(q8), "--verify", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["verify"] == {"tensors_verified": 138, "experts_verified": 40, "failed": 0}
    assert r.stderr == "verified 138 tensors, each of 40 routed experts on its own, against their checksums\n"
    bad = Path(shutil.copytree(q8, tmp_path / "bad"))
    t = checkpoint.read_headers(bad)["model.layers.3.mlp.experts_gate_up.qweight"]
    flip_byte(t, 5 * (t.nbytes // 8) + 77)             # expert 5
    r = CliRunner().invoke(main, ["inspect", str(bad), "--verify", "--json"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr == ("error: the checkpoint has 1 problem (listed above); first: tensor "
                        "model.layers.3.mlp.experts_gate_up.qweight expert 5 does not match its checksum\n")
    report = json.loads(r.stdout)
    assert report["verify"] == {"tensors_verified": 137, "experts_verified": 39, "failed": 1}
    r = CliRunner().invoke(main, ["inspect", str(bad), "--verify"])     # the tables, the problem in them
    assert r.exit_code == 1 and "expert 5 does not match its checksum" in " ".join(r.stdout.split())


@pytest.mark.slow
def test_verify_without_checksums_is_a_problem_not_a_pass():
    r = CliRunner().invoke(main, ["inspect", "--verify", "--json"])    # ds2-tiny: a float checkpoint
    assert r.exit_code == 1 and json.loads(r.stdout)["verify"]["tensors_verified"] == 0
    assert "records no checksums to check the weights against" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.slow
def test_other_weights_of_the_same_shapes_are_another_fingerprint(q8, tmp_path):
    """A copy quantized from other weights (every shape the same) differs only in its bytes and
    in the checksums its index records: the fingerprint a cluster's nodes compare tells them apart."""
    other_src = Path(shutil.copytree(bundled_model_dir(), tmp_path / "other-src"))
    t = checkpoint.read_headers(other_src)["model.layers.2.mlp.experts.3.down_proj.weight"]
    flip_byte(t, 1)
    other = tmp_path / "other-q8"
    assert CliRunner().invoke(main, ["quantize", str(other_src), str(other), "--bits", "8"]).exit_code == 0
    same = Path(shutil.copytree(q8, tmp_path / "same"))
    assert fingerprint(same, None) == fingerprint(q8, None)
    assert {n: t.shape for n, t in checkpoint.read_headers(other).items()} == \
           {n: t.shape for n, t in checkpoint.read_headers(q8).items()}
    assert fingerprint(other, None) != fingerprint(q8, None)
