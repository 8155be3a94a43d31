"""The tests here check how work is shared between this process, its threads and its helper
processes: they run with every allowed core counted free, whatever else the machine runs at
the time (parallel/load.py, whose own test gives it a machine it reads)."""

import pytest

from ds2cli.parallel import cores


@pytest.fixture(autouse=True)
def every_core_free(monkeypatch, request):
    if request.module.__name__.rsplit(".", 1)[-1] != "test_load":
        monkeypatch.setattr(cores.workers().load, "free", lambda most, own_pids=(): most)
    yield
