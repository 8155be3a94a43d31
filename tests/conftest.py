"""Shared fixtures: writable copies of the bundled and reference checkpoints, to break in tmp_path."""

import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from ds2cli.weights.source import bundled_model_dir

REFERENCE = Path(__file__).parent / "data" / "reference"

# A suite started in the background of a non-interactive shell (`cmd &`, nohup) inherits SIGINT
# ignored, and so would every ds2 process the tests start: the tests that press Ctrl-C need the
# default disposition in their children, whatever the suite was started from.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="session")
def tokenizer_cache(tmp_path_factory):
    """Converted tiktoken tokenizers go to a cache of the suite's own, never the user's ~/.cache/ds2
    (set in the environment, so the ds2 subprocesses that tests start use it too)."""
    path = tmp_path_factory.mktemp("ds2-tokenizer-cache")
    old = os.environ.get("DS2_TOKENIZER_CACHE")
    os.environ["DS2_TOKENIZER_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("DS2_TOKENIZER_CACHE", None)
    else:
        os.environ["DS2_TOKENIZER_CACHE"] = old


@pytest.fixture(autouse=True)
def sigint_as_it_was():
    """A command run in-process may leave its own SIGINT handler behind (a finished quantize or
    serve ignores late signals, as the process would be ending): the next test gets Python's."""
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def checkpoint_copy(tmp_path):
    """`checkpoint_copy("plain_rope_tied_fp16")` -> a copy of that reference case in tmp_path
    (without ref.npz); `checkpoint_copy("ds2-tiny")` copies the bundled model."""
    def copy(case: str) -> Path:
        src = bundled_model_dir() if case == "ds2-tiny" else REFERENCE / case
        return Path(shutil.copytree(src, tmp_path / case, ignore=shutil.ignore_patterns("ref.npz")))
    return copy


def run_split(model, ids, chunks):
    """Feed `ids` in the given chunk lengths; a chunk of 1 is a decode step."""
    cache = model.new_cache(len(ids))
    out, start = [], 0
    for n in chunks:
        out.append(model.forward(ids[start:start + n], cache, all_logits=True))
        start += n
    assert cache.length == len(ids)
    return np.concatenate(out)


def splits(T):
    """Ways to feed T reference tokens: each must reproduce every row."""
    third = T // 3
    return {"all_at_once": [T],
            "one_at_a_time": [1] * T,
            "third_then_decode": [third] + [1] * (T - third),
            "two_chunks_then_decode": [third, third] + [1] * (T - 2 * third),
            "uneven_chunks": [5, 1, 17, 2, 40, 1] + [1] * (T - 66)}


def assert_reference_rows(case, split: str, tol: float) -> None:
    """Every row of a reference case's logits, fed in the named split, within tol."""
    name, model, ids, ref = case
    got = run_split(model, ids, splits(len(ids))[split])
    assert got.dtype == np.float32 and got.shape == ref.shape
    diff = np.abs(got - ref).max(axis=-1)
    assert diff.max() <= tol, f"{name}/{split}: worst row {diff.argmax()} differs by {diff.max():.2e}"


@pytest.fixture
def command_loads(monkeypatch):
    """command_loads(fn): the commands load their model with fn (cli/options.py's `load`)."""
    import ds2cli.cli.options as options_module   # where the commands load their model
    return lambda fn: monkeypatch.setattr(options_module, "load", fn)


@pytest.fixture
def no_loading(command_loads):
    """Fail the test if any weight is loaded: options must be refused before that."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")
    command_loads(load)


@pytest.fixture
def command_samples(monkeypatch):
    """command_samples(make): `ds2 generate` samples with make(model, opts), a sampler of
    (logits, history) (cli/generate_run.py's `sampler_for` is the real one, passed in too)."""
    import ds2cli.cli.generate_run as generate_run
    real = generate_run.sampler_for
    return lambda make: monkeypatch.setattr(generate_run, "sampler_for", lambda model, opts: make(model, opts, real))


@pytest.fixture
def reading_tensors(monkeypatch):
    """reading_tensors(fn): checkpoints' tensors are read through fn(tensors, names, real), real
    the loader's own (weights/checkpoint.py's iter_tensors)."""
    from ds2cli.weights import checkpoint
    real = checkpoint.iter_tensors
    return lambda fn: monkeypatch.setattr(checkpoint, "iter_tensors", lambda *a: fn(*a, real))


@pytest.fixture
def every_matrix_split(monkeypatch):
    """Every low-bit matrix's product cut over the cores, however small (weights/formats: below
    SMALL_MATRIX values a matrix runs whole on one core): ds2-tiny's matrices then go through
    the cut kernels and the helper processes as V2-Lite's do. Weights made inside a command are
    out of a test's reach, hence the module's constant, once, here; so are the cores' and the
    helpers' (products and plans, however small, shared: execution/plans.PLAN_MIN_VALUES)."""
    from ds2cli.execution import cores, helpers
    from ds2cli.weights.formats import base
    monkeypatch.setattr(base, "SMALL_MATRIX", 0)
    monkeypatch.setattr(helpers, "PLAN_MIN_VALUES", 0)
    monkeypatch.setattr(cores, "SPLIT_MIN_VALUES", 0)


def use_small_probes(mp) -> None:
    """`ds2 bench`'s probes on matrices of a few MB: the tests check the accounting, not this
    machine (the bench's command makes its probes: their sizes are the module's, set here)."""
    from ds2cli.cli.bench import probes
    mp.setattr(probes, "SIZES", probes.ProbeSizes(
        matvec_n=1024, gemm_shapes=(("prefill", (64, 256, 256)), ("expert", (8, 256, 352))), ceiling_values=1 << 20))


@pytest.fixture
def small_probes(monkeypatch):
    use_small_probes(monkeypatch)


@pytest.fixture
def without_llguidance(monkeypatch):
    """A machine without the grammar extra: constrained output's engine missing, as when
    llguidance is not installed (it is a test dependency, so its absence is made here)."""
    from ds2cli.generation import grammar as grammars

    def missing():
        raise grammars.GrammarUnavailable(grammars.INSTALL_HINT)
    monkeypatch.setattr(grammars, "_llg", missing)


@pytest.fixture
def serving(monkeypatch):
    """`ds2 serve` through its command, the serving loop replaced: serving(fn) makes
    fn(server, state, thread, ready) run in its place (the port bound, the model loaded)."""
    import ds2cli.cli.serve as serve_module

    def replace(fn) -> None:
        monkeypatch.setattr(serve_module, "serve_forever", fn)
    return replace


@pytest.fixture
def failing_disk(monkeypatch):
    """failing_disk(call, error): the OS call `call` (os.fsync, os.replace) raises `error`, as a
    full disk or a Ctrl-C at that moment would: user files' atomic writes are tested against it
    (a fault inside the kernel's own calls, which only the os module's names can stand for)."""
    import os

    def fail(call: str, error: BaseException) -> None:
        def raising(*args, **kwargs):
            raise error
        monkeypatch.setattr(os, call, raising)
    return fail


# ---- a real Ray cluster (tests/cluster), made by support/ray_local.py ----

@pytest.fixture(scope="session")
def cluster(tmp_path_factory, request):
    """Two nodes (the head and a worker) on 127.0.0.1 inside a private network namespace,
    stopped after the last test that uses it (pytest_runtest_teardown), not at the session's
    end: an idle cluster's processes would take CPU from every later test."""
    from support.ray_local import Cluster, usable
    why = usable()
    if why:
        pytest.skip(why)
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    request.config.stash[CLUSTER] = c
    try:
        c.start_head()
        c.own.append(c.add_node())
        c.nodes.clear()           # the session's own worker stays until stop: tests add their own
        yield c
    finally:
        c.stop()


CLUSTER = pytest.StashKey()          # the session's cluster, once made
LAST_CLUSTER_TEST = pytest.StashKey()


def pytest_collection_modifyitems(session, config, items):
    """The tests that use the session's cluster run one after another, where the first of them
    is (tests/cli's signal tests and a bench script's come beside tests/cluster), so that the
    cluster lives only while they run."""
    users = [item for item in items if "cluster" in getattr(item, "fixturenames", ())]
    if users:
        first, chosen = items.index(users[0]), set(map(id, users))
        rest = [item for item in items if id(item) not in chosen]
        items[:] = rest[:first] + users + rest[first:]
    config.stash[LAST_CLUSTER_TEST] = users[-1].nodeid if users else None


def pytest_runtest_teardown(item, nextitem):
    if item.nodeid == item.config.stash.get(LAST_CLUSTER_TEST, None):
        c = item.config.stash.get(CLUSTER, None)
        if c is not None:
            c.stop()          # again at the session's end: stopping twice is harmless
