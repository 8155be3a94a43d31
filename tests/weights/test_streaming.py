"""Routed experts streamed from disk within a budget (weights/streaming.py, execution/experts.py): the same logits as
a run with every expert in memory, the cache within its slots, misses and reads ahead counted,
and the ways it can fail, each one error. Bounded by counts, never the clock."""

import os
import subprocess
import sys

import numpy as np
import pytest

import ds2cli
from ds2cli.errors import ConfigError
from ds2cli.model.transformer import Step
from ds2cli.weights import expert_cache, memory
from ds2cli.weights.quantize import quantize_checkpoint
from ds2cli.weights.source import bundled_model_dir
from support.gguf_writer import write_gguf


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    out = tmp_path_factory.mktemp("stream") / "tiny-q8"
    quantize_checkpoint(bundled_model_dir(), out, 8)
    return out


@pytest.fixture(scope="module")
def q8_0(tmp_path_factory):
    """ds2-tiny as a Q8_0 GGUF: every stacked expert tensor (blk.N.ffn_*_exps) Q8_0."""
    return write_gguf(bundled_model_dir(), tmp_path_factory.mktemp("stream") / "tiny.Q8_0.gguf", "Q8_0")


def NO_WEIGHTS(done: int, total: int) -> None:
    """A load's progress callback that fails the test: no weight may be read."""
    pytest.fail("weights loaded")


class Failing:
    """The calls an ExpertCache reads with (its `system`), as a disk that fails gives them."""

    def __init__(self, preadv, open_=os.open):
        self.preadv, self.open = preadv, open_


def budget_for(path, slots: int, context: int = 64) -> int:
    model = ds2cli.load(path)
    plan = memory.streamed(model.config, model.quantization, context, 10**12)
    return plan["resident"] + slots * plan["expert"]


@pytest.mark.slow
def test_two_experts_a_layer_give_the_same_logits(q8):
    full = ds2cli.load(q8)
    k = full.config.num_experts_per_tok
    m = ds2cli.load(q8, context=64, memory_budget=budget_for(q8, k))
    cache = m.streamed
    assert cache.slots == k and isinstance(m.layers[1].mlp.experts_gate_up, expert_cache.StreamedStack)
    ids = np.array(full.tokenizer.encode("What is 451 - 123? Think of it as 451 minus 100, then 23."))
    c1, c2 = full.new_cache(64), m.new_cache(64)
    np.testing.assert_array_equal(m.forward(ids, c2, all_logits=True), full.forward(ids, c1, all_logits=True))
    for _ in range(6):                                                    # decode steps
        t = [int(full.forward(ids[-1:], c1).argmax())]
        c2.length = c1.length - 1
        m.forward(ids[-1:], c2)
        np.testing.assert_array_equal(m.forward(t, c2), full.forward(t, c1))
    a1, b1, a2, b2 = full.new_cache(64), full.new_cache(64), m.new_cache(64), m.new_cache(64)   # a batch
    want = full.forward_batch([Step(ids[:7], a1, "all"), Step(ids, b1, "last")])
    got = m.forward_batch([Step(ids[:7], a2, "all"), Step(ids, b2, "last")])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert len(cache.slot_of) + len(cache.free) == cache.slots <= k
    s = cache.stats
    assert s["misses"] > 0 and s["read_ahead"] > 0 and s["bytes_read"] == (s["misses"] + s["read_ahead"]) * cache.expert_bytes
    m.executor.stop()


@pytest.mark.slow
def test_the_budget_holds_the_resident_part_and_the_slots(q8):
    model = ds2cli.load(q8)
    budget = budget_for(q8, 5)
    plan = memory.streamed(model.config, model.quantization, 64, budget)
    assert plan["slots"] == 5 and plan["resident"] + plan["slots"] * plan["expert"] <= budget
    with pytest.raises(memory.MemoryCheckError, match="cannot stream this model.*give at least --memory-budget"):
        memory.streamed(model.config, model.quantization, 64, plan["resident"])


def test_a_float_checkpoint_is_refused_before_loading():
    with pytest.raises(ConfigError, match="float checkpoint: make a low-bit copy first with ds2 quantize"):
        ds2cli.load(bundled_model_dir(), memory_budget=10**9)


