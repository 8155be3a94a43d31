"""Conversations and documents read once: a latent cache saved with its tokens (saved_cache.py),
`ds2 generate --prompt-cache FILE` and `ds2 chat --session FILE`. Resuming gives the logits of a
run never interrupted; a file from another model, truncated, edited, a directory, or written by
another version is one error line and stays as it was; a failed save leaves the old file whole."""

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ds2cli
from ds2cli.generation import saved_cache
from ds2cli.generation.saved_cache import SavedCacheError

LONG = Path(__file__).parents[1] / "data" / "long" / "long_yarn_3k"


@pytest.fixture(scope="module")
def model():
    return ds2cli.load()


def ds2(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "ds2cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_resumed_cache_gives_the_logits_of_an_uninterrupted_run(model, tmp_path):
    ids = model.tokenizer.encode("ROMEO: But soft, what light through yonder window breaks?")
    more = model.tokenizer.encode(" It is the east, and Juliet is the sun.")[1:]
    cache = model.new_cache(64)
    model.forward(ids, cache)
    saved_cache.save(tmp_path / "s.ds2", model, cache, ids, {"note": "x"})
    resumed, tokens, state = saved_cache.load(tmp_path / "s.ds2", model, 64)
    assert tokens == ids and state == {"note": "x"} and resumed.length == len(ids)
    np.testing.assert_array_equal(resumed.latent[:, :len(ids)], cache.latent[:, :len(ids)])
    # the same call shapes on the same values: the very same logits
    np.testing.assert_array_equal(model.forward(more, resumed, all_logits=True),
                                  model.forward(more, cache, all_logits=True))


def test_a_new_prompt_keeps_only_the_common_prefix(model, tmp_path):
    ids = list(range(5, 25))
    cache = model.new_cache(32)
    model.forward(ids, cache)
    saved_cache.save(tmp_path / "p.ds2", model, cache, ids)
    _, kept, _ = saved_cache.load(tmp_path / "p.ds2", model, 32, match=ids[:12] + [99, 100])
    assert kept == ids[:12]
    _, kept, _ = saved_cache.load(tmp_path / "p.ds2", model, 32, match=ids)
    assert kept == ids[:-1]                 # the last prompt token always runs, for its logits


def saved_file(model, tmp_path) -> Path:
    ids = model.tokenizer.encode("What is 2 + 2?")
    cache = model.new_cache(32)
    model.forward(ids, cache)
    path = tmp_path / "s.ds2"
    saved_cache.save(path, model, cache, ids)
    return path


def header_edit(edit):
    def apply(path: Path):
        raw = path.read_bytes()
        n = struct.unpack("<I", raw[8:12])[0]
        h = json.loads(raw[12:12 + n])
        edit(h)
        head = json.dumps(h).encode()
        path.write_bytes(raw[:8] + struct.pack("<I", len(head)) + head + raw[12 + n:])
    return apply


def flip_last_byte(path: Path):
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("spoil, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes() + b"\0" * 8), "longer than its header says"),
    (flip_last_byte, "changed after ds2 wrote it"),
    (header_edit(lambda h: h.update(version=99)), "another version of ds2"),
    (header_edit(lambda h: h.update(model="0" * 64)), "another model"),
    (header_edit(lambda h: h["tokens"].__setitem__(0, 10 ** 9)), "tokens this model does not have"),
    (header_edit(lambda h: h.update(length=10 ** 12)), "corrupt header"),
    (header_edit(lambda h: h.update(layers="2")), "layers"),
    (lambda p: p.write_bytes(b"DS2CACHE" + struct.pack("<I", 2 ** 31) + b"{}"), "header claims"),
    (lambda p: p.write_bytes(b"DS2CACHE" + struct.pack("<I", 3) + b"{]}"), "corrupt header"),
    (lambda p: p.write_bytes(b"PK\x03\x04 a zip file"), "not a ds2 session or prompt cache"),
    (lambda p: p.write_bytes(b""), "not a ds2 session or prompt cache"),
], ids=["truncated", "extended", "edited", "version", "other_model", "bad_token", "huge_length", "typed_dims",
        "huge_header", "bad_json", "other_format", "empty"])
def test_hostile_files_are_one_error_and_stay_as_they_were(model, tmp_path, spoil, message):
    path = saved_file(model, tmp_path)
    spoil(path)
    before = path.read_bytes()
    with pytest.raises(SavedCacheError, match=message):
        saved_cache.load(path, model, 32)
    assert path.read_bytes() == before


@pytest.mark.slow
def test_a_file_of_another_model_is_refused(model, tmp_path):
    other = ds2cli.load(LONG)
    ids = list(range(3, 20))
    cache = other.new_cache(32)
    other.forward(ids, cache)
    saved_cache.save(tmp_path / "o.ds2", other, cache, ids)
    with pytest.raises(SavedCacheError, match="another model"):
        saved_cache.load(tmp_path / "o.ds2", model, 32)
    q8 = ds2cli.load(quantize=8)         # the same checkpoint in another form computes other latents
    cache = q8.new_cache(32)
    q8.forward(ids, cache)
    saved_cache.save(tmp_path / "q.ds2", q8, cache, ids)
    with pytest.raises(SavedCacheError, match="another model"):
        saved_cache.load(tmp_path / "q.ds2", model, 32)


