"""Bad input around low-bit checkpoints and the memory check: one `error:` line, the right exit
code, nothing half-written left behind, and `ds2 inspect` listing every problem."""

import errno
import os
import signal
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

import ds2cli
from ds2cli.weights import checkpoint
from ds2cli.weights import memory
from ds2cli.weights import qcheckpoint
from ds2cli.cli.main import main
from ds2cli.weights.memory import MemoryCheckError
from ds2cli.weights.source import bundled_model_dir
from ds2cli.weights.qcheckpoint import QuantConfig
from ds2cli.weights.quantize import QuantizeError, quantize_checkpoint


def run(*args, env=None):
    return CliRunner(env=env).invoke(main, [str(a) for a in args])


def one_error_line(r, code=1):
    assert r.exit_code == code, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.output, r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    dst = tmp_path_factory.mktemp("q") / "tiny-q4"
    assert run("quantize", bundled_model_dir(), dst, "--bits", "4").exit_code == 0
    return dst


@pytest.fixture
def q4_copy(q4, tmp_path):
    return shutil.copytree(q4, tmp_path / "copy")


def rewrite_shard(model_dir, tensor, change):
    """Rewrite the shard holding `tensor` with change(arrays) applied to its {name: array}."""
    index = json.loads((model_dir / checkpoint.INDEX_NAME).read_text())
    path = model_dir / index["weight_map"][tensor]
    infos = checkpoint.read_header(path)
    mapped = qcheckpoint.Mapped()
    arrays = {name: np.array(mapped.array(info)) for name, info in infos.items()}
    del mapped
    change(arrays)
    qcheckpoint.write_safetensors(path, list(arrays.items()))


def edit_config(model_dir, change):
    config = json.loads((model_dir / "config.json").read_text())
    change(config["quantization_config"])
    (model_dir / "config.json").write_text(json.dumps(config))


SCALES = "model.layers.2.mlp.experts_down.scales"


@pytest.mark.slow
def test_missing_scale_tensor(q4_copy):
    rewrite_shard(q4_copy, SCALES, lambda a: a.pop(SCALES))
    line = one_error_line(run("generate", "-m", q4_copy, "hi", "-n", "2"))
    assert f"missing tensor {SCALES}" in line
    r = run("inspect", q4_copy)
    assert r.exit_code == 1 and f"missing tensor {SCALES}" in r.stdout


def test_wrong_scale_shape(q4_copy):
    rewrite_shard(q4_copy, SCALES, lambda a: a.__setitem__(SCALES, a[SCALES][:, :-1]))
    line = one_error_line(run("generate", "-m", q4_copy, "hi", "-n", "2"))
    assert SCALES in line and "has shape" in line
    with pytest.raises(ds2cli.CheckpointError, match="has shape"):
        ds2cli.load(q4_copy)


@pytest.mark.parametrize("change, message", [
    (lambda q: q["formats"].__setitem__("routed_experts", "q3"), "unknown format 'q3'"),
    (lambda q: q.__setitem__("bits", 5), "bits must be 8 or 4"),
    (lambda q: q["format_specs"]["q4"].__setitem__("group_size", 64), "which is not ds2's q4"),
    (lambda q: q["format_specs"]["q8"].__setitem__("scale_group", "column"), "which is not ds2's q8"),
    (lambda q: q.pop("format_specs"), "no format_specs"),
    (lambda q: q.__setitem__("version", 7), "version 7"),
    (lambda q: q.__setitem__("version", 1), "an older ds2 wrote it: run ds2 quantize again"),
    (lambda q: q["formats"].pop("lm_head"), "formats must name exactly"),
])
def test_bad_quantization_config(q4_copy, change, message):
    edit_config(q4_copy, change)
    assert message in one_error_line(run("generate", "-m", q4_copy, "hi", "-n", "2"))
    r = run("inspect", "--json", q4_copy)
    assert r.exit_code == 1 and any(message in p for p in json.loads(r.stdout)["problems"])


def test_quantization_config_that_disagrees_with_the_tensors(q4_copy):
    # says 8-bit experts, but the file holds 4-bit ones: every expert tensor is reported
    edit_config(q4_copy, lambda q: q["formats"].update(routed_experts="q8"))
    line = one_error_line(run("generate", "-m", q4_copy, "hi", "-n", "2"))
    assert "experts_gate_up.qweight has" in line
    r = run("inspect", "--json", q4_copy)
    problems = json.loads(r.stdout)["problems"]
    assert r.exit_code == 1 and len(problems) == 20   # 5 MoE layers x (gate_up, down) x (qweight, scales)
    assert all("quantization_config says I8" in p or "config says" in p for p in problems)


# ---- ds2 quantize ----

