"""`ds2 serve --prompt-cache-dir`: conversations the pool evicts (and all of them at a stop) go
to disk within a byte budget and come back, bit for bit, for a request or a server that
continues them; another model's files in the directory are left alone."""

import numpy as np
import pytest

import ds2cli
from ds2cli.server.prompt_cache import PromptCache
from ds2cli.server.prompt_disk import SUFFIX, DiskPool
from test_serve import request, running


@pytest.fixture(scope="module")
def model():
    return ds2cli.load()


def filled(model, ids, ctx=64):
    cache = model.new_cache(ctx)
    model.forward(ids, cache)
    return cache


def test_an_evicted_conversation_comes_back_from_disk(model, tmp_path):
    cache_bytes = model.new_cache(1).bytes_per_token * 64
    pool = PromptCache(lambda: model.new_cache(64), cache_bytes, cache_bytes, DiskPool(tmp_path, 1 << 30, model))
    a, b = list(range(10, 30)), list(range(40, 55))
    cache, _ = pool.take(a)
    model.forward(a, cache)
    want = cache.latent[:, :len(a)].copy()
    pool.put(a, cache)
    cache, keep = pool.take(b)                   # the one slot: a is evicted, to disk
    assert keep == 0 and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1
    model.forward(b, cache)
    pool.put(b, cache)
    cache, keep = pool.take(a + [7, 8])          # a continued: read back, not recomputed
    assert keep == len(a)
    np.testing.assert_array_equal(cache.latent[:, :len(a)], want)


def test_a_restarted_server_finds_what_the_last_one_flushed(model, tmp_path):
    ids = list(range(5, 25))
    cache_bytes = model.new_cache(1).bytes_per_token * 64
    first = PromptCache(lambda: model.new_cache(64), cache_bytes, 4 * cache_bytes, DiskPool(tmp_path, 1 << 30, model))
    cache, _ = first.take(ids)
    model.forward(ids, cache)
    first.put(ids, cache)
    first.flush()
    later = PromptCache(lambda: model.new_cache(64), cache_bytes, 4 * cache_bytes, DiskPool(tmp_path, 1 << 30, model))
    cache, keep = later.take(ids + [3])
    assert keep == len(ids) and cache.length == len(ids)


def test_the_directory_stays_within_its_budget_oldest_first(model, tmp_path):
    one = filled(model, list(range(5, 45)))
    disk = DiskPool(tmp_path, 10 ** 9, model)
    disk.save(list(range(5, 45)), one)
    size_of_one = disk.nbytes
    disk.budget = int(2.5 * size_of_one)
    for k in range(4):
        ids = [100 + k] + list(range(6, 45))
        disk.save(ids, filled(model, ids))
    assert disk.nbytes <= disk.budget and len(disk.index) == 2
    assert [int(ids[0]) for ids in disk.index.values()] == [102, 103]      # the newest kept


@pytest.mark.slow
def test_files_of_another_model_are_left_alone(model, tmp_path):
    other = ds2cli.load(quantize=8)              # same checkpoint, another form: another fingerprint
    ids = list(range(5, 25))
    DiskPool(tmp_path, 1 << 30, other).save(ids, filled(other, ids))
    (tmp_path / f"junk{SUFFIX}").write_bytes(b"not a cache")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    disk = DiskPool(tmp_path, 1 << 30, model)
    assert disk.index == {} and disk.best(np.asarray(ids + [1]))[1] == 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_through_the_server_a_conversation_survives_a_restart(model, tmp_path):
    body = {"model": "m", "messages": [{"role": "user", "content": "What is 12 + 30?"}], "max_tokens": 8,
            "temperature": 0}
    with running(model, disk=DiskPool(tmp_path, 1 << 30, model)) as (port, state, _):
        status, first, _ = request(port, "POST", "/v1/chat/completions", body)
        assert status == 200
        state.scheduler.close()
        state.scheduler.wait_idle()
        state.scheduler.prompt_cache.flush()     # what serve_until does at a stop
    follow = {**body, "messages": body["messages"] + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And 5 + 5?"}]}
    with running(model, disk=DiskPool(tmp_path, 1 << 30, model)) as (port, state, _):
        status, answer, _ = request(port, "POST", "/v1/chat/completions", follow)
    assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

