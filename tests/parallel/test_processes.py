"""Helper processes (helpers.Helpers): a low-bit model's decode steps split each matvec between
this process and processes forked at load. They must give exactly the threads' results, survive
a helper's death and an interrupted step, and never outlive the process that forked them."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import ds2cli
from ds2cli.parallel import cores
from ds2cli.weights import quant
from ds2cli.weights import scales
from ds2cli.parallel import processes as procs

pytestmark = pytest.mark.skipif(not procs.helpers_wanted(), reason="helper processes are used on Linux "
                                "with two cores or more (and not with DS2_HELPERS=0)")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(procs, "_helpers_failed", False)   # a test that kills a helper sets it
    monkeypatch.delenv("DS2_HELPERS", raising=False)
    # most of ds2-tiny's matrices are small enough to run whole on one core; split them all
    monkeypatch.setattr(quant, "SMALL_MATRIX", 0)
    yield
    procs.stop_helpers_now()


def decode(model, ids, steps=6):
    """Logits of the prompt fed a token at a time, then of each of `steps` greedy one-token steps:
    one-token steps split each matvec into the same spans with helpers as with threads."""
    cache = model.new_cache(64)
    for token in ids[:-1]:
        model.forward([token], cache)
    out = [model.forward(ids[-1:], cache)]
    for _ in range(steps):
        out.append(model.forward([int(out[-1].argmax())], cache))
    return np.stack(out)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()       # a zombie has exited
    except FileNotFoundError:
        return False


def wait_gone(pids, seconds=60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("bits", [8, 4])
def test_helpers_give_exactly_the_threads_results(monkeypatch, bits):
    """One-token steps with the helpers and with threads, the rows cut in the same halves (the
    shares held even: by speed they would cut elsewhere, another call shape), bit for bit."""
    monkeypatch.setattr(procs.Helpers, "shares", lambda self: [1 / len(self.speeds)] * len(self.speeds))
    model = ds2cli.load(quantize=bits)
    helpers = procs.running()
    assert helpers is not None and len(helpers.procs) == cores.workers().n - 1
    assert all(alive(h.pid) for h in helpers.procs)
    ids = [0, 74, 75, 76, 77]
    sent, plans = helpers.products, helpers.seq
    with_helpers = decode(model, ids)
    assert helpers.products - sent >= 6 * 50     # every projection of every step (57 a step) went through them
    # in plans of several: q with kv, the experts' gate/up products, then their down products
    assert helpers.seq - plans < 0.6 * (helpers.products - sent)
    monkeypatch.setenv("DS2_HELPERS", "0")
    sent = helpers.seq
    with_threads = decode(model, ids)
    assert helpers.seq == sent
    np.testing.assert_array_equal(with_helpers, with_threads)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_few_token_pass_with_helpers_is_the_same_pass(monkeypatch, bits):
    """A pass of a few tokens splits each product's rows with the helpers; without them the
    threads share whole experts and heads instead: other call shapes, so the logits agree to
    float32 rounding (as a low-bit prefill's shared heads do), not bit for bit."""
    model = ds2cli.load(quantize=bits)
    ids = [0, 74, 75, 76, 77, 78, 79, 80]
    helpers = procs.running()
    sent = helpers.seq
    with_helpers = model.forward(ids, model.new_cache(16), all_logits=True)
    assert helpers.seq > sent
    monkeypatch.setenv("DS2_HELPERS", "0")
    with_threads = model.forward(ids, model.new_cache(16), all_logits=True)
    np.testing.assert_allclose(with_helpers, with_threads, rtol=0, atol=1e-5 * np.abs(with_threads).max())


@pytest.mark.parametrize("fmt", ["q8", "q4", "bf16"])
def test_a_one_token_product_split_anywhere_gives_its_rows(fmt):
    """A one-token plan's split follows the timing, so any cut at the format's alignment must
    give every row: each within float32 rounding of the float64 product. (On the OpenBLAS
    kernels measured here they are the same bits whatever the cut, since each row is one dot
    product with the token; another BLAS may round differently, hence the bound.)"""
    rng = np.random.default_rng(0)
    m = scales.quantize_matrix(rng.standard_normal((1024, 512), dtype=np.float32), quant.FORMATS[fmt])
    x = rng.standard_normal(512, dtype=np.float32)
    exact = m.dequantize().astype(np.float64) @ x.astype(np.float64)
    bound = 1e-5 * np.abs(m.dequantize().astype(np.float64)) @ np.abs(x.astype(np.float64))
    for cut in range(m.row_align, 1024, 7 * m.row_align):
        y = np.empty(1024, np.float32)
        m.span(x, y, 0, cut)
        m.span(x, y, cut, 1024)
        assert np.all(np.abs(y - exact) <= bound), cut


def test_an_interrupted_step_leaves_no_stale_rows():
    m = scales.quantize_matrix(np.random.default_rng(0).standard_normal((512, 256), dtype=np.float32),
                                     quant.FORMATS["q8"])
    procs.start_helpers()                    # forked after m exists, so the helper knows it
    helpers = procs.running()
    x1, x2 = np.random.default_rng(1).standard_normal((2, 256), dtype=np.float32)

    class Interrupted:
        key = m.key

        def span(self, *args):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):   # the helper's reply to this step stays unread
        helpers.run([cores.Rows(Interrupted(), x1, np.empty(512, np.float32), 8)])
    y = np.empty(512, np.float32)
    product = cores.Rows(m, x2, y, 8)
    assert helpers.run([product]) == [] and len(product.spans) == 2
    expected = np.empty(512, np.float32)
    for a, b in product.spans:               # the same kernel calls on the same row spans
        m.span(x2, expected, a, b)
    np.testing.assert_array_equal(y, expected)


