"""`ds2 serve --prompt-cache-dir`: conversations the pool evicts (and all of them at a stop) go
to disk within a byte budget and come back, bit for bit, for a request or a server that
continues them, read on the request's thread; another model's files in the directory, and
anything that is not a regular file, are left alone and the server starts."""

import os
import stat
import struct
import threading
import tracemalloc

import numpy as np
import pytest

import ds2cli
from ds2cli.generation.saved_cache import MAGIC
from ds2cli.server.prompt_cache import PromptCache
from ds2cli.server.prompt_disk import SUFFIX, DiskPool
from ds2cli.user_files import Lock, NotRegularError, open_regular
from test_serve import request, running


@pytest.fixture(scope="module")
def model():
    return ds2cli.load()


def filled(model, ids, ctx=64):
    cache = model.new_cache(ctx)
    model.forward(ids, cache)
    return cache


def pool_of(model, disk, slots):
    cache_bytes = model.new_cache(1).bytes_per_token * 64
    return PromptCache(lambda: model.new_cache(64), cache_bytes, slots * cache_bytes, disk)


def take(pool, ids):
    """What the scheduler does for a request: its thread reads the disk, then the pool hands a cache."""
    read = pool.disk.read(ids, pool.longest(ids)[1])
    return pool.take(ids, read)


def files(directory):
    return {p.name: (p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p) if p.is_symlink() else None)
            for p in directory.iterdir()}


def test_an_evicted_conversation_comes_back_from_disk(model, tmp_path):
    pool = pool_of(model, DiskPool(tmp_path, 1 << 30, model), 1)
    a, b = list(range(10, 30)), list(range(40, 55))
    cache, _ = take(pool, a)
    model.forward(a, cache)
    want = cache.latent[:, :len(a)].copy()
    pool.put(a, cache)
    cache, keep = take(pool, b)                  # the one slot: a is evicted, to disk
    assert keep == 0 and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1
    model.forward(b, cache)
    pool.put(b, cache)
    cache, keep = take(pool, a + [7, 8])         # a continued: read back, not recomputed
    assert keep == len(a)
    np.testing.assert_array_equal(cache.latent[:, :len(a)], want)


@pytest.mark.slow
def test_a_conversation_sharing_a_first_token_is_not_cut_for_another(model, tmp_path):
    """Every prompt begins with bos: the pooled conversation that shares it stays whole (on disk
    when the pool has no room), and the other gets the shared prefix copied."""
    pool = pool_of(model, DiskPool(tmp_path, 1 << 30, model), 1)
    a, b = [0] + list(range(10, 40)), [0] + list(range(50, 60))
    cache, _ = take(pool, a)
    model.forward(a, cache)
    pool.put(a, cache)
    cache, keep = take(pool, b)
    assert keep == 1                              # bos, from a
    model.forward(b[1:], cache)
    pool.put(b, cache)
    cache, keep = take(pool, a + [5])
    assert keep == len(a)
    memory_only = pool_of(model, None, 3)        # with room, both stay in memory whole
    for ids in (a, b):
        cache, _ = memory_only.take(ids)
        model.forward(ids[memory_only.longest(ids)[1]:], cache)
        memory_only.put(ids, cache)
    assert sorted(len(e.ids) for e in memory_only.entries) == [len(b), len(a)]


def test_a_restarted_server_finds_what_the_last_one_flushed(model, tmp_path):
    ids = list(range(5, 25))
    first = pool_of(model, DiskPool(tmp_path, 1 << 30, model), 4)
    cache, _ = take(first, ids)
    model.forward(ids, cache)
    first.put(ids, cache)
    first.flush()
    later = pool_of(model, DiskPool(tmp_path, 1 << 30, model), 4)
    cache, keep = take(later, ids + [3])
    assert keep == len(ids) and cache.length == len(ids)


@pytest.mark.slow
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
    assert [int(saved.ids[0]) for saved in disk.index.values()] == [102, 103]      # the newest kept


