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
from ds2cli.execution import plans
from ds2cli.execution.cores import split_rows
from ds2cli.execution.machine import Machine
from ds2cli.model.linear import Rows
from ds2cli.weights import formats as quant
from ds2cli.weights import scales
from support.decoding import decode
from support.machines import quiet_machine

pytestmark = pytest.mark.skipif(not Machine(helpers=True).helpers_allowed or sys.platform != "linux",
                                reason="helper processes are used on Linux with two cores or more")


@pytest.fixture(autouse=True)
def fresh(every_matrix_split):
    """Most of ds2-tiny's matrices are small enough to run whole on one core: split them all."""


def load(**kwargs):
    """ds2cli.load on a machine of its own whose cores all count as free."""
    return ds2cli.load(machine=kwargs.pop("machine", None) or quiet_machine(), **kwargs)


@pytest.fixture
def machine():
    """A machine of its own for the test, its helpers stopped after."""
    m = quiet_machine()
    yield m
    m.stop_helpers()


def machine_of(model) -> Machine:
    return model.executor.compute.machine


def forked_for(machine: Machine, *weights):
    """The machine's helpers forked knowing `weights`."""
    machine.register(weights)
    machine.start_helpers()
    return machine.helpers


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


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_helpers_give_exactly_the_threads_results(monkeypatch, bits):
    """One-token steps with the helpers and with threads, the rows cut in the same halves (the
    units cut as the threads cut the rows: a one-token plan's guided units are other call
    shapes, held to float32 rounding below), bit for bit."""
    model = load(quantize=bits)
    machine = machine_of(model)
    n = machine.workers.n
    helpers = machine.helpers
    monkeypatch.setattr(helpers, "cut", lambda plan: [(j, a, b) for j, p in enumerate(plan)
                                                      for a, b in split_rows(p.rows, n, p.align)])
    assert helpers is not None and len(helpers.procs) == n - 1
    assert all(alive(h.pid) for h in helpers.procs)
    ids = [0, 74, 75, 76, 77]
    sent, plans = helpers.products, helpers.seq
    with_helpers = decode(model, ids)
    assert helpers.products - sent >= 6 * 50     # every product of every step went through them
    # in plans of several: q with kv, the experts' gate/up products, then their down products
    # (w_uk's, w_uv's and o_proj's, each needing the one before, are a plan each)
    assert helpers.seq - plans < 0.7 * (helpers.products - sent)
    machine.helpers_allowed = False           # as DS2_HELPERS=0 would have made it
    sent = helpers.seq
    with_threads = decode(model, ids)
    assert helpers.seq == sent
    np.testing.assert_array_equal(with_helpers, with_threads)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_a_few_token_pass_with_helpers_is_the_same_pass(monkeypatch, bits):
    """A pass of a few tokens splits each product's rows with the helpers; without them the
    threads share whole experts and heads instead: other call shapes, so the logits agree to
    float32 rounding (as a low-bit prefill's shared heads do), not bit for bit."""
    model = load(quantize=bits)
    ids = [0, 74, 75, 76, 77, 78, 79, 80]
    helpers = machine_of(model).helpers
    sent = helpers.seq
    with_helpers = model.forward(ids, model.new_cache(16), all_logits=True)
    assert helpers.seq > sent
    machine_of(model).helpers_allowed = False
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


def test_an_interrupted_step_leaves_no_stale_rows(machine):
    """Ctrl-C in this process's part of a plan leaves tokens in the claims pipe and a helper's
    answer unread: the next plan takes them and reads it first, and gets only its own rows."""
    m = scales.quantize_matrix(np.random.default_rng(0).standard_normal((4096, 256), dtype=np.float32),
                               quant.FORMATS["q8"])
    helpers = forked_for(machine, m)         # m registered, then the helper forked: it knows m
    x1, x2 = np.random.default_rng(1).standard_normal((2, 256), dtype=np.float32)

    class Interrupted:
        origin = (m, -1)                     # the helpers know it as m itself

        def span(self, *args):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):   # the helper's reply to this step stays unread
        helpers.run([Rows(Interrupted(), x1, np.empty(4096, np.float32), 8)])
    assert helpers.settled < helpers.seq
    y = np.empty(4096, np.float32)
    product = Rows(m, x2, y, 8)
    assert helpers.run([product]) == [] and len(product.spans) >= 2
    assert helpers.settled == helpers.seq
    expected = np.empty(4096, np.float32)
    for a, b in product.spans:               # the same kernel calls on the same row spans
        m.span(x2, expected, a, b)
    np.testing.assert_array_equal(y, expected)


