"""Ctrl-C at any moment once ds2's own code runs: exit 130, at most one line on stderr, no
traceback. Each interrupt is delivered deterministically: an import hook (or a patched function)
sends SIGINT to the process at a chosen point, rather than a timer racing the start-up."""

import signal
import subprocess
import sys
import textwrap

import pytest

import ds2cli
from ds2cli.weights.source import bundled_model_dir
from ds2cli.wording import human_bytes, unpacked

pytestmark = pytest.mark.slow      # left out of `pytest -m "not slow"` (docs/internals.md, Tests)

# Runs `ds2 ARGS...` as the console script does, with SIGINT sent when module WHEN is first
# imported (a meta-path finder sees the import before the module exists), or when the dotted
# function WHEN is first called.
DRIVER = textwrap.dedent("""
    import importlib, os, signal, sys
    when, args = sys.argv[1], sys.argv[2:]

    def interrupt():
        os.kill(os.getpid(), signal.SIGINT)

    class Hook:
        def find_spec(self, name, path=None, target=None):
            if name == when:
                sys.meta_path.remove(self)
                interrupt()
            return None

    if ":" in when:      # module:function, patched before ds2 starts (ds2's imports then bind it)
        module, function = when.split(":")
        mod = importlib.import_module(module)
        real = getattr(mod, function)
        def patched(*a, **k):
            interrupt()
            return real(*a, **k)
        setattr(mod, function, patched)
    else:
        sys.meta_path.insert(0, Hook())
    sys.argv = ["ds2", *args]
    from ds2cli.__main__ import main
    main()
""")


def run_interrupted(when: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", DRIVER, when, *args], capture_output=True, text=True,
                          timeout=120)


def assert_quiet_130(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 130, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) <= 1, p.stderr
    assert p.stdout == ""


@pytest.mark.parametrize("module", ["numpy", "jinja2", "tokenizers", "click", "rich.console",
                                    "ds2cli.cli.main", "ds2cli.weights.loader", "safetensors"])
def test_ctrl_c_while_importing_exits_130_quietly(module):
    assert_quiet_130(run_interrupted(module, "generate", "hi"))


@pytest.mark.parametrize("when", ["ml_dtypes", "ds2cli.weights.quantize", "ds2cli.weights.checkpoint:read_headers"])
def test_ctrl_c_while_quantize_starts_exits_130_quietly(when, tmp_path):
    p = run_interrupted(when, "quantize", str(bundled_model_dir()), str(tmp_path / "out"), "--bits", "8")
    assert_quiet_130(p)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("when", ["ds2cli.weights.source:check_model_dir", "ds2cli.weights.memory:check",
                                  "ds2cli.weights.checkpoint:iter_tensors"])
def test_ctrl_c_while_loading_exits_130_quietly(when):
    assert_quiet_130(run_interrupted(when, "generate", "hi"))


@pytest.mark.parametrize("run", range(3))
def test_sigterm_stops_serve_and_the_log_says_so_in_its_units(run):
    """serve's log speaks of the signal it got (a process manager's SIGTERM is no Ctrl-C), and its
    sizes are in the units of every other command (MB = 10^6 bytes). The signal is sent the moment
    the ready line appears: the handlers are in place by then, and the thread that builds
    llguidance's vocabulary at start (when the grammar extra is installed) is waited for, so the
    stop is clean (it crashed with SIGSEGV about 1 stop in 20, or died of the SIGTERM itself)."""
    p = subprocess.Popen([sys.executable, "-m", "ds2cli", "serve", "--port", "0", "--ctx", "1024"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        first = p.stderr.readline()              # written once the model has loaded
        assert first.startswith("ds2 serve: ds2-tiny"), first
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        rest = p.stderr.read()      # through the text buffer, which holds the start entry's other lines
    finally:
        p.kill()
    assert p.returncode == 0, rest
    cache_each = human_bytes(1024 * ds2cli.load().new_cache(1).bytes_per_token)
    start = unpacked(first + rest).splitlines()[0]     # the start entry, within 80 columns, as one line
    assert f"({cache_each} of cache each)" in start and "prompt cache 1024 MB" in start
    lines = [line for line in rest.splitlines() if line.startswith("ds2 serve: ")]
    assert lines[0].startswith("ds2 serve: stopping on SIGTERM: the running requests finish"), lines
    assert "second Ctrl-C" not in rest and "Traceback" not in rest
    assert lines[-1] == "ds2 serve: stopped"