def test_a_file_truncated_mid_run_is_one_error(q8, tmp_path):
    import shutil
    copy = shutil.copytree(q8, tmp_path / "copy")
    m = ds2cli.load(copy, context=64, memory_budget=budget_for(copy, 2))
    ids = np.array(m.tokenizer.encode("What is 451 - 123?"))
    for shard in copy.glob("*.safetensors"):      # every layer's experts: the first read fails
        if b"experts_gate_up" in shard.read_bytes()[:4096]:
            os.truncate(shard, 1024)
    with pytest.raises(expert_cache.StreamingError, match="ends before expert|cannot read expert"):
        m.forward(ids, m.new_cache(64))
    m.executor.stop()


@pytest.mark.slow
def test_the_cli_refuses_a_budget_below_the_resident_part_in_one_line(q8):
    r = subprocess.run([sys.executable, "-m", "ds2cli", "generate", "-m", str(q8), "hi", "--memory-budget", "100M"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.count("error:") == 1 and "cannot stream this model" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ds2cli", "generate", "hi", "--memory-budget", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "more than 0 bytes" in r.stderr


@pytest.mark.slow
def test_generate_within_a_budget_prints_the_same_text_and_its_reads(q8):
    args = [sys.executable, "-m", "ds2cli", "generate", "-m", str(q8), "--chat", "What is 451 - 123?", "--temperature", "0"]
    alone = subprocess.run(args, capture_output=True, text=True, timeout=120)
    budget = str(budget_for(q8, 3, context=128))
    r = subprocess.run(args + ["--ctx", "128", "--memory-budget", budget, "--stats"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == alone.stdout and r.stdout.strip() == "451 - 123 = 328."
    assert "experts 3 slots" in r.stderr and "read in" in r.stderr


def test_a_cgroup_limit_is_what_remains_of_it(tmp_path):
    limit, usage = tmp_path / "limit", tmp_path / "usage"
    limit.write_text("8000000000\n"), usage.write_text("3000000000\n")
    assert memory.cgroup_room([(str(limit), str(usage))]) == 5_000_000_000
    limit.write_text("max\n")
    assert memory.cgroup_room([(str(limit), str(usage))]) is None
    assert memory.cgroup_room([(str(tmp_path / "none"), str(usage))]) is None


# ---- GGUF: a Q8_0 file's stacked experts, read an expert at a time into q8b slots ----

def same_logits_prefill_decode_batch(full, m) -> None:
    """Prefill, six greedy decode steps and a batch of two give the same logits, bit for bit."""
    ids = np.array(full.tokenizer.encode("What is 451 - 123? Think of it as 451 minus 100, then 23."))
    c1, c2 = full.new_cache(64), m.new_cache(64)
    np.testing.assert_array_equal(m.forward(ids, c2, all_logits=True), full.forward(ids, c1, all_logits=True))
    for _ in range(6):
        t = [int(full.forward(ids[-1:], c1).argmax())]
        c2.length = c1.length - 1
        m.forward(ids[-1:], c2)
        np.testing.assert_array_equal(m.forward(t, c2), full.forward(t, c1))
    a1, b1, a2, b2 = full.new_cache(64), full.new_cache(64), m.new_cache(64), m.new_cache(64)
    want = full.forward_batch([Step(ids[:7], a1, "all"), Step(ids, b1, "last")])
    got = m.forward_batch([Step(ids[:7], a2, "all"), Step(ids, b2, "last")])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.slow
def test_a_q8_0_gguf_streams_two_experts_a_layer_with_the_same_logits(q8_0):
    full = ds2cli.load(q8_0)
    assert set(full.quantization.formats.values()) == {"q8b"}
    budget = budget_for(q8_0, 2)
    m = ds2cli.load(q8_0, context=64, memory_budget=budget)
    cache = m.streamed
    moe = [layer for layer in m.layers if layer.is_moe]
    assert cache.slots == 2 and all(isinstance(layer.mlp.experts_gate_up, expert_cache.StreamedStack)
                                    and isinstance(layer.mlp.experts_down, expert_cache.StreamedStack) for layer in moe)
    same_logits_prefill_decode_batch(full, m)
    plan = memory.streamed(m.config, m.quantization, 64, budget)
    assert plan["resident"] + cache.slots * cache.expert_bytes <= budget          # counted bytes, not RSS
    assert sum(s.qweight.nbytes + s.scales.nbytes for s in cache.stacks.values()) == cache.slots * cache.expert_bytes
    assert len(cache.slot_of) + len(cache.free) == cache.slots
    s, per_expert = cache.stats, cache.source.read_bytes
    cfg = m.config                      # an expert from disk: gate, up and down's Q8_0 blocks of 34 bytes a 32 values
    assert per_expert == 3 * cfg.moe_intermediate_size * cfg.hidden_size // 32 * 34
    assert s["misses"] > 0 and s["read_ahead"] > 0 and s["bytes_read"] == (s["misses"] + s["read_ahead"]) * per_expert
    m.executor.stop()


@pytest.mark.slow
def test_a_gguf_whose_experts_need_converting_is_refused_before_loading(tmp_path, monkeypatch):
    q4 = write_gguf(bundled_model_dir(), tmp_path / "tiny.Q4_0.gguf", "Q4_0")
    with pytest.raises(ConfigError, match=r"as Q8_0; tiny.Q4_0.gguf stores them as Q4_0 \(blk.1.ffn_gate_exps.weight\)"
                                          r".*ds2 quantize .*tiny.Q4_0.gguf OUT --bits 4"):
        ds2cli.load(q4, memory_budget=10**9, progress=NO_WEIGHTS)
    f16 = write_gguf(bundled_model_dir(), tmp_path / "tiny.F16.gguf", "F16")
    with pytest.raises(ConfigError, match=r"stores them as F16 .*--bits 8"):
        ds2cli.load(f16, memory_budget=10**9)


def test_a_q8_0_gguf_converted_by_quantize_8_is_refused_before_loading(q8_0, monkeypatch):
    with pytest.raises(ConfigError, match="leave --quantize out"):
        ds2cli.load(q8_0, quantize=8, memory_budget=10**9, progress=NO_WEIGHTS)


@pytest.mark.slow
def test_a_gguf_truncated_mid_run_is_one_error(q8_0, tmp_path):
    import shutil
    copy = shutil.copy(q8_0, tmp_path / "copy.gguf")
    m = ds2cli.load(copy, context=64, memory_budget=budget_for(copy, 2))
    first = min(m.streamed.source.where[1, "experts_gate_up"][0][1], m.streamed.source.where[1, "experts_down"][0][1])
    os.truncate(copy, first)                         # every expert of every layer now lies past the end
    with pytest.raises(expert_cache.StreamingError, match="copy.gguf ends before expert"):
        m.forward(np.array(m.tokenizer.encode("What is 451 - 123?")), m.new_cache(64))
    m.executor.stop()


def test_the_memory_check_offers_a_budget_for_a_q8_0_gguf(q8_0, monkeypatch):
    monkeypatch.setenv(memory.ENV, "1M")
    with pytest.raises(memory.MemoryCheckError, match=r"--memory-budget 0.1G streams the routed experts from disk"):
        ds2cli.load(q8_0, progress=NO_WEIGHTS)


# ---- ds2 inspect: the resident part beside the whole, the least budget, the experts a budget caches ----

def inspect_json(*args) -> dict:
    from click.testing import CliRunner
    from ds2cli.cli.main import main
    r = CliRunner().invoke(main, ["inspect", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    import json
    return json.loads(r.stdout)


@pytest.mark.slow
def test_inspect_gives_the_least_budget_that_loads_and_what_a_budget_caches(q8):
    (form,) = inspect_json(q8)["memory"]["streaming"]
    assert form["command"] is None and form["format"] == "8-bit"
    assert form["resident_weight_bytes"] + form["routed_bytes"] == form["weight_bytes"]
    assert form["routed_bytes"] == form["experts"] * form["expert_bytes"] and form["resident_bytes"] < form["ram_bytes"]
    m = ds2cli.load(q8, context=form["context"], memory_budget=form["least_budget_bytes"])   # what it says loads
    assert m.streamed.slots >= m.config.num_experts_per_tok
    m.executor.stop()
    with pytest.raises(memory.MemoryCheckError, match="cannot stream this model"):
        ds2cli.load(q8, context=form["context"], memory_budget=form["least_budget_bytes"] - 10**8)
    budget = form["resident_bytes"] + 5 * form["expert_bytes"]
    assert inspect_json(q8, "--memory-budget", budget)["memory"]["streaming"][0]["cached_experts"] == 5


@pytest.mark.slow
def test_inspect_shows_streaming_for_a_q8_0_gguf_and_the_copies_another_needs(q8_0, tmp_path):
    from click.testing import CliRunner
    from ds2cli.cli.main import main
    (form,) = inspect_json(q8_0, "--memory-budget", "100G")["memory"]["streaming"]
    full = ds2cli.load(q8_0)
    assert form["command"] is None and form["cached_experts"] == form["experts"] == 5 * full.config.n_routed_experts
    assert form["weight_bytes"] == memory.weight_bytes(full.config, full.quantization)
    q4 = write_gguf(bundled_model_dir(), tmp_path / "tiny.Q4_0.gguf", "Q4_0")
    forms = inspect_json(q4)["memory"]["streaming"]
    assert [f["command"] for f in forms] == [f"ds2 quantize {q4} OUT --bits {b}" for b in (8, 4)]
    assert forms[1]["least_budget_bytes"] <= forms[0]["least_budget_bytes"]
    r = CliRunner().invoke(main, ["inspect", str(q8_0), "--memory-budget", "1M"])
    assert r.exit_code == 0 and "--memory-budget 0.4G at least" in r.stdout and "is below that" in r.stdout


def test_inspect_of_a_float_checkpoint_sizes_its_low_bit_copies():
    from ds2cli.cli.inspect_report import describe
    forms = describe(bundled_model_dir(), budget=0)["memory"]["streaming"]
    assert [f["format"] for f in forms] == ["8-bit", "4-bit"] and all(f["cached_experts"] is None for f in forms)
    assert all(f["command"].startswith("ds2 quantize ") and f["resident_weight_bytes"] < f["weight_bytes"] for f in forms)


# ---- faults mid-run: one error, the cache still whole, no thread or file left open ----

def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.slow
def test_a_read_error_mid_run_is_one_error_line_and_leaves_nothing_open(q8, monkeypatch):
    import errno
    import threading
    from click.testing import CliRunner
    from ds2cli.cli.main import main

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    threads, fds = threading.active_count(), open_fds()
    m = ds2cli.load(q8, context=64, memory_budget=budget_for(q8, 2))
    m.streamed.system = Failing(failing)
    with pytest.raises(expert_cache.StreamingError, match=r"cannot read expert \d+ of layer \d+ from .*Input/output error"):
        m.forward(np.array(m.tokenizer.encode("What is 451 - 123?")), m.new_cache(64))
    m.executor.stop()
    assert threading.active_count() == threads and open_fds() <= fds      # the reader ended, the files closed
    with monkeypatch.context() as disk:         # the command's own model: the disk itself fails
        disk.setattr(os, "preadv", failing)
        r = CliRunner().invoke(main, ["generate", "-m", str(q8), "hi", "-n", "4", "--ctx", "64",
                                      "--memory-budget", str(budget_for(q8, 2))])
    assert r.exit_code == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot read expert") and "Input/output error" in lines[0]


@pytest.mark.slow
def test_an_expert_file_gone_after_loading_is_one_error(q8, tmp_path):
    import shutil
    copy = shutil.copytree(q8, tmp_path / "copy")
    m = ds2cli.load(copy, context=64, memory_budget=budget_for(copy, 2))
    for shard in copy.glob("*.safetensors"):
        shard.rename(shard.with_suffix(".gone"))
    with pytest.raises(expert_cache.StreamingError, match=r"cannot open .*\.safetensors: No such file or directory"):
        m.forward(np.array(m.tokenizer.encode("What is 451 - 123?")), m.new_cache(64))
    m.executor.stop()


@pytest.mark.slow
def test_ctrl_c_during_a_read_leaves_the_cache_whole(q8, monkeypatch):
    """A KeyboardInterrupt in the middle of reading an expert: the slot it was filling is free
    again (not taken for the expert), and the next pass computes the same logits as ever."""
    full = ds2cli.load(q8)
    m = ds2cli.load(q8, context=64, memory_budget=budget_for(q8, 2))
    cache, real = m.streamed, expert_cache.ExpertCache.pread
    calls = []

    def interrupted(self, *args):
        calls.append(1)
        if len(calls) == 3:                         # the third matrix read: an expert half read
            raise KeyboardInterrupt
        return real(self, *args)
    monkeypatch.setattr(expert_cache.ExpertCache, "pread", interrupted)
    ids = np.array(full.tokenizer.encode("What is 451 - 123?"))
    with pytest.raises(KeyboardInterrupt):
        m.forward(ids, m.new_cache(64))
    m.executor.experts_part.settle()
    assert len(cache.slot_of) + len(cache.free) == cache.slots and not cache.in_use
    np.testing.assert_array_equal(m.forward(ids, m.new_cache(64), all_logits=True),
                                  full.forward(ids, full.new_cache(64), all_logits=True))
    m.executor.stop()


@pytest.mark.slow
def test_the_cli_refuses_a_float_checkpoint_or_a_gguf_to_convert_in_one_line(tmp_path):
    from click.testing import CliRunner
    from ds2cli.cli.main import main
    q4 = write_gguf(bundled_model_dir(), tmp_path / "tiny.Q4_0.gguf", "Q4_0")
    for model, words in ((bundled_model_dir(), "float checkpoint: make a low-bit copy first with ds2 quantize"),
                         (q4, "stores them as Q4_0")):
        r = CliRunner().invoke(main, ["generate", "-m", str(model), "hi", "--memory-budget", "1G"])
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 1 and r.stdout == "" and len(lines) == 1 and lines[0].startswith("error: "), r.output
        assert words in lines[0] and "ds2 quantize" in lines[0]


def test_experts_queued_as_the_reader_leaves_are_read(q8):
    """The reader thread says it is done under the queue's lock and only then ends: experts
    queued between the two (its thread still alive) start a new reader instead of waiting forever."""
    import threading
    m = ds2cli.load(q8, context=64, memory_budget=budget_for(q8, 4))
    ex, release = m.executor.experts_part, threading.Event()
    leaving = threading.Thread(target=release.wait, daemon=True)   # a reader leaving: alive, counted out
    leaving.start()
    ex.readers = [leaving]
    layer = next(i for i, layer in enumerate(m.layers) if layer.is_moe)
    ex.read_ahead(layer, [0, 1])
    waiting = threading.Thread(target=ex.wait_for, args=(layer,), daemon=True)
    waiting.start()
    waiting.join(timeout=30)
    release.set()
    assert not waiting.is_alive() and ex.cache.holds(layer, 0) and ex.cache.holds(layer, 1)
    m.executor.stop()


def test_an_expert_the_reader_is_reading_is_waited_for_not_read_twice(q8, monkeypatch):
    """Reads happen outside the cache's lock: a fetch of an expert another thread is reading
    waits for that read, and the expert is read once, into one slot."""
    import threading
    m = ds2cli.load(q8, context=64, memory_budget=budget_for(q8, 4))
    cache, real = m.streamed, expert_cache.ExpertCache.read
    started, go, reads = threading.Event(), threading.Event(), []

    def slow(self, layer, e, slot):
        reads.append((layer, e))
        started.set()
        go.wait(timeout=30)
        return real(self, layer, e, slot)
    monkeypatch.setattr(expert_cache.ExpertCache, "read", slow)
    layer = next(i for i, layer in enumerate(m.layers) if layer.is_moe)
    first = threading.Thread(target=cache.fetch, args=(layer, [3]), kwargs={"ahead": True})
    first.start()
    started.wait(timeout=30)
    got = []
    second = threading.Thread(target=lambda: got.append(cache.fetch(layer, [3], use=True)))
    second.start()
    second.join(timeout=0.2)
    assert second.is_alive()                      # waiting for the first read, not reading again
    go.set()
    first.join(timeout=30), second.join(timeout=30)
    assert reads == [(layer, 3)] and got == [[cache.slot_of[layer, 3]]] and cache.in_use == {(layer, 3): 1}
    assert cache.stats["read_ahead"] == 1 and cache.stats["read_ahead_used"] == 1 and cache.stats["misses"] == 0
    cache.release(layer, [3])
    m.executor.stop()


def test_without_o_direct_the_buffered_reads_give_the_same_logits(q8, monkeypatch):
    """A file system that refuses O_DIRECT (EINVAL, as tmpfs does) is read through the page
    cache instead, dropped after: the same logits as the O_DIRECT reads (or as ever)."""
    import errno
    ids = np.array(ds2cli.load(q8).tokenizer.encode("What is 451 - 123?"))
    direct = ds2cli.load(q8, context=64, memory_budget=budget_for(q8, 3))
    want = direct.forward(ids, direct.new_cache(64), all_logits=True)
    direct.executor.stop()
    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return os.open(path, flags, *args)
    m = ds2cli.load(q8, context=64, memory_budget=budget_for(q8, 3))
    m.streamed.system = Failing(os.preadv, no_direct)
    np.testing.assert_array_equal(m.forward(ids, m.new_cache(64), all_logits=True), want)
    assert m.streamed.files and not any(d for _, d in m.streamed.files.values())
    m.executor.stop()


def test_the_next_layers_experts_are_queued_before_this_layers_compute(q8, monkeypatch):
    """after_attention guesses layer i+1's experts from layer i's residual before layer i's
    MLP runs, so the disk reads for i+1 while i computes; a layer's own queued experts go to
    the queue's head when it waits for them."""
    m = ds2cli.load(q8, context=64, memory_budget=budget_for(q8, 8))
    ex, events = m.executor.experts_part, []
    real_ahead, real_run = ex.read_ahead, ex.run
    monkeypatch.setattr(ex, "read_ahead", lambda layer, experts, first=False:
                        (events.append(("ahead", layer)), real_ahead(layer, experts, first))[1])
    monkeypatch.setattr(ex, "run", lambda i, *a: (events.append(("experts", i)), real_run(i, *a))[1])
    m.forward(np.array(m.tokenizer.encode("What is 451 - 123?")), m.new_cache(64))
    moe_layers = [i for i, layer in enumerate(m.layers) if layer.is_moe]
    for i, j in zip(moe_layers, moe_layers[1:]):
        if j == i + 1 and ("ahead", j) in events:
            assert events.index(("ahead", j)) < events.index(("experts", i))
    assert any(("ahead", j) in events for j in moe_layers[1:])
    ex.settle()
    ex.queue.extend([(5, 1), (5, 2), (4, 7), (4, 8)])           # the next layer's guesses, then this one's
    assert ex.hurry(4, [8, 9]) == [9] and list(ex.queue) == [(4, 8), (5, 1), (5, 2), (4, 7)]
    ex.queue.clear()
    m.executor.stop()


def test_a_fetch_stopped_midway_leaves_nothing_marked_in_use(q8, monkeypatch):
    """A fetch of several experts for use that fails (or is interrupted) after the first is in
    a slot gives that one back: no slot stays in use, unevictable, after the error."""
    m = ds2cli.load(q8, context=64, memory_budget=budget_for(q8, 4))
    cache, real = m.streamed, expert_cache.ExpertCache.read
    layer = next(i for i, layer in enumerate(m.layers) if layer.is_moe)
    cache.fetch(layer, [0])                                   # in a slot: a hit next time

    def interrupted(self, *args):
        raise KeyboardInterrupt
    monkeypatch.setattr(expert_cache.ExpertCache, "read", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.fetch(layer, [0, 1], use=True)
    monkeypatch.setattr(expert_cache.ExpertCache, "read", real)
    assert not cache.in_use and not cache.filling and len(cache.slot_of) + len(cache.free) == cache.slots
    m.executor.stop()


def test_two_reading_threads_open_a_file_once(q8, monkeypatch):
    """Reads run outside the cache's lock, on several threads: a file is still opened once
    (a second descriptor would leak, never closed)."""
    import threading
    import time as time_module
    m = ds2cli.load(q8, context=64, memory_budget=budget_for(q8, 4))
    cache, real, opened = m.streamed, expert_cache.ExpertCache.open, []

    def slow_open(self, path):
        opened.append(path)
        time_module.sleep(0.05)              # widens the window two threads would both open in
        return real(self, path)
    monkeypatch.setattr(expert_cache.ExpertCache, "open", slow_open)
    path = next(iter(cache.source.paths))
    cache.close()
    threads = [threading.Thread(target=cache.fd, args=(path,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert opened == [path] and list(cache.files) == [path]
    m.executor.stop()


def test_an_expert_changed_after_quantize_is_an_error_on_its_first_read(q8, tmp_path):
    """A streamed run checks each expert's bytes against the checksum ds2 quantize recorded, on
    its first read in the process (later reads of the same expert are not hashed again)."""
    import shutil
    from ds2cli.weights import checkpoint
    copy = shutil.copytree(q8, tmp_path / "copy")
    m = ds2cli.load(copy, context=64, memory_budget=budget_for(copy, 2))
    cache = m.streamed
    cache.fetch(1, [2])                           # read and checked
    assert ("model.layers.1.mlp.experts_gate_up.qweight" in cache.source.sums
            and (1, 2, "model.layers.1.mlp.experts_gate_up.qweight") in cache.source.checked)
    name = "model.layers.1.mlp.experts_gate_up.qweight"
    info = next(t for shard in copy.glob("*.safetensors") for n, t in checkpoint.read_header(shard).items() if n == name)
    with open(info.file, "r+b") as f:             # expert 5's first byte, one bit flipped: the same size
        f.seek(info.offset + 5 * (info.nbytes // 8))
        b = f.read(1)[0]
        f.seek(info.offset + 5 * (info.nbytes // 8))
        f.write(bytes([b ^ 1]))
    with pytest.raises(expert_cache.StreamingError, match=r"expert 5 of layer 1 .*does not match the checksum"):
        cache.fetch(1, [5])
    cache.fetch(1, [2])                           # one already checked: not read or hashed again
    m.executor.stop()
