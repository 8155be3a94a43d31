"""Options past what the machine or the model has: --threads above the cores is capped with a
note, and chat's --memory-budget counts the cache at the context the chat keeps (the model's
own when it is under chat's default), so the least budget `ds2 inspect` reports runs it."""

import json

import pytest
from click.testing import CliRunner

from ds2cli.cli.main import DEFAULT_CHAT_CTX, main
from ds2cli.cli.options import Threads, usable_cores
from ds2cli.weights import memory
from ds2cli.weights.quantize import quantize_checkpoint
from ds2cli.weights.source import bundled_model_dir, open_model


def run(*args, input=None):
    return CliRunner().invoke(main, list(map(str, args)), input=input)


def test_threads_are_capped_at_the_cores_given():
    assert Threads(cores=3).convert("99999999999999999999", None, None) == 3
    assert Threads(cores=3).convert("3", None, None) == 3
    assert Threads(cores=3).convert("2", None, None) == 2


@pytest.mark.slow
def test_threads_beyond_any_machine_run_with_one_note():
    """Was an OverflowError traceback from threadpoolctl."""
    r = run("generate", "--chat", "What is 2 + 2?", "--temp", "0", "--threads", "99999999999999999999")
    assert r.exit_code == 0 and r.stdout == "2 + 2 = 4.\n", r.output
    n = usable_cores()
    cores = f"{n} core" + ("s" if n != 1 else "")
    assert r.stderr == f"(--threads 99999999999999999999: this process may use {cores}, so {n} threads)\n"


@pytest.mark.slow
def test_chat_runs_in_the_least_budget_inspect_reports(tmp_path):
    """ds2-tiny's context (1,024) is under chat's default (4,096): inspect counts its cache at
    1,024 positions, and so must chat."""
    q8 = tmp_path / "q8"
    quantize_checkpoint(bundled_model_dir(), q8, 8)
    source = open_model(q8)
    config = source.config
    assert config.max_position_embeddings < DEFAULT_CHAT_CTX
    report = json.loads(run("inspect", q8, "--json").stdout)
    [streaming] = report["memory"]["streaming"]
    assert streaming["context"] == config.max_position_embeddings
    least = memory.streamed(config, source.stored, config.max_position_embeddings, 1 << 62)["least"]
    for budget in (least, streaming["least_budget_bytes"]):
        r = run("chat", "-m", q8, "--memory-budget", budget, "--temp", "0", input="What is 2 + 2?\n")
        assert r.exit_code == 0 and r.stdout == "2 + 2 = 4.\n", r.stderr