def test_a_plan_cut_short_before_its_messages_is_settled_without_them(machine):
    """Ctrl-C after a plan's tokens were written but before its PLAN messages: the next plan
    takes the stale tokens and waits for no answer that was never asked for."""
    m = scales.quantize_matrix(np.random.default_rng(0).standard_normal((4096, 256), dtype=np.float32),
                               quant.FORMATS["q8"])
    helpers = forked_for(machine, m)
    helpers.timeout = 5.0
    helpers.seq += 1                          # what send had done when the Ctrl-C came
    os.write(helpers.claims_w, b"".join(plans.TOKEN.pack(helpers.seq, u) for u in range(3)))
    x = np.random.default_rng(1).standard_normal(256, dtype=np.float32)
    y = np.empty(4096, np.float32)
    assert helpers.run([Rows(m, x, y, 8)]) == [] and not helpers.failed
    np.testing.assert_allclose(y, m.dequantize() @ x, rtol=1e-4, atol=1e-4 * np.abs(y).max())


@pytest.mark.slow
def test_a_slow_helper_takes_fewer_units(monkeypatch, machine):
    """The units go to whichever process is free: a helper that another program slows down (here
    a sleep in each of its units) takes one or two, or loses them to this process, which takes
    the rest, and the rows still come out right. A plan of several tokens too, and its cut is
    the same whatever the timing and the processes, so its GEMM tiles never depend on who took
    which unit: the same kernel calls, BLAS at one thread in every process, the same bits."""
    m = scales.quantize_matrix(np.random.default_rng(0).standard_normal((16384, 512), dtype=np.float32),
                               quant.FORMATS["q8"])
    parent, span = os.getpid(), quant.QuantMatrix.span

    def slow_in_a_helper(self, *args):
        if os.getpid() != parent:
            time.sleep(0.2)
        return span(self, *args)

    monkeypatch.setattr(quant.QuantMatrix, "span", slow_in_a_helper)
    helpers = forked_for(machine, m)          # forked now: the helpers run the slow span
    x = np.random.default_rng(1).standard_normal(512, dtype=np.float32)
    expected = m.dequantize() @ x
    y = np.empty(16384, np.float32)
    product = Rows(m, x, y, 8)
    assert helpers.run([product]) == []
    assert len(product.spans) >= 5 and helpers.helper_units <= len(helpers.procs) * 2
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    x2 = np.random.default_rng(2).standard_normal((8, 512), dtype=np.float32)
    y2 = np.empty((8, 16384), np.float32)
    product2 = Rows(m, x2, y2, 8)
    assert helpers.run([product2]) == [] and len(product2.spans) >= 3
    assert product2.spans == [(a, b) for _, a, b in plans.cut([product2], machine.workers.n)]
    expected2 = np.empty((8, 16384), np.float32)
    with machine.blas_threads(1):
        for a, b in product2.spans:           # the same kernel calls on the same rows: the same bits
            m.span(x2, expected2, a, b)
    np.testing.assert_array_equal(y2, expected2)


class Product:
    """What cut reads of a product: its rows, x, alignment and the weights a row takes (a head
    stack's rows, linear.Heads, take one head's inputs: `depth`)."""

    def __init__(self, rows, inp, k=1, align=8, depth=0):
        self.rows, self.x, self.align = rows, np.empty((k, inp) if k > 1 else inp, np.float32), align
        self.row_values = (depth or inp) * k


@pytest.mark.parametrize("shapes", [[(2816, 2048)] * 7, [(3072, 2048), (576, 2048)], [(102400, 2048)],
                                    [(16, 64)] * plans.PLAN_PRODUCTS, [(8192, 2048)] * plans.PLAN_PRODUCTS,
                                    [(1408, 2048, 1, 32), (2048, 1408, 1, 512)], [(2816, 2048, 8)] * 7,
                                    [(2816, 2048, 64)] * 7 + [(2048, 1408, 3)],
                                    [(16 * 512, 16 * 128, 1, 512, 128)], [(16 * 128, 16 * 512, 4, 128, 512)],
                                    [(128 * 512, 128 * 128, 1, 512, 128)]])
