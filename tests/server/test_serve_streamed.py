"""ds2 serve over a model whose routed experts are streamed (`--memory-budget`): the same
greedy replies as the model held whole, and a read that fails mid-request is a 500 naming the
cause, after which the server goes on serving."""

import errno
import os

import pytest

import ds2cli
from ds2cli.weights import memory
from ds2cli.weights.quantize import quantize_checkpoint
from ds2cli.weights.source import bundled_model_dir
from test_serve import request, running


class Failing:
    """An ExpertCache's `system` (the calls it reads with) whose reads fail as a broken disk's."""

    def __init__(self, preadv):
        self.preadv, self.open = preadv, os.open


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    q8 = tmp_path_factory.mktemp("serve-streamed") / "tiny-q8"
    quantize_checkpoint(bundled_model_dir(), q8, 8)
    full = ds2cli.load(q8)
    plan = memory.streamed(full.config, full.quantization, 1024, 10 ** 12)
    streamed = ds2cli.load(q8, context=1024, memory_budget=plan["resident"] + 3 * plan["expert"])
    yield full, streamed
    streamed.executor.stop()


def ask(port, question: str):
    body = {"model": "ds2-tiny", "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": 24}
    return request(port, "POST", "/v1/chat/completions", body)


@pytest.mark.slow
def test_a_streamed_model_serves_the_same_replies_and_a_read_error_is_a_500(models):
    full, streamed = models
    with running(full) as (port, _, _):
        want = [ask(port, q)[1]["choices"][0]["message"]["content"] for q in ("What is 451 - 123?", "Count from 3 to 9.")]
    with running(streamed) as (port, _, lines):
        got = [ask(port, q)[1]["choices"][0]["message"]["content"] for q in ("What is 451 - 123?", "Count from 3 to 9.")]
        assert got == want and streamed.streamed.stats["misses"] > 0
        def failing(fd, buffers, offset):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        cache = streamed.streamed
        for key in list(cache.slot_of):              # nothing cached: the next request must read
            cache.free.append(cache.slot_of.pop(key))
        cache.system = Failing(failing)              # the disk under the cache fails its reads
        status, body, _ = ask(port, "What is 451 - 123?")
        assert status == 500 and body["error"]["message"].startswith("cannot read expert")
        assert "Input/output error" in body["error"]["message"]
        cache.system = os
        status, body, _ = ask(port, "What is 451 - 123?")
        assert status == 200 and body["choices"][0]["message"]["content"] == want[0]
