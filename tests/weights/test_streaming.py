"""Routed experts streamed from disk within a budget (weights/streaming.py): the same logits as
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
from ds2cli.weights import memory, streaming
from ds2cli.weights.quantize import quantize_checkpoint
from ds2cli.weights.source import bundled_model_dir


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    out = tmp_path_factory.mktemp("stream") / "tiny-q8"
    quantize_checkpoint(bundled_model_dir(), out, 8)
    return out


def budget_for(path, slots: int, context: int = 64) -> int:
    model = ds2cli.load(path)
    plan = memory.streamed(model.config, model.quantization, context, 10**12)
    return plan["resident"] + slots * plan["expert"]


@pytest.mark.slow
def test_two_experts_a_layer_give_the_same_logits(q8):
    full = ds2cli.load(q8)
    k = full.config.num_experts_per_tok
    m = ds2cli.load(q8, context=64, memory_budget=budget_for(q8, k))
    cache = m.executor.cache
    assert cache.slots == k and isinstance(m.layers[1].mlp.experts_gate_up, streaming.StreamedStack)
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
    with pytest.raises(ConfigError, match="make one first with ds2 quantize"):
        ds2cli.load(bundled_model_dir(), memory_budget=10**9)


def test_a_file_truncated_mid_run_is_one_error(q8, tmp_path):
    import shutil
    copy = shutil.copytree(q8, tmp_path / "copy")
    m = ds2cli.load(copy, context=64, memory_budget=budget_for(copy, 2))
    ids = np.array(m.tokenizer.encode("What is 451 - 123?"))
    for shard in copy.glob("*.safetensors"):      # every layer's experts: the first read fails
        if b"experts_gate_up" in shard.read_bytes()[:4096]:
            os.truncate(shard, 1024)
    with pytest.raises(streaming.StreamingError, match="ends before expert|cannot read expert"):
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