@pytest.mark.slow
def test_quantize_refuses_a_non_empty_destination_without_force(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    line = one_error_line(run("quantize", bundled_model_dir(), dst, "--bits", "8"))
    assert "not empty" in line and "--force" in line
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    assert run("quantize", bundled_model_dir(), dst, "--bits", "8", "--force").exit_code == 0
    assert not (dst / "keep.txt").exists() and (dst / "config.json").is_file()
    assert ds2cli.load(dst).quantization.bits == 8


def test_quantize_into_a_file_or_inside_the_source(tmp_path):
    (tmp_path / "f").write_text("x")
    assert "not a directory" in one_error_line(run("quantize", bundled_model_dir(), tmp_path / "f", "--bits", "8"))
    src = shutil.copytree(bundled_model_dir(), tmp_path / "src")
    assert "inside the source" in one_error_line(run("quantize", src, src / "q8", "--bits", "8"))


def test_quantize_usage_errors(tmp_path):
    r = run("quantize", bundled_model_dir(), tmp_path / "o", "--bits", "5")
    assert r.exit_code == 2 and "--bits" in r.stderr
    line = one_error_line(run("quantize", tmp_path / "nowhere", tmp_path / "o", "--bits", "8"))
    assert "no such file or directory" in line and not (tmp_path / "o").exists()


def test_quantize_a_quantized_checkpoint_is_refused(q4, tmp_path):
    assert "already a ds2 low-bit" in one_error_line(run("quantize", q4, tmp_path / "o", "--bits", "8"))


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir())


def test_full_disk_leaves_nothing_behind(tmp_path):
    calls = []

    def full(path, arrays):            # the disk fills at the third shard
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return qcheckpoint.write_safetensors(path, arrays)

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(QuantizeError, match=f"no space left on the device writing {out / 'q8'}; nothing was kept"):
        quantize_checkpoint(bundled_model_dir(), out / "q8", 8, write_shard=full)
    assert len(calls) == 3 and leftovers(out) == []


def test_disk_too_small_is_refused_before_writing():
    """/proc is a file system with no free byte: the need is named before anything is written."""
    line = one_error_line(run("quantize", bundled_model_dir(), "/proc/self/q8", "--bits", "8"))
    assert "not enough disk" in line and "it needs" in line and "0.0 GB is free" in line


def test_interrupted_quantize_leaves_nothing_behind(tmp_path):
    def interrupt(done, total):        # Ctrl-C after the first layer was written
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(bundled_model_dir(), tmp_path / "q8", 8, progress=interrupt)
    assert leftovers(tmp_path) == []


def test_broken_source_gives_one_error_and_no_output(tmp_path):
    src = shutil.copytree(bundled_model_dir(), tmp_path / "src")
    shard = src / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    line = one_error_line(run("quantize", src, tmp_path / "q8", "--bits", "8"))
    assert "model-00002-of-00002.safetensors" in line and leftovers(tmp_path) == ["src"]


# ---- the memory check ----

TINY = ds2cli.DeepseekV2Config.from_file(bundled_model_dir() / "config.json")


def test_required_bytes_add_up_and_match_inspect():
    r = run("inspect", "--json")
    report = json.loads(r.stdout)
    by_format = {f["format"]: f for f in report["memory"]["formats"]}
    for name, qc, at_load in (("float32", None, False), ("8-bit", QuantConfig.recipe(8), True),
                              ("4-bit", QuantConfig.recipe(4), True)):
        need = memory.required(TINY, qc, None, quantize_at_load=at_load)
        assert need["total"] == need["weights"] + need["cache"] + need["working"] + need["margin"]
        assert by_format[name]["ram_bytes"] == need["total"]
        assert by_format[name]["weight_bytes"] == need["weights"] == memory.weight_bytes(TINY, qc)
    assert by_format["float32"]["weight_bytes"] == 4 * report["params"]
    assert need["cache"] == report["latent_cache_bytes_per_token"] * min(TINY.max_position_embeddings, 4096)


def needs(qc, at_load=False, context=None):
    return memory.required(TINY, qc, context, quantize_at_load=at_load)["total"]


def test_too_little_memory_is_one_clear_error_before_loading(monkeypatch, reading_tensors):
    available = needs(QuantConfig.recipe(8), at_load=True) + 1000    # 8-bit fits, float32 does not
    env = {"DS2_MEMORY_AVAILABLE": str(available)}
    reading_tensors(lambda *a: pytest.fail("weights were read"))
    line = one_error_line(run("generate", "hi", "-n", "2", env=env))
    assert "needs" in line and "as float32" in line and memory.gb(available) in line
    assert "--bits 8" in line and "--quantize 8" in line and "--no-memory-check" in line
    monkeypatch.undo()
    with pytest.raises(MemoryCheckError):
        monkeypatch.setenv("DS2_MEMORY_AVAILABLE", str(available))
        ds2cli.load()


