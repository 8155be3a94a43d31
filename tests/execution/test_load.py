"""A machine doing other things (execution/load.py): the cores a pass uses follow the cores other
programs leave free, never fewer than one, and whoever computes a unit, and however many take
part, a decode step's logits are the same bits."""

import contextlib
import subprocess
import sys
import time

import numpy as np
import pytest

import ds2cli
from ds2cli.execution import load
from ds2cli.execution.machine import Machine

from support.decoding import decode


class Readings:
    """Scripted /proc readings: each CPU's busy ticks and this process's own, in turn (None: no
    /proc once `gone`)."""

    def __init__(self, busy, ours):
        self.busy, self.ours, self.gone = iter(busy), iter(ours), False

    def cpus(self, cpus):
        return None if self.gone else next(self.busy)

    def ticks(self, pids):
        return next(self.ours)


def test_the_cores_used_are_those_others_leave():
    """Two CPUs, 100 ticks a second: other programs' time is the CPUs' busy time less this
    process's, over the last reading's window; the count is at least 1 and at most `most`."""
    clock = iter(np.arange(0.0, 10.0, 0.2))
    # windows of 0.2 s = 20 ticks a CPU: ours 20 (one core), others 0, 20, 40, 40, then 4
    r = Readings(busy=[0, 20, 60, 120, 180, 204], ours=[0, 20, 40, 60, 80, 100, 120])
    machine = load.Load({0, 1}, clock=lambda: next(clock), busy=r.cpus, ticks=r.ticks, tick=100)
    assert machine.free(8) == 2 and machine.others == 0
    assert machine.free(8) == 1                      # one core busy elsewhere (smoothed: 0.5)
    assert machine.free(8) == 1                      # two: never below one
    assert machine.free(2) == 1
    assert machine.free(1) == 1 and 0.9 < machine.others < 1.0
    r.gone = True                                    # no /proc: the estimate stays
    assert machine.free(2) == 1


def test_no_proc_means_every_core():
    machine = load.Load({0, 1, 2, 3}, busy=lambda cpus: None, running=lambda: None)
    assert machine.free(3) == 3 and machine.free(3) == 3


def test_before_a_window_has_passed_the_tasks_running_now_count():
    """A pass that starts within INTERVAL of the pool's making has no window read yet: the tasks
    runnable at that instant but this one are the others (a small model's first steps, all of
    its reply perhaps, come before a window has passed)."""
    running = iter([1, 3, 9])
    machine = load.Load({0, 1, 2, 3}, clock=lambda: 5.0, running=lambda: next(running))
    assert machine.others is None
    assert machine.free(3) == 3        # only this thread: every core
    assert machine.free(3) == 2        # two others
    assert machine.free(3) == 1        # more than the CPUs: never below one


@contextlib.contextmanager
def busy_loops(n: int):
    loops = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]
    try:
        time.sleep(2 * load.INTERVAL)
        yield
    finally:
        for p in loops:
            p.kill()
            p.wait()


@pytest.mark.skipif(len(load.allowed_cpus()) < 2 or not sys.platform.startswith("linux") or load.niced_busy(),
                    reason="two CPUs, /proc, and this process not niced")
def test_a_niced_program_leaves_its_core_free_and_a_plain_one_does_not():
    """A `nice -n 19` busy loop gets about 1/70 of a core a nice 0 thread wants: its core counts
    as free; a plain busy loop's does not. Compared with each other (whatever else this machine
    runs counts in both), after several readings (a loop's first window may start before it); on
    a machine whose cores other work already fills the two cannot differ, and the test says so."""
    def others(cmd: list[str]) -> float:
        p = subprocess.Popen(cmd)
        try:
            machine = load.Load()
            for _ in range(6):
                time.sleep(1.5 * load.INTERVAL)
                machine.free(len(machine.cpus))
            return machine.others
        finally:
            p.kill()
            p.wait()
    loop = [sys.executable, "-c", "while 1: pass"]
    before = others(["sleep", "5"])
    if before > len(load.allowed_cpus()) - 0.75:   # a loop adds less than 0.75 of a core
        # Other work already fills the cores: a further loop only shares them, the two read alike.
        pytest.skip(f"the machine is busy ({before:.1f} cores taken): a loop's core cannot be told apart")
    niced, plain = others(["nice", "-n", "19", *loop]), others(loop)
    assert plain - niced > 0.5, (before, niced, plain)


@pytest.mark.slow
@pytest.mark.skipif(not Machine(helpers=True).helpers_allowed or sys.platform != "linux",
                    reason="helper processes: Linux, two cores or more")
@pytest.mark.parametrize("bits", [8, 4])
def test_the_same_bits_alone_and_beside_two_busy_programs(monkeypatch, bits, every_matrix_split):
    """A decode with helpers on a quiet machine and the same decode beside two programs that
    keep every core busy (where this process runs the units itself, or a helper late for its
    unit loses it): the same units, the same kernel calls, BLAS at one thread in each process,
    so the same logits bit for bit."""
    model = ds2cli.load(quantize=bits, machine=Machine(helpers=True))
    machine = model.executor.compute.machine
    pool, helpers = machine.workers, machine.helpers
    helpers.unit_min_values = 1 << 13               # and in several units each
    ids = [0, 74, 75, 76, 77]
    try:
        with monkeypatch.context() as quiet:
            quiet.setattr(pool.load, "free", lambda most, own_pids=(): most)
            alone = decode(model, ids, steps=12)
            for _ in range(20):          # (a machine busy with other tests may starve the helpers)
                if helpers.helper_units:
                    break
                np.testing.assert_array_equal(decode(model, ids, steps=12), alone)
        ran = helpers.helper_units
        with busy_loops(2):
            used = []
            free = pool.load.free
            monkeypatch.setattr(pool.load, "free", lambda most, own_pids=(): used.append(free(most, own_pids)) or used[-1])
            beside = decode(model, ids, steps=12)
        np.testing.assert_array_equal(alone, beside)
        assert ran > 0                               # alone, the helpers took units
        assert min(used) == 1 and max(used) <= pool.n
        blas = pool.blas.controllers()
        assert len(blas) == 0 or blas[0].num_threads >= 1
    finally:
        machine.stop_helpers()


@pytest.mark.slow
def test_greedy_text_is_the_same_on_one_two_and_every_core():
    """--threads 1, 2 and the default: the same greedy text (other call shapes: the logits
    agree to float32 rounding, checked in-process below)."""
    outs = []
    for threads in ([], ["-t", "1"], ["--threads", "2"]):
        r = subprocess.run([sys.executable, "-m", "ds2cli", "generate", "--chat", "What is 451 - 123?",
                            "--temperature", "0", "--quantize", "8", *threads], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0].strip() == "451 - 123 = 328." and outs.count(outs[0]) == 3


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_logits_on_one_core_and_on_every_core_agree_to_rounding(bits):
    from threadpoolctl import threadpool_limits
    every_core = ds2cli.load(quantize=bits, machine=Machine(helpers=True))
    one_core = ds2cli.load(quantize=bits, machine=Machine(threads=1))
    ids = [0, 74, 75, 76, 77]
    try:
        every = decode(every_core, ids, steps=8)
        with threadpool_limits(limits=1, user_api="blas"):
            one = decode(one_core, ids, steps=8)
    finally:
        every_core.executor.stop()
    assert (every.argmax(-1) == one.argmax(-1)).all()
    np.testing.assert_allclose(every, one, rtol=0, atol=1e-5 * np.abs(one).max())