def test_a_killed_writers_temporaries_are_removed_at_start_or_counted(model, tmp_path):
    disk = DiskPool(tmp_path, 1 << 30, model)
    disk.close()
    ours = tmp_path / f".{disk.prefix}-{'0' * 24}{SUFFIX}.abc123.tmp"
    theirs = tmp_path / f".{'f' * 16}-{'0' * 24}{SUFFIX}.abc123.tmp"          # another model's writer
    ours.write_bytes(b"x" * 5000)
    theirs.write_bytes(b"y" * 7000)
    lines = []
    with Lock(tmp_path / disk.prefix, "test"):   # another server of this model is writing there
        held = DiskPool(tmp_path, 1 << 30, model, lines.append)
        assert ours.exists() and held.nbytes == 5000 and any("another server" in line for line in lines)
    disk = DiskPool(tmp_path, 1 << 30, model, lines.append)
    assert not ours.exists() and theirs.read_bytes() == b"y" * 7000 and disk.nbytes == 0
    assert any(ours.name in line for line in lines)


def strange_files(tmp_path, prefix):
    """Every kind of path that is not a regular file, named as a cache of this model or of none."""
    name = f"{prefix}-{'1' * 24}{SUFFIX}"
    os.mkfifo(tmp_path / name)
    (tmp_path / f"dangling{SUFFIX}").symlink_to(tmp_path / "nowhere")
    (tmp_path / f"{prefix}-{'2' * 24}{SUFFIX}").symlink_to(tmp_path / f"{prefix}-{'3' * 24}{SUFFIX}")
    (tmp_path / f"{prefix}-{'3' * 24}{SUFFIX}").symlink_to(tmp_path / f"{prefix}-{'2' * 24}{SUFFIX}")   # a loop
    (tmp_path / f"dir{SUFFIX}").mkdir()
    try:
        os.mknod(tmp_path / f"{prefix}-{'4' * 24}{SUFFIX}", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        kinds = 6
    except PermissionError:                      # not root: no device
        kinds = 5
    return kinds


@pytest.mark.slow
def test_fifos_devices_symlinks_and_directories_are_skipped_with_a_line(model, tmp_path):
    prefix = DiskPool(tmp_path, 1 << 30, model).prefix
    kinds = strange_files(tmp_path, prefix)
    before = files(tmp_path)
    lines = []
    disk = DiskPool(tmp_path, 1 << 30, model, lines.append)      # a FIFO opened would block here
    skipped = [line for line in lines if "skipping" in line]
    assert disk.index == {} and len(skipped) == kinds
    assert sum("a FIFO" in line for line in skipped) == 1 and sum("a symlink" in line for line in skipped) == 3
    ids = list(range(5, 25))
    disk.save(ids, filled(model, ids))           # the pool works beside them
    assert disk.read(ids + [1], 0) is not None
    after = files(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before


def test_a_file_is_opened_only_if_regular_and_never_through_a_link(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(NotRegularError, match="a FIFO"):
        open_regular(tmp_path / "fifo")                           # at once: no writer awaited
    (tmp_path / "file").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    with pytest.raises(OSError):
        open_regular(tmp_path / "link", follow=False)
    with open_regular(tmp_path / "link") as f:
        assert f.read() == b"x"


def test_a_header_claiming_240_mb_is_skipped_unread(model, tmp_path):
    prefix = DiskPool(tmp_path, 1 << 30, model).prefix
    huge = tmp_path / f"{prefix}-{'5' * 24}{SUFFIX}"
    with open(huge, "wb") as f:                  # sparse: as long as its header claims
        f.write(MAGIC + struct.pack("<I", 240 << 20) + b"{")
        f.truncate((240 << 20) + 64)
    lines = []
    tracemalloc.start()
    try:
        disk = DiskPool(tmp_path, 1 << 30, model, lines.append)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert disk.index == {} and peak < 4 << 20 and huge.stat().st_size == (240 << 20) + 64
    assert any("header of 251658240 bytes" in line for line in lines)


def chat(port, messages):
    body = {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0}
    status, answer, _ = request(port, "POST", "/v1/chat/completions", body)
    assert status == 200
    return answer


def continued(question, answer):
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And 5 + 5?"}]


def cached(answer):
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_through_the_server_a_conversation_survives_a_restart(model, tmp_path):
    question = "What is 12 + 30?"
    with running(model, disk=DiskPool(tmp_path, 1 << 30, model)) as (port, state, _):
        first = chat(port, [{"role": "user", "content": question}])
        state.scheduler.close()
        state.scheduler.wait_idle()
        state.scheduler.prompt_cache.flush()     # what serve_until does at a stop
    with running(model, disk=DiskPool(tmp_path, 1 << 30, model)) as (port, state, _):
        answer = chat(port, continued(question, first))
    assert cached(answer) >= first["usage"]["prompt_tokens"]


@pytest.mark.slow
def test_after_40_other_conversations_the_first_is_continued_from_disk_whole(model, tmp_path, monkeypatch):
    """A pool of two caches: 40 conversations later the first is long evicted, and continuing it
    reuses every token a pool that had kept it would (read on the request's thread)."""
    question = "What is 12 + 30?"
    with running(model) as (port, _, _):         # the reference: continued at once, from memory
        first = chat(port, [{"role": "user", "content": question}])
        want = cached(chat(port, continued(question, first)))
    assert want > first["usage"]["prompt_tokens"]
    readers = []
    read = DiskPool.read
    monkeypatch.setattr(DiskPool, "read", lambda self, *a: readers.append(threading.current_thread().name) or read(self, *a))
    two = 2 * model.new_cache(1).bytes_per_token * 1024
    with running(model, budget=two, disk=DiskPool(tmp_path, 1 << 30, model)) as (port, state, _):
        again = chat(port, [{"role": "user", "content": question}])
        assert again["choices"][0]["message"] == first["choices"][0]["message"]      # greedy: the same reply
        for k in range(40):
            chat(port, [{"role": "user", "content": f"What is {k} + {k + 7}?"}])
        assert len(list(tmp_path.glob(f"*{SUFFIX}"))) >= 39
        answer = chat(port, continued(question, first))
    assert cached(answer) == want
    assert readers and "ds2-scheduler" not in readers


def stop(state):
    """What serve_until does at a stop: the running requests finish, the pool goes to disk."""
    state.scheduler.close()
    state.scheduler.wait_idle()
    state.scheduler.prompt_cache.flush()


@pytest.mark.slow
def test_two_models_servers_share_a_directory_and_never_touch_each_others_files(model, tmp_path):
    other = ds2cli.load(quantize=8)              # same checkpoint, another form: another fingerprint
    (tmp_path / f"junk{SUFFIX}").write_bytes(b"not a cache")
    question = "What is 12 + 30?"
    with running(model, disk=DiskPool(tmp_path, 1 << 30, model)) as (port_a, state_a, _), \
            running(other, disk=DiskPool(tmp_path, 1 << 30, other)) as (port_b, state_b, _):
        first_a = chat(port_a, [{"role": "user", "content": question}])
        first_b = chat(port_b, [{"role": "user", "content": question}])        # the same tokens
        stop(state_a)
        stop(state_b)
    saved = files(tmp_path)
    caches = [name for name in saved if name.endswith(SUFFIX) and name != f"junk{SUFFIX}"]
    assert len(caches) == 2 and len({name.split("-")[0] for name in caches}) == 2
    lines = []
    with running(model, disk=DiskPool(tmp_path, 1 << 30, model, lines.append)) as (port_a, _, _), \
            running(other, disk=DiskPool(tmp_path, 1 << 30, other, lines.append)) as (port_b, _, _):
        answer_a = chat(port_a, continued(question, first_a))
        answer_b = chat(port_b, continued(question, first_b))
    assert cached(answer_a) >= first_a["usage"]["prompt_tokens"]
    assert cached(answer_b) >= first_b["usage"]["prompt_tokens"]
    assert lines == [] and {k: v for k, v in files(tmp_path).items() if k in saved} == saved