@pytest.mark.slow
def test_override_and_auto(monkeypatch):
    available = needs(QuantConfig.recipe(8), at_load=True) + 1000
    env = {"DS2_MEMORY_AVAILABLE": str(available)}
    r = run("generate", "--chat", "What is 17 + 25?", "--temperature", "0", "--no-memory-check", env=env)
    assert r.exit_code == 0 and r.stdout == "17 + 25 = 42.\n"
    r = run("generate", "--chat", "What is 17 + 25?", "--temperature", "0", "--quantize", "auto", env=env)
    assert r.exit_code == 0 and r.stdout == "17 + 25 = 42.\n" and "loaded as 8-bit" in r.stderr
    r = run("generate", "hi", "-n", "1", "--quantize", "auto", env={"DS2_MEMORY_AVAILABLE": str(10**9)})
    assert r.exit_code == 0 and "loaded as float32" in r.stderr
    smaller = needs(QuantConfig.recipe(4), at_load=True) + 1000
    r = run("generate", "hi", "-n", "1", "--quantize", "auto", env={"DS2_MEMORY_AVAILABLE": str(smaller)})
    assert r.exit_code == 0 and "loaded as 4-bit" in r.stderr
    line = one_error_line(run("generate", "hi", "--quantize", "auto", env={"DS2_MEMORY_AVAILABLE": "1M"}))
    assert "does not fit even as 4-bit" in line


def test_a_quantized_checkpoint_counts_its_file_bytes(q4):
    stored = QuantConfig.recipe(4)
    need = needs(stored)
    files = sum(t.nbytes for t in checkpoint.read_headers(q4).values())
    assert memory.required(TINY, stored, None)["weights"] == files
    monkeypatch_env = {"DS2_MEMORY_AVAILABLE": str(need - 1)}
    line = one_error_line(run("chat", "-m", q4, env=monkeypatch_env))
    assert "as 4-bit" in line
    assert run("generate", "-m", q4, "hi", "-n", "1", env={"DS2_MEMORY_AVAILABLE": str(need + 4096 * 1920)}).exit_code == 0


def test_bad_memory_override_value():
    line = one_error_line(run("generate", "hi", env={"DS2_MEMORY_AVAILABLE": "lots"}))
    assert "DS2_MEMORY_AVAILABLE" in line


def test_bench_refuses_what_cannot_fit_before_synthesising(tmp_path):
    env = {"DS2_MEMORY_AVAILABLE": "4G", "DS2_BENCH_DIR": str(tmp_path)}
    line = one_error_line(run("bench", "--layers", "27", env=env))
    assert "needs 6" in line and "as float32" in line and leftovers(tmp_path) == []
    line = one_error_line(run("bench", "--layers", "27", "--formats", "8", env=env))
    assert "as 8-bit" in line and leftovers(tmp_path) == []


def signal_second_layer(monkeypatch, sig):
    """Quantize's writer sends this process a real `sig` as it starts the second layer (handled at
    the next bytecode, as a user's Ctrl-C or `kill` would be)."""
    from ds2cli.weights import qcheckpoint
    calls, real = [], qcheckpoint.write_safetensors

    def write(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), sig)
        return real(*args, **kwargs)
    monkeypatch.setattr(qcheckpoint, "write_safetensors", write)


@pytest.mark.slow
@pytest.mark.parametrize("at", ["a layer", "the commit", "the summary"])
def test_ctrl_c_in_quantize_says_nothing_was_written_and_leaves_nothing(tmp_path, monkeypatch, at):
    """Interrupted while writing a layer: one line says so, exit 130, and neither DST, its
    partial directory nor the parent directories made for it remain. A Ctrl-C that lands while
    the finished directory is renamed into place comes too late to undo it: the run completes."""
    from ds2cli.weights import staging as files
    dst = tmp_path / "made" / "for" / "q8"
    if at == "a layer":
        signal_second_layer(monkeypatch, signal.SIGINT)
    elif at == "the commit":
        real_commit = files.commit

        def commit(*args):
            os.kill(os.getpid(), signal.SIGINT)
            return real_commit(*args)
        monkeypatch.setattr(files, "commit", commit)
    else:                                               # while `wrote ...` is printed: too late
        from ds2cli.cli import console
        real_info = console.info

        def info(message):
            if message.startswith("wrote"):
                os.kill(os.getpid(), signal.SIGINT)
            real_info(message)
        monkeypatch.setattr(console, "info", info)
    r = run("quantize", bundled_model_dir(), dst, "--bits", "8")
    if at == "a layer":
        assert r.exit_code == 130, r.output
        assert "interrupted, nothing written" in r.stderr and "wrote" not in r.stderr
        assert leftovers(tmp_path) == []
    else:
        assert r.exit_code == 0 and "wrote" in r.stderr
        assert (dst / "config.json").is_file() and leftovers(dst.parent) == ["q8"]


def test_sigterm_in_quantize_leaves_nothing_behind(tmp_path, monkeypatch):
    """A `kill` while a layer is written: the partial directory and the parents made for it go,
    as on Ctrl-C, and the process ends as a terminated one (143)."""
    dst = tmp_path / "made" / "for" / "q8"
    signal_second_layer(monkeypatch, signal.SIGTERM)
    r = run("quantize", bundled_model_dir(), dst, "--bits", "8")
    assert r.exit_code == 143 and "wrote" not in r.stderr and "Traceback" not in r.stderr
    assert leftovers(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL     # the handler is the command's alone


def test_a_destination_name_too_long_for_the_file_system_is_one_error_line(tmp_path):
    line = one_error_line(run("quantize", bundled_model_dir(), tmp_path / ("q" * 300), "--bits", "8"))
    assert "destination" in line and "too long" in line.lower()
    assert leftovers(tmp_path) == []
