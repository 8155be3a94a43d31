"""Nothing the user had is lost: sessions and prompt caches know their kind, survive every way a
process ends and are never written over by the other kind; inputs are measured before they are
read. Files that must stay are compared byte for byte; sizes are bounded by counts and
tracemalloc, not by the clock."""

import json
import os
import resource
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest

import ds2cli
from ds2cli.cli.saved_state import save_on_leaving
from ds2cli.errors import Ds2Error
from ds2cli.generation import saved_cache
from ds2cli.generation.conversation import ChatSession, read_messages
from ds2cli.model.transformer import Step
from ds2cli.user_files import Lock, LockedError, TooLargeError, read_bounded, write_atomic

sys.path.insert(0, os.path.dirname(__file__))
from test_chat_repl import PROMPT, STARTUP, Terminal  # noqa: E402


def ds2(*args, stdin=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "ds2cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def one_error(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    return lines[0]


@pytest.fixture(scope="module")
def model():
    return ds2cli.load()


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A chat session of one turn, made as a user makes it."""
    path = tmp_path_factory.mktemp("s") / "s.ds2"
    r = ds2("chat", "--temperature", "0", "--session", path, stdin="What is 2 + 2?\n")
    assert r.returncode == 0, r.stderr
    return path.read_bytes()


def session_at(tmp_path, session) -> "os.PathLike":
    path = tmp_path / "s.ds2"
    path.write_bytes(session)
    return path


def messages_of(path) -> list[dict]:
    with open(path, "rb") as f:
        n = struct.unpack("<I", f.read(12)[8:])[0]
        return json.loads(f.read(n))["state"]["messages"]


# ---- files know what they are ----

@pytest.mark.slow
def test_a_prompt_cache_never_writes_over_a_session(tmp_path, session):
    path = session_at(tmp_path, session)
    line = one_error(ds2("generate", "hi", "-n", "3", "--prompt-cache", path))
    assert f"{path} is a chat session, not a prompt cache" in line
    assert path.read_bytes() == session


@pytest.mark.slow
def test_a_session_is_not_a_prompt_cache_nor_a_transcript(tmp_path, model):
    cache = tmp_path / "p.ds2"
    assert ds2("generate", "hi", "-n", "2", "--prompt-cache", cache).returncode == 0
    before = cache.read_bytes()
    line = one_error(ds2("chat", "--session", cache, stdin="What is 1 + 1?\n"))
    assert "is a prompt cache, not a chat session" in line and cache.read_bytes() == before
    transcript = tmp_path / "t.json"
    transcript.write_text('[{"role": "user", "content": "hi"}]')
    line = one_error(ds2("chat", "--session", transcript, stdin="What is 1 + 1?\n"))
    assert "not a ds2 session" in line and transcript.read_text() == '[{"role": "user", "content": "hi"}]'


@pytest.mark.slow
def test_a_session_of_another_model_keeps_its_conversation(tmp_path, session):
    path = session_at(tmp_path, session)
    r = ds2("chat", "--temperature", "0", "--quantize", "8", "--session", path, stdin="What is 3 + 3?\n")
    assert r.returncode == 0, r.stderr
    assert "another model" in r.stderr and "read again" in r.stderr and "resumed 2 messages" in r.stderr
    assert [m["content"] for m in messages_of(path) if m["role"] == "user"] == ["What is 2 + 2?", "What is 3 + 3?"]


# ---- saved as the conversation goes ----

@pytest.mark.slow
def test_a_session_whose_last_save_fails_exits_1_naming_the_file(tmp_path):
    """`ulimit -f`: the kernel refuses to grow a file past 200 bytes (EFBIG; Python ignores
    SIGXFSZ), less than an empty session takes, so the save as the chat ends fails: exit 1 and
    one line naming the file (it exited 0)."""
    path = tmp_path / "s.ds2"
    r = subprocess.run([sys.executable, "-m", "ds2cli", "chat", "--session", str(path)], input="",
                       capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200)))
    line = one_error(r)
    assert line.startswith(f"error: cannot write {path}: File too large") and not path.exists()


def test_the_last_save_says_whether_the_session_was_saved(tmp_path, model, capsys):
    session = ChatSession(model, capacity=32)
    assert save_on_leaving(session, tmp_path / "s.ds2") is True
    missing = tmp_path / "gone" / "s.ds2"
    assert save_on_leaving(session, missing) is False
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"error: cannot write {missing}: No such file or directory; the previous file, if any, is unchanged"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_chat_killed_after_a_turn_keeps_it(tmp_path, sig):
    """On a pseudo-terminal: one turn, then SIGTERM (or SIGHUP, the terminal closed) at the
    prompt: the process ends at once, and the session holds that turn and resumes with it."""
    path = tmp_path / "s.ds2"
    t = Terminal(tmp_path, "--session", path)
    try:
        t.expect(PROMPT, timeout=STARTUP)
        t.send("What is 2 + 3?\r")
        assert "2 + 3 = 5." in t.expect(PROMPT)
        t.wait_for_keys()
        t.proc.send_signal(sig)
        assert t.wait() in (-sig, 128 + sig)
    finally:
        t.close()
    assert [m["role"] for m in messages_of(path)] == ["user", "assistant"]
    r = ds2("chat", "--temperature", "0", "--session", path, stdin="")
    assert r.returncode == 0 and "resumed 2 messages" in r.stderr and "already read" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_chat_killed_during_a_reply_saves_what_was_said(tmp_path, checkpoint_copy, sig):
    """SIGTERM or SIGHUP in the middle of a long reply: the reply so far joins the conversation,
    the session is saved, and the exit code says which signal ended it."""
    from test_chat_repl import endless
    path = tmp_path / "s.ds2"
    t = Terminal(tmp_path, "-m", endless(checkpoint_copy("ds2-tiny")), "-n", "1000", "--temperature", "1",
                 "--seed", "0", "--session", path)
    try:
        t.expect(PROMPT, timeout=STARTUP)
        t.send("Tell me a long story.\r")
        t.expect(r"story\.\r\n(\x1b\[\?2004l)?")
        t.expect(r"[A-Za-z]{2}")                              # the reply has started
        t.proc.send_signal(sig)
        assert t.wait() == 128 + sig
    finally:
        t.close()
    said = messages_of(path)
    assert [m["role"] for m in said] == ["user", "assistant"] and len(said[1]["content"]) >= 2


@pytest.mark.slow
def test_a_session_is_saved_after_every_turn(tmp_path):
    """Before the process ends: a second turn is read only once the first is on disk."""
    path = tmp_path / "s.ds2"
    p = subprocess.Popen([sys.executable, "-m", "ds2cli", "chat", "--temperature", "0", "--session", str(path)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        p.stdin.write("What is 2 + 3?\n")
        p.stdin.flush()
        assert p.stdout.readline() == "2 + 3 = 5.\n"
        deadline = time.monotonic() + 60
        while not (path.exists() and len(messages_of(path)) == 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [m["role"] for m in messages_of(path)] == ["user", "assistant"]
        p.kill()                                 # SIGKILL: no handler runs, the turn is on disk
        p.wait(30)
    finally:
        p.kill()
    assert len(messages_of(path)) == 2


@pytest.mark.slow
def test_a_second_chat_on_the_same_session_is_refused(tmp_path, session):
    path = session_at(tmp_path, session)
    with Lock(path, "--session"):                  # what a running chat holds
        line = one_error(ds2("chat", "--session", path, stdin="What is 1 + 1?\n"))
    assert "in use by another ds2 process" in line and path.read_bytes() == session
    r = ds2("chat", "--session", path, stdin="")    # free again once its holder is gone
    assert r.returncode == 0, r.stderr


def test_a_lock_dies_with_its_process(tmp_path):
    path = tmp_path / "s.ds2"
    code = f"from ds2cli.user_files import Lock; import os; Lock({str(path)!r}, 'x'); os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)   # exits without releasing
    with Lock(path, "x"):
        with pytest.raises(LockedError):
            Lock(path, "x")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["missing_dir", "fifo"])
def test_a_destination_that_cannot_be_written_is_refused_before_any_work(tmp_path, where):
    if where == "missing_dir":
        path = tmp_path / "no" / "such" / "s.ds2"
    else:
        path = tmp_path / "fifo"
        os.mkfifo(path)
    for args in (["chat", "--session", path], ["generate", "hi", "-n", "1", "--prompt-cache", path]):
        r = ds2(*args, stdin="What is 1 + 1?\n", timeout=60)      # a FIFO never blocks it
        line = one_error(r)
        assert ("does not exist" in line) if where == "missing_dir" else ("not a regular file" in line)
    assert where == "missing_dir" or stat.S_ISFIFO(os.stat(path).st_mode)


@pytest.mark.slow
def test_a_symlinked_session_updates_its_target_and_keeps_the_mode(tmp_path, session):
    target = session_at(tmp_path, session)
    os.chmod(target, 0o640)
    link = tmp_path / "link.ds2"
    link.symlink_to(target)
    stale = tmp_path / ".s.ds2.abc123.tmp"               # what a killed writer leaves
    stale.write_bytes(b"x" * 1000)
    r = ds2("chat", "--temperature", "0", "--session", link, stdin="What is 3 + 3?\n")
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert len(messages_of(target)) == 4 and not stale.exists()


def test_sigint_in_a_long_prefill_keeps_the_passes_read(model, monkeypatch):
    """Ctrl-C while a long prompt is read in passes: the cache keeps the passes finished (what a
    session or prompt cache then saves); an error keeps nothing."""
    monkeypatch.setattr(model, "prefill_chunk", 16)      # the memory chunk: passes of 16 tokens
    ids = list(range(3, 60))

    def interrupt_after(k, exc):
        def progress(done, total):
            if done >= k:
                raise exc
        return progress
    cache = model.new_cache(64)
    with pytest.raises(KeyboardInterrupt):
        model.forward_batch([Step(ids, cache)], progress=interrupt_after(32, KeyboardInterrupt()))
    assert cache.length == 32
    whole = model.new_cache(64)
    model.forward(ids[:32], whole)
    np.testing.assert_allclose(cache.latent[:, :32], whole.latent[:, :32], rtol=0,
                               atol=1e-5 * np.abs(whole.latent[:, :32]).max())
    cache = model.new_cache(64)
    with pytest.raises(ValueError):
        model.forward_batch([Step(ids, cache)], progress=interrupt_after(16, ValueError("x")))
    assert cache.length == 0


def test_values_that_are_not_finite_are_refused_and_never_saved(tmp_path, model):
    ids = model.tokenizer.encode("What is 2 + 2?")
    cache = model.new_cache(32)
    model.forward(ids, cache)
    path = tmp_path / "p.ds2"
    saved_cache.save(path, model, cache, ids)
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<I", raw[8:12])[0]
    h = json.loads(raw[12:12 + n])
    latent = np.frombuffer(raw, np.float32, count=cache.latent[:, :len(ids)].size, offset=12 + n).copy()
    latent[5] = np.nan
    raw[12 + n:12 + n + latent.nbytes] = latent.tobytes()
    k_pe = np.frombuffer(bytes(raw[12 + n + latent.nbytes:]), np.float32)
    h["crc32"] = saved_cache.checksum(h["tokens"], latent, k_pe)       # a "valid" checksum
    head = json.dumps(h).encode()
    path.write_bytes(bytes(raw[:8]) + struct.pack("<I", len(head)) + head + bytes(raw[12 + n:]))
    before = path.read_bytes()
    with pytest.raises(saved_cache.SavedCacheError, match="not finite"):
        saved_cache.load(path, model, 32)
    assert path.read_bytes() == before
    cache.latent[0, 0, 0] = np.inf
    with pytest.raises(saved_cache.SavedCacheError, match="not finite"):
        saved_cache.save(tmp_path / "q.ds2", model, cache, ids)
    assert not (tmp_path / "q.ds2").exists()


# ---- measured before read ----

@pytest.mark.slow
def test_a_prompt_file_over_the_limit_is_refused_by_its_size(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(10_500_000)                   # sparse: 10.5 MB that cost nothing to make
    line = one_error(ds2("generate", "--prompt-file", big, "-n", "1"))
    assert "prompt file" in line and "is 10.5 MB; the limit is" in line and "--max-prompt-bytes" in line
    line = one_error(ds2("generate", "--prompt-file", big, "-n", "1", "--max-prompt-bytes", "1000"))
    assert "the limit is 1 kB" in line


@pytest.mark.slow
def test_endless_inputs_are_read_only_to_the_limit(tmp_path):
    """/dev/zero, stdin, a transcript and a template: none is read past its limit."""
    one_error(ds2("generate", "--prompt-file", "/dev/zero", "-n", "1", timeout=60))
    r = ds2("generate", "-n", "1", "--max-prompt-bytes", "100", stdin="x" * 5000)
    assert "larger than the limit of 100 B" in one_error(r)
    transcript = tmp_path / "t.json"
    transcript.write_text(json.dumps([{"role": "user", "content": "y" * 5000}]))
    assert "conversation file" in one_error(ds2("chat", "--load", transcript, "--max-prompt-bytes", "1000",
                                               stdin=""))
    template = tmp_path / "t.jinja"
    with open(template, "wb") as f:
        f.truncate(2 << 20)
    assert "chat template" in one_error(ds2("generate", "--chat-template", template, "hi", "-n", "1"))
    tracemalloc.start()
    with pytest.raises(TooLargeError):
        read_bounded("/dev/zero", 1 << 20, "x")
    assert tracemalloc.get_traced_memory()[1] < 4 << 20
    tracemalloc.stop()


def test_a_prompt_far_longer_than_the_context_is_refused_before_tokenizing_all_of_it(model, monkeypatch):
    calls = []
    backend = model.tokenizer._backend

    class Counting:
        def encode(self, text, add_special_tokens=True):
            calls.append(len(text))
            return backend.encode(text, add_special_tokens=add_special_tokens)

        def encode_batch(self, texts, add_special_tokens=True):     # what Tokenizer.encode calls
            calls.extend(map(len, texts))
            return backend.encode_batch(texts, add_special_tokens=add_special_tokens)
    monkeypatch.setattr(model.tokenizer, "_backend", Counting())
    text = "the quick brown fox " * 50_000                           # a megabyte
    assert model.tokenizer.count_at_least(text, 1025) > 1024
    assert sum(calls) < 200_000                                       # a slice or two, not the megabyte


def test_a_huge_session_header_is_refused_unread(tmp_path, model):
    path = tmp_path / "s.ds2"
    with open(path, "wb") as f:
        f.write(b"DS2CACHE" + struct.pack("<I", 240_000_000))
        f.truncate(240_000_100)                  # sparse
    tracemalloc.start()
    with pytest.raises(saved_cache.SavedCacheError, match="more than a cache of this model"):
        saved_cache.load(path, model, 32, kind=saved_cache.SESSION)
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()


def test_a_fifo_without_a_writer_is_refused_after_the_wait(tmp_path):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with pytest.raises(Ds2Error) as e:
        read_bounded(fifo, 100, "prompt file", fifo_wait=0.05)
    assert str(e.value) == f"prompt file {fifo} is a FIFO that nothing was written to within 0.05 s"


def write_later(path, data: bytes, delay: float) -> threading.Thread:
    """A writer that comes to the FIFO `delay` seconds after the reader (which is there by then:
    the open waits for it, as a shell's `> fifo` does)."""
    def write():
        time.sleep(delay)
        with open(path, "wb") as f:
            f.write(data)
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def test_a_fifo_whose_writer_comes_later_is_read_whole(tmp_path):
    """It read as empty at once, leaving the writer blocked in its open."""
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    data = bytes(range(256)) * 1000                 # more than a pipe's buffer: read to the writer's end
    writer = write_later(fifo, data, 0.05)
    assert read_bounded(fifo, len(data), "prompt file", fifo_wait=30) == data
    writer.join(timeout=30)
    assert not writer.is_alive()
    empty = write_later(fifo, b"", 0.05)             # `: > fifo`: a writer that says nothing is an empty file
    assert read_bounded(fifo, 100, "prompt file", fifo_wait=30) == b""
    empty.join(timeout=30)


@pytest.mark.slow
def test_a_prompt_fifo_whose_writer_comes_a_second_later(tmp_path):
    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)
    generate = subprocess.Popen([sys.executable, "-m", "ds2cli", "generate", "--chat", "--temp", "0", "-f", str(fifo)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)                       # ds2 is up and waiting on the FIFO by now
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)     # ENXIO: no reader is there any more
        os.write(fd, b"What is 2 + 2?")
        os.close(fd)
        out, err = generate.communicate(timeout=120)
    finally:
        generate.kill()
    assert generate.returncode == 0 and out == "2 + 2 = 4.\n", err


def test_write_atomic_keeps_the_previous_file_on_failure(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"before")

    def fail(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        write_atomic(path, fail)
    assert path.read_bytes() == b"before" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_transcripts_are_bounded(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    assert read_messages(path, 1000)[0]["content"] == "hi"
    with pytest.raises(TooLargeError):
        read_messages(path, 10)


def test_a_read_only_directory_is_refused_before_any_work(tmp_path, monkeypatch):
    """The destination's directory is probed with a real file (what a read-only file system
    refuses even to root), not with os.access."""
    import errno
    import tempfile
    from ds2cli import user_files
    from ds2cli.errors import Ds2Error

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(Ds2Error, match="cannot write in .*Read-only file system"):
        user_files.check_destination(tmp_path / "s.ds2", "--session")