def test_a_saved_cache_longer_than_the_context_names_both(model, tmp_path):
    path = saved_file(model, tmp_path)
    with pytest.raises(SavedCacheError, match="more than the context of 4 tokens"):
        saved_cache.load(path, model, 4)


def test_a_failed_save_leaves_the_previous_file_whole(model, tmp_path, failing_disk):
    path = saved_file(model, tmp_path)
    before = path.read_bytes()
    failing_disk("fsync", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    cache = model.new_cache(8)
    model.forward([1, 2, 3], cache)
    with pytest.raises(SavedCacheError, match="No space left on device.*unchanged"):
        saved_cache.save(path, model, cache, [1, 2, 3])
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["s.ds2"]


@pytest.mark.slow
def test_generate_prompt_cache_reuses_the_prompt_and_answers_the_same(tmp_path):
    prompt = "ROMEO: " + "But soft, what light through yonder window breaks? " * 4
    cache = tmp_path / "doc.ds2"
    first = ds2("generate", prompt, "-n", "12", "--temperature", "0", "--prompt-cache", cache)
    assert first.returncode == 0, first.stderr
    assert cache.is_file()
    again = ds2("generate", prompt, "-n", "12", "--temperature", "0", "--prompt-cache", cache, "--json")
    assert again.returncode == 0, again.stderr
    n = json.loads(again.stdout)["prompt_tokens"]
    assert "already read" in again.stderr and json.loads(again.stdout)["text"] == first.stdout.rstrip("\n")
    assert n == 1                            # only the prompt's last token ran again
    plain = ds2("generate", prompt, "-n", "12", "--temperature", "0")
    assert plain.stdout == first.stdout


@pytest.mark.slow
@pytest.mark.parametrize("spoil", ["directory", "session", "transcript"])
def test_generate_refuses_what_is_not_a_prompt_cache_and_leaves_it(tmp_path, model, spoil):
    """A directory, a chat session or any other file given as --prompt-cache is one error line,
    before anything loads, and the file is byte for byte as it was."""
    path = tmp_path / "x"
    if spoil == "directory":
        path.mkdir()
    elif spoil == "session":
        cache = model.new_cache(8)
        model.forward([1, 2, 3], cache)
        saved_cache.save(path, model, cache, [1, 2, 3], {"messages": []}, kind=saved_cache.SESSION)
    else:
        path.write_text('[{"role": "user", "content": "hi"}]')
    before = None if spoil == "directory" else path.read_bytes()
    r = ds2("generate", "hello", "-n", "2", "--prompt-cache", path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert r.stdout == ""
    if spoil == "session":
        assert "is a chat session, not a prompt cache" in lines[0]
    assert (path.is_dir() if before is None else path.read_bytes() == before)


@pytest.mark.slow
def test_a_prompt_cache_of_another_version_or_model_is_rebuilt(tmp_path, model):
    """llama-cli's behaviour: a prompt cache that belongs to another model or ds2 version is a
    cache, not the user's work: one warning, then it is written again for this model."""
    path = saved_file(model, tmp_path)
    header_edit(lambda h: h.update(version=0))(path)
    r = ds2("generate", "hello", "-n", "2", "--temperature", "0", "--prompt-cache", path)
    assert r.returncode == 0, r.stderr
    assert "another version of ds2" in r.stderr and "rebuilding it" in r.stderr
    tokens, _ = saved_cache.load_into(path, model, model.new_cache(32))
    assert tokens == model.tokenizer.encode("hello")


@pytest.mark.slow
def test_chat_session_resumes_without_reading_again(tmp_path):
    """Two chats over one --session file reply as one chat of both messages does."""
    session = tmp_path / "chat.ds2"
    one = ds2("chat", "--temperature", "0", "-n", "20", "--session", session, stdin="What is 12 + 30?\n")
    assert one.returncode == 0, one.stderr
    assert session.is_file() and "session saved" in one.stderr
    two = ds2("chat", "--temperature", "0", "-n", "20", "--session", session, stdin="What is 451 - 123?\n")
    assert two.returncode == 0, two.stderr
    assert "resumed 2 messages" in two.stderr and "already read" in two.stderr
    both = ds2("chat", "--temperature", "0", "-n", "20", stdin="What is 12 + 30?\nWhat is 451 - 123?\n")
    assert one.stdout + two.stdout == both.stdout
    state = saved_cache.load(session, ds2cli.load(), 1024, kind=saved_cache.SESSION)
    assert [m["role"] for m in state[2]["messages"]] == ["user", "assistant", "user", "assistant"]


@pytest.mark.slow
def test_chat_session_and_load_are_exclusive(tmp_path):
    r = ds2("chat", "--session", tmp_path / "a", "--load", tmp_path / "b", stdin="")
    assert r.returncode == 2 and "error:" in r.stderr.lower()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file whatever its mode")
def test_an_unreadable_session_file_is_an_error_line(tmp_path, model):
    path = saved_file(model, tmp_path)
    path.chmod(0)
    try:
        r = ds2("chat", "--session", path, stdin="hi\n")
        assert r.returncode == 1 and r.stderr.strip().startswith("error: cannot read")
    finally:
        path.chmod(0o600)
    shutil.rmtree(tmp_path, ignore_errors=True)
