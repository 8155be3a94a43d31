"""A signal to a `--ray` driver ends it as it ends one without Ray: no native stack dump from
Ray's core (absl's failure handler, which ray.init installs), no exit 15 from Ray's own SIGTERM
handler. The driver runs against the real cluster of tests/cluster (conftest.py's `cluster`);
keeping_signals, the piece that does it, is also tested on its own, in this process."""

from __future__ import annotations

import faulthandler
import signal
import subprocess
import sys

import pytest

from ds2cli.cluster.ray_cluster import KEPT_SIGNALS, keeping_signals


def test_the_handlers_and_faulthandler_are_put_back():
    """What ray.init does to a driver (worker.py: a SIGTERM handler that exits 15, faulthandler
    enabled), undone as the block ends."""
    before = {sig: signal.getsignal(sig) for sig in KEPT_SIGNALS}
    dumping = faulthandler.is_enabled()
    try:
        with keeping_signals():
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            faulthandler.enable()
        assert {sig: signal.getsignal(sig) for sig in KEPT_SIGNALS} == before
        assert faulthandler.is_enabled() == dumping
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        if dumping:
            faulthandler.enable()


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)],
                         ids=["sigterm", "sigint"])
def test_a_signal_to_a_ray_driver_mid_decode_ends_it_quietly(cluster, sig, code):
    """SIGTERM kills the driver as it kills a plain generate (the shell's 143); SIGINT is Ctrl-C's
    exit 130. It exited 15 with `*** SIGTERM received at time=...` and a native stack."""
    from support.ray_local import ADDRESS
    p = cluster.popen([sys.executable, "-m", "ds2cli", "generate", "--chat", "What is 451 - 123?", "-n", "900",
                       "--ignore-eos", "--temperature", "0", "--ray", ADDRESS],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = p.stdout.read(1)                   # decoding: the first byte of text has come
        assert first, p.stderr.read().decode()
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    err = err.decode()
    assert p.returncode == code, err[-3000:]
    assert "***" not in err and "Traceback" not in err and "Fatal Python error" not in err, err[-3000:]