@pytest.mark.parametrize("processes", [2, 3, 8])
def test_a_plans_units_cover_its_rows_largest_first(shapes, processes):
    """cut: every product's rows exactly once, in order, each unit starting at the product's
    alignment; the plan's units shrink towards its end (guided), never below the floor (nor
    below UNIT_MIN_VALUES weights, whatever the tokens) except where a product ends, and never
    more than the tables hold."""
    plan = [Product(*shape) for shape in shapes]
    units = plans.cut(plan, processes)
    assert len(units) <= plans.PLAN_UNITS
    for j, p in enumerate(plan):
        mine = [(a, b) for i, a, b in units if i == j]
        assert mine[0][0] == 0 and mine[-1][1] == p.rows
        assert all(b0 == a1 for (_, b0), (a1, _) in zip(mine, mine[1:]))
        assert all(a % p.align == 0 and b > a for a, b in mine)
    sizes = [(b - a) * plan[j].row_values for j, a, b in units]
    floor = max(plans.UNIT_MIN_VALUES, 2 * sum(p.rows * p.row_values for p in plan) // plans.PLAN_UNITS)
    ends_of_products = {k for k, (j, a, b) in enumerate(units) if b == plan[j].rows}
    whole = [s for k, s in enumerate(sizes) if k not in ends_of_products]
    assert all(s >= floor - max(p.align * p.row_values for p in plan) for s in whole)
    tokens = [p.x.size // p.x.shape[-1] for p in plan]
    weights = [(b - a) * plan[j].row_values // tokens[j] for k, (j, a, b) in enumerate(units) if k not in ends_of_products]
    assert all(w >= plans.UNIT_MIN_VALUES - max(p.align * p.row_values for p in plan) for w in weights)
    assert all(later <= earlier + max(p.align * p.row_values for p in plan)
               for earlier, later in zip(whole, whole[1:]))


@pytest.mark.slow
def test_a_killed_helper_falls_back_to_threads():
    model = load(quantize=8)
    machine = machine_of(model)
    ids = [0, 74, 75, 76, 77]
    machine.helpers_allowed = False
    expected = decode(model, ids)
    machine.helpers_allowed = True
    pids = [h.pid for h in machine.helpers.procs]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert wait_gone(pids)
    np.testing.assert_array_equal(decode(model, ids), expected)
    assert machine.helpers is None and machine.workers.helpers_failed
    for pid in pids:                          # reaped, not left as zombies
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


@pytest.mark.slow
def test_a_stuck_helper_is_ended_and_threads_take_over():
    model = load(quantize=4)
    machine = machine_of(model)
    ids = [0, 74, 75]
    machine.helpers_allowed = False
    expected = decode(model, ids, steps=2)
    machine.helpers_allowed = True
    machine.helpers.timeout = 0.5
    pids = [h.pid for h in machine.helpers.procs]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)         # alive, but never answers
    np.testing.assert_array_equal(decode(model, ids, steps=2), expected)    # this process ran their units
    time.sleep(0.5)                          # then, inside one plan that long, they are taken as stuck
    np.testing.assert_array_equal(decode(model, ids, steps=2), expected)
    assert machine.helpers is None and wait_gone(pids)


@pytest.mark.slow
def test_loading_another_model_on_one_machine_replaces_its_helpers(machine):
    first = load(quantize=8, machine=machine)
    old = [h.pid for h in machine.helpers.procs]
    second = load(quantize=4, machine=machine)
    assert wait_gone(old)
    helpers = machine.helpers
    assert [h.pid for h in helpers.procs] != old
    sent = helpers.seq
    decode(first, [0, 74], steps=2)          # the new helpers know the first model too
    assert helpers.seq > sent
    decode(second, [0, 74], steps=2)


@pytest.mark.slow
def test_two_models_have_machines_of_their_own():
    """Each load makes its own machine: its own helpers, which know its own weights; stopping
    one model's leaves the other's running, and each decodes as it did alone."""
    first, second = load(quantize=8), load(quantize=4)
    a, b = machine_of(first), machine_of(second)
    assert a is not b and a.registry is not b.registry and a.workers is not b.workers
    pids_a, pids_b = [h.pid for h in a.helpers.procs], [h.pid for h in b.helpers.procs]
    assert set(pids_a).isdisjoint(pids_b) and all(alive(p) for p in pids_a + pids_b)
    alone = decode(first, [0, 74], steps=2)
    sent = b.helpers.seq
    decode(second, [0, 74], steps=2)
    assert b.helpers.seq > sent              # its own helpers took its plans
    first.executor.stop()
    assert wait_gone(pids_a) and all(alive(p) for p in pids_b)
    second.executor.stop()
    assert wait_gone(pids_b)
    again = load(quantize=8)                 # the same weights, a third machine: the same steps
    np.testing.assert_array_equal(decode(again, [0, 74], steps=2), alone)
    again.executor.stop()


@pytest.mark.slow
def test_a_model_loaded_on_a_thread_that_ends_keeps_its_helpers():
    import threading
    loaded = {}
    t = threading.Thread(target=lambda: loaded.setdefault("model", load(quantize=8)))
    t.start()
    t.join()
    machine = machine_of(loaded["model"])
    helpers = machine.helpers
    sent = helpers.seq
    decode(loaded["model"], [0, 74], steps=2)
    assert helpers.seq > sent and machine.helpers is helpers and all(alive(h.pid) for h in helpers.procs)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "SIGKILL"])
def test_helpers_never_outlive_their_process(how):
    script = ("import sys, time, ds2cli\n"
              "m = ds2cli.load(quantize=8)\nm.forward([0, 74], m.new_cache(8))\n"
              "print(*[h.pid for h in m.executor.compute.machine.helpers.procs], flush=True)\n"
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
