"""Reads from a Hugging Face endpoint are bounded in all: the shards' headers together, and the
whole read by one deadline; HF_HUB_OFFLINE is named only when it is really set."""

import time

import pytest

from ds2cli.errors import ConfigError
from ds2cli.weights import hub


@pytest.mark.parametrize("value, offline", [("1", True), ("ON", True), ("true", True), ("yes", True),
                                            ("0", False), ("", False), ("off", False)])
def test_hf_hub_offline_is_named_only_when_set(monkeypatch, value, offline):
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    message = str(hub.failed("org/x is not cached", "downloading org/x@main", "org/x", "no network"))
    assert ("HF_HUB_OFFLINE is set" in message) is offline


def test_the_shards_headers_share_one_byte_budget():
    budget = hub.Budget(1000, time.monotonic() + 60)
    budget.take(600, "https://hub/org/x/resolve/c/model-1.safetensors")
    with pytest.raises(ConfigError, match="add up to more than.*model-2.safetensors"):
        budget.take(600, "https://hub/org/x/resolve/c/model-2.safetensors")


def test_a_dripping_server_meets_the_deadline():
    """read_range checks the deadline between the chunks a slow server sends."""
    class Response:
        status_code, headers = 206, {"Content-Range": "bytes 0-99/1000"}

        def iter_bytes(self):
            for _ in range(100):
                yield b"x"                       # one byte a chunk, as a drip sends it

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Session:
        def stream(self, *args, **kwargs):
            return Response()
    budget = hub.Budget(1 << 20, time.monotonic() - 1)          # the deadline has passed
    with pytest.raises(OSError, match="took more than"):
        hub.read_range("https://hub/org/x/resolve/c/model.safetensors", 0, 100, budget, session=Session())
