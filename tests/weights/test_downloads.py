"""Hub downloads bounded (weights/downloads.py): a download that stalls ends after the idle time
(DS2_HUB_IDLE_S) with one error line, and Ctrl-C ends one at once (exit 130). The meter on its
own with a scripted clock; then `ds2` as a subprocess against tests/support/fake_hub.py (on
127.0.0.1, through HF_ENDPOINT) serving a file a byte a second, as a stalled server does. The
runs are bounded by generous timeouts, never timed to the second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.fake_hub import FakeHub

from ds2cli.errors import ConfigError
from ds2cli.weights.downloads import STALL_BYTES, Meter, idle_seconds
from ds2cli.weights.source import bundled_model_dir

REPO = "org/tiny"
SHARD = "model-00001-of-00002.safetensors"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_meter_stalls_when_less_than_its_bytes_came_in_the_idle_time():
    clock = Clock()
    meter = Meter(10, clock)
    clock.now += 60
    assert not meter.stalled()              # not begun: the child's imports do not count
    meter.begin()
    for _ in range(39):                     # 9.75 s with nothing: not yet the idle time
        clock.now += 0.25
        assert not meter.stalled()
    clock.now += 0.25
    assert meter.stalled()                  # 10 s with nothing


def test_a_drip_stalls_and_a_slow_steady_download_does_not():
    """A byte a second never ends huggingface_hub's per-read timeout; here it is a stall. Twice
    STALL_BYTES in each idle time, however slow that is, is not."""
    for each_quarter, stalls in (([1, 0, 0, 0], True), ([STALL_BYTES // 20] * 4, False)):
        clock = Clock()
        meter = Meter(10, clock)
        meter.begin()
        seen = []
        for quarter in range(120):              # 30 s, a quarter second at a time
            clock.now += 0.25
            meter.add(each_quarter[quarter % 4])
            seen.append(meter.stalled())
        assert any(seen) == stalls, each_quarter


def test_a_burst_then_silence_stalls_one_idle_time_after_the_burst():
    clock = Clock()
    meter = Meter(10, clock)
    meter.begin()
    clock.now += 0.25
    meter.add(50 << 20)                     # the small files, at once
    assert not meter.stalled()
    at = []
    for _ in range(80):
        clock.now += 0.25
        if meter.stalled():
            at.append(clock.now)
    assert at and at[0] == pytest.approx(100.25 + 10)   # ten seconds after the burst was seen


def test_the_idle_time_is_read_from_its_variable(monkeypatch):
    monkeypatch.delenv("DS2_HUB_IDLE_S", raising=False)
    assert idle_seconds() == 60
    monkeypatch.setenv("DS2_HUB_IDLE_S", "2.5")
    assert idle_seconds() == 2.5
    for bad in ("0", "-1", "x", "inf", "nan"):
        monkeypatch.setenv("DS2_HUB_IDLE_S", bad)
        with pytest.raises(ConfigError, match="DS2_HUB_IDLE_S must be a number of seconds above 0"):
            idle_seconds()


# ---- through the command, against a hub that drips ----

def env_for(tmp_path: Path, hub: FakeHub, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_", "DS2_")) and not k.lower().endswith("_proxy")}
    return env | {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf-home"),
                  "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "NO_PROXY": "127.0.0.1",
                  **extra}


@pytest.mark.slow
@pytest.mark.parametrize("args, drip", [(("generate", "-m", REPO, "hi"), SHARD),
                                        (("inspect", "-m", REPO), "config.json")], ids=["generate", "inspect"])
def test_a_stalled_download_ends_after_the_idle_time_with_one_error_line(tmp_path, args, drip):
    with FakeHub(bundled_model_dir(), REPO, drip=(drip,)) as hub:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "ds2cli", *args], env=env_for(tmp_path, hub, DS2_HUB_IDLE_S="2"),
                           capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        assert hub.dripping.is_set()
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {REPO} is neither a local directory nor in the Hugging Face cache "), r.stderr
    assert (f"and downloading {REPO}@main failed: it received less than 16 KiB in 2 s (a stalled server; "
            f"DS2_HUB_IDLE_S sets how long)") in r.stderr
    assert took < 30, took          # 2 s of idle time, Python's start and huggingface_hub's import


@pytest.mark.slow
def test_ctrl_c_ends_a_download_at_once(tmp_path):
    """The download's process is killed as the signal comes: exit 130, nothing left running, no
    traceback (huggingface_hub's threads once held a Ctrl-C for more than 30 s)."""
    with FakeHub(bundled_model_dir(), REPO, drip=(SHARD,)) as hub:
        p = subprocess.Popen([sys.executable, "-m", "ds2cli", "generate", "-m", REPO, "hi"],
                             env=env_for(tmp_path, hub), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert hub.dripping.wait(120), "the download never reached the dripping shard"
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=20)
        finally:
            p.kill()
    assert p.returncode == 130 and out == "" and err == "\n", err
    assert not (tmp_path / "hub" / "models--org--tiny" / "snapshots" / "c0ffee0123456789abcdef0123456789abcdef01"
                / SHARD).exists()