def test_each_process_gets_rows_by_its_speed(monkeypatch):
    """Each process's share of a one-token plan's rows follows its measured speed: a helper three
    times slower than this process gets a quarter of the rows (never less than the floor), the
    speeds follow what each plan took, and the rows still come out right. A plan of several
    tokens is split in halves whatever the speeds, so that its GEMM tiles never depend on them."""
    m = scales.quantize_matrix(np.random.default_rng(0).standard_normal((4096, 512), dtype=np.float32),
                               quant.FORMATS["q8"])
    procs.start_helpers()
    helpers = procs.running()
    if len(helpers.procs) != 1:
        pytest.skip("the shares are checked with one helper (two cores)")
    x = np.random.default_rng(1).standard_normal(512, dtype=np.float32)
    expected = m.dequantize() @ x
    helpers.speeds = [3.0, 1.0]
    y = np.empty(4096, np.float32)
    product = cores.Rows(m, x, y, 8)
    helpers.timed = lambda *args: None                              # hold the speeds for this plan
    try:
        assert helpers.run([product]) == []
    finally:
        del helpers.timed
    assert product.spans == [(0, 3072), (3072, 4096)]
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    x2 = np.random.default_rng(2).standard_normal((2, 512), dtype=np.float32)
    product2 = cores.Rows(m, x2, np.empty((2, 4096), np.float32), 8)
    helpers.timed = lambda *args: None
    try:
        assert helpers.run([product2]) == []
    finally:
        del helpers.timed
    assert product2.spans == [(0, 2048), (2048, 4096)]             # two tokens: halves, whatever the speeds
    helpers.speeds = [100.0, 1.0]                                   # a helper all but stopped
    assert procs.Helpers.shares(helpers)[1] == pytest.approx(procs.SHARE_FLOOR / (2 + procs.SHARE_FLOOR), rel=0.05)
    helpers.speeds = [1.0, 1.0]
    helpers.timed(1, [product], 1024 * 512 / 4e9)                   # the helper's 1024 rows at 4 G weights/s
    assert helpers.speeds[1] == pytest.approx(1.0 + procs.SHARE_WEIGHT * (4.0 - 1.0))


def test_a_killed_helper_falls_back_to_threads(monkeypatch):
    model = ds2cli.load(quantize=8)
    ids = [0, 74, 75, 76, 77]
    monkeypatch.setenv("DS2_HELPERS", "0")
    expected = decode(model, ids)
    monkeypatch.delenv("DS2_HELPERS")
    pids = [h.pid for h in procs.running().procs]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert wait_gone(pids)
    np.testing.assert_array_equal(decode(model, ids), expected)
    assert procs.running() is None and procs._helpers_failed
    for pid in pids:                          # reaped, not left as zombies
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_a_stuck_helper_is_ended_and_threads_take_over(monkeypatch):
    model = ds2cli.load(quantize=4)
    ids = [0, 74, 75]
    monkeypatch.setenv("DS2_HELPERS", "0")
    expected = decode(model, ids, steps=2)
    monkeypatch.delenv("DS2_HELPERS")
    monkeypatch.setattr(procs, "HELPER_TIMEOUT", 0.5)
    pids = [h.pid for h in procs.running().procs]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)         # alive, but never answers
    np.testing.assert_array_equal(decode(model, ids, steps=2), expected)
    assert procs.running() is None and not any(alive(pid) for pid in pids)


def test_loading_another_model_replaces_the_helpers():
    first = ds2cli.load(quantize=8)
    old = [h.pid for h in procs.running().procs]
    second = ds2cli.load(quantize=4)
    assert wait_gone(old)
    helpers = procs.running()
    assert [h.pid for h in helpers.procs] != old
    sent = helpers.seq
    decode(first, [0, 74], steps=2)          # the new helpers know the first model too
    assert helpers.seq > sent
    decode(second, [0, 74], steps=2)


def test_a_model_loaded_on_a_thread_that_ends_keeps_its_helpers():
    import threading
    loaded = {}
    t = threading.Thread(target=lambda: loaded.setdefault("model", ds2cli.load(quantize=8)))
    t.start()
    t.join()
    helpers = procs.running()
    sent = helpers.seq
    decode(loaded["model"], [0, 74], steps=2)
    assert helpers.seq > sent and procs.running() is helpers and all(alive(h.pid) for h in helpers.procs)


@pytest.mark.parametrize("how", ["exit", "SIGKILL"])
def test_helpers_never_outlive_their_process(how):
    script = ("import sys, time, ds2cli\nfrom ds2cli.parallel import processes as procs\n"
              "m = ds2cli.load(quantize=8)\nm.forward([0, 74], m.new_cache(8))\n"
              "print(*[h.pid for h in procs.running().procs], flush=True)\n"
              "sys.stdin.readline()\n")            # held until the test has seen the helpers
    p = subprocess.Popen([sys.executable, "-c", script, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    pids = [int(pid) for pid in p.stdout.readline().split()]
    assert pids and all(alive(pid) for pid in pids)
    if how == "SIGKILL":
        p.kill()
    else:
        p.stdin.write("exit now\n")                     # the process ends of itself
    p.stdin.close()
    assert p.wait(timeout=60) == (0 if how == "exit" else -signal.SIGKILL)
    assert wait_gone(pids, seconds=60)
