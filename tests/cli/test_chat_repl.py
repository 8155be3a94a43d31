"""`ds2 chat` as a REPL: multi-line messages, CRLF, its commands, resuming, exit codes (through
stdin), and on a real pseudo-terminal: line editing, history, Ctrl-C and Ctrl-D, bracketed paste,
and prompts on stderr when stdout is a file."""

import fcntl
import json
import os
import pty
import re
import select
import subprocess
import sys
import termios
import time

import pytest
from click.testing import CliRunner

from ds2cli.generation.conversation import read_messages
from ds2cli.cli.main import main
from ds2cli.cli.chat_loop import clean_line, history_path


def chat(*args, input=None, env=None):
    return CliRunner(env=env).invoke(main, ["chat", "--temperature", "0", *map(str, args)], input=input)


# ---- through stdin ----

def test_triple_quotes_make_one_multi_line_message(tmp_path):
    saved = tmp_path / "c.json"
    r = chat(input=f'"""\nWhat is 2 + 3?\n\nPlease answer.\n"""\nWhat is 4 + 4?\n/save {saved}\n')
    assert r.exit_code == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2                       # two turns, two replies
    users = [m["content"] for m in read_messages(saved) if m["role"] == "user"]
    assert users == ["What is 2 + 3?\n\nPlease answer.", "What is 4 + 4?"]


def test_unclosed_block_at_end_of_input_is_still_sent(tmp_path):
    r = chat(input='"""\nWhat is 2 + 3?\n')
    assert r.exit_code == 0 and r.stdout == "2 + 3 = 5.\n"


@pytest.mark.slow
def test_crlf_input(tmp_path):
    """A file with Windows line ends piped in (a real process: CliRunner's stdin would translate them)."""
    saved = tmp_path / "c.json"
    p = subprocess.run([sys.executable, "-m", "ds2cli", "chat", "--temperature", "0"], capture_output=True,
                       input=f"What is 2 + 3?\r\n/save {saved}\r\n/exit\r\nWhat is 4 + 4?\r\n".encode(), timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout == b"2 + 3 = 5.\n"                          # /exit\r left before the last line
    assert "\r" not in saved.read_text() and read_messages(saved)[0]["content"] == "What is 2 + 3?"
    assert clean_line("a\r\n") == "a" and clean_line("a\rb\n") == "a\nb"


def test_system_without_argument_shows_it_and_save_without_argument_shows_usage():
    r = chat("--system", "Be brief.", input="/system\n/system Be kind.\n/system\n/save\n/clear\n/system\n")
    assert r.exit_code == 0 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "(system message: Be brief.)", "(system message set)", "(system message: Be kind.)",
        "usage: /save PATH  (the conversation as JSON; ds2 chat --load PATH resumes it)",
        "(new conversation)", "(system message: Be kind.)"]
    r = chat(input="/system\n")
    assert r.stderr == "(no system message)\n"


def test_load_says_what_it_resumed(tmp_path):
    saved = tmp_path / "c.json"
    saved.write_text(json.dumps([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "What is 4 + 4?"}, {"role": "assistant", "content": "4 + 4 = 8."}]))
    r = chat("--load", saved, input="What is 10 + 11?\n")
    assert r.exit_code == 0 and r.stdout == "10 + 11 = 21.\n"
    assert r.stderr.splitlines()[:3] == [f"(resumed 5 messages from {saved})", ">>> What is 4 + 4?", "4 + 4 = 8."]


def test_piped_chat_whose_every_turn_failed_exits_1():
    too_long = "What is 11 + 22? " * 10
    r = chat("--ctx", "16", input=f"{too_long}\n{too_long}\n")
    assert r.exit_code == 1 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith("error: ") and "does not fit" in line for line in lines)
    r = chat("--ctx", "40", input=f"{too_long}\nWhat is 2 + 3?\n")   # one turn worked
    assert r.exit_code == 0 and r.stdout == "2 + 3 = 5.\n"
    assert chat(input="/help\n").exit_code == 0                      # no turn at all


def test_history_lives_in_the_data_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert history_path() == tmp_path / "data" / "ds2" / "chat_history"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert history_path() == tmp_path / ".local" / "share" / "ds2" / "chat_history"


# ---- on a real terminal ----

UP, LEFT, CTRL_C, CTRL_D = "\x1b[A", "\x1b[D", "\x03", "\x04"
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"


# the system calls a process blocks in to wait for input: select, pselect6, poll, ppoll (as
# readline waits), and read (as input() reads stdin without readline, when stdout is no terminal)
WAIT_CALLS = {"x86_64": {23, 270, 7, 271}, "aarch64": {72, 73}, "riscv64": {72, 73}}
READ_CALL = {"x86_64": 0, "aarch64": 63, "riscv64": 63}


def waiting_for_input(pid: int) -> bool:
    """Whether the process's main thread sleeps waiting for input: in select() or poll(), or
    in read() of stdin."""
    machine = os.uname().machine
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] != "S":
                return False
        with open(f"/proc/{pid}/syscall") as f:
            call = f.read().split()
        if call[0].isdigit() and machine in WAIT_CALLS:
            return int(call[0]) in WAIT_CALLS[machine] or (int(call[0]) == READ_CALL[machine]
                                                           and int(call[1], 16) == 0)
        with open(f"/proc/{pid}/wchan") as f:
            return any(name in f.read() for name in ("poll", "select", "wait_woken", "n_tty_read"))
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return False


def controlling_terminal():
    """In the child: a new session whose controlling terminal is the pty on stdin, so that
    Ctrl-C there is a SIGINT, as in a real terminal."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """`ds2 chat` on a pseudo-terminal: stdin and stderr (and stdout unless `stdout` is given)."""

    def __init__(self, tmp_path, *args, stdout=None):
        self.master, slave = pty.openpty()
        env = {**os.environ, "TERM": "xterm", "XDG_DATA_HOME": str(tmp_path / "data"),
               "HOME": str(tmp_path), "INPUTRC": os.devnull}
        self.proc = subprocess.Popen([sys.executable, "-m", "ds2cli", "chat", "--temperature", "0", *args],
                                     stdin=slave, stdout=stdout or slave, stderr=slave, env=env,
                                     preexec_fn=controlling_terminal)
        os.close(slave)
        self.seen = ""

    def expect(self, pattern: str, timeout: float = 60) -> str:
        """Read until `pattern` (a regex) appears in what the terminal shows after the last match."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.seen):
            ready, _, _ = select.select([self.master], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                raise AssertionError(f"timed out waiting for {pattern!r}; the terminal shows {self.seen!r}")
            try:
                self.seen += os.read(self.master, 4096).decode("utf-8", "replace")
            except OSError:                                  # the child closed the terminal
                raise AssertionError(f"{pattern!r} never came; the terminal shows {self.seen!r}") from None
        match = re.search(pattern, self.seen)
        before, self.seen = self.seen[:match.end()], self.seen[match.end():]
        return before

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def wait_for_keys(self, timeout: float = 60) -> None:
        """Until the child is blocked waiting for a key. CPython's readline sees a SIGINT only
        when it interrupts that wait (its select()): one that lands while readline still handles
        the last key (and writes its echo), or before it waits at a fresh prompt, is missed
        until the next key."""
        deadline = time.monotonic() + timeout
        while not waiting_for_input(self.proc.pid):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"ds2 never waited for a key; the terminal shows {self.seen!r}")
            time.sleep(0.01)

    def wait(self, timeout: float = 60) -> int:
        """The exit code, reading what the child still writes so that it never blocks."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            if select.select([self.master], [], [], 0.1)[0]:
                try:
                    self.seen += os.read(self.master, 4096).decode("utf-8", "replace")
                except OSError:
                    break
        return self.proc.wait(timeout=max(deadline - time.monotonic(), 1))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        os.close(self.master)


@pytest.fixture
def terminal(tmp_path):
    opened = []

    def open_terminal(*args, stdout=None):
        opened.append(Terminal(tmp_path, *args, stdout=stdout))
        return opened[-1]
    yield open_terminal
    for t in opened:
        t.close()


STARTUP = 120             # a loaded machine can take long to start Python and load ds2-tiny
PROMPT = r">>> $"      # the prompt, waiting (readline may write escapes before it)


@pytest.mark.slow
def test_line_editing_history_ctrl_c_and_ctrl_d(terminal, tmp_path):
    t = terminal()
    t.expect(PROMPT, timeout=STARTUP)
    t.send("What is 2 3?" + LEFT * 2 + "+ " + "\r")            # edit in the middle of the line
    assert "2 + 3 = 5." in t.expect(PROMPT)
    t.send("typed, then regretted")
    t.expect("regretted")
    t.wait_for_keys()                                         # the echo comes before the wait
    t.send(CTRL_C)                                            # clears the line, does not leave
    t.expect(PROMPT)
    t.send(UP + "\r")                                         # the previous message again
    assert "2 + 3 = 5." in t.expect(PROMPT)
    t.wait_for_keys()                                         # as before a Ctrl-C at a fresh prompt
    t.send(CTRL_D)
    assert "unsaved" in t.expect(r"unsaved turns.*\n")              # said before leaving: still here
    t.expect(PROMPT)
    t.wait_for_keys()
    t.send(CTRL_D)                                            # the second one leaves
    assert t.wait() == 0
    history = (tmp_path / "data" / "ds2" / "chat_history").read_text()
    assert "What is 2 + 3?" in history and "regretted" not in history

    t = terminal()                                            # the history outlives the process
    t.expect(PROMPT)
    t.send(UP + "\r")
    assert "2 + 3 = 5." in t.expect(PROMPT)
    t.send("/exit!\r")
    assert t.wait() == 0


def endless(model_dir):
    """ds2-tiny that never stops by itself: no eos in config, generation_config or tokenizer."""
    for name, key, value in (("config.json", "eos_token_id", ...), ("generation_config.json", "eos_token_id", ...),
                             ("tokenizer_config.json", "eos_token", None)):
        d = json.loads((model_dir / name).read_text(encoding="utf-8"))
        d.pop(key) if value is ... else d.update({key: value})
        (model_dir / name).write_text(json.dumps(d), encoding="utf-8")
    return model_dir


@pytest.mark.slow
def test_ctrl_c_during_a_reply_then_at_the_prompt_keeps_the_conversation(terminal, tmp_path, checkpoint_copy):
    saved = tmp_path / "c.json"
    t = terminal("-m", endless(checkpoint_copy("ds2-tiny")), "-n", "1000", "--temperature", "1", "--seed", "0")
    t.expect(PROMPT, timeout=STARTUP)
    t.send("Tell me a long story.\r")
    t.expect(r"story\.\r\n(\x1b\[\?2004l)?")                  # readline handed the line over
    t.expect(r"[A-Za-z]{2}")                                  # and the reply has started
    t.send(CTRL_C)
    t.expect(r"reply interrupted")
    t.expect(PROMPT)
    t.wait_for_keys()
    t.send(CTRL_C)                                            # a second Ctrl-C: still here
    t.expect(PROMPT)
    t.send(f"/save {saved}\r")
    t.expect(r"saved 2 messages")
    t.expect(PROMPT)
    t.wait_for_keys()                                         # as before a Ctrl-C at a fresh prompt
    t.send(CTRL_D)
    assert t.wait() == 0
    assert "unsaved" not in t.seen
    assert [m["role"] for m in read_messages(saved)] == ["user", "assistant"]


@pytest.mark.slow
def test_bracketed_paste_is_one_message(terminal, tmp_path):
    saved = tmp_path / "c.json"
    t = terminal()
    t.expect(PROMPT, timeout=STARTUP)
    t.send(PASTE_START + "What is 2 + 3?\rWhat is 4 + 4?" + PASTE_END + "\r")
    t.expect(PROMPT)
    t.send(f"/save {saved}\r")
    t.expect(r"saved 2 messages")
    t.expect(PROMPT)
    t.send("/exit\r")
    assert t.wait() == 0
    assert read_messages(saved)[0] == {"role": "user", "content": "What is 2 + 3?\nWhat is 4 + 4?"}


@pytest.mark.slow
def test_prompts_go_to_stderr_when_stdout_is_a_file(terminal, tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        t = terminal(stdout=f)
        t.expect(r">>> ", timeout=STARTUP)
        t.send("What is 2 + 3?\r")
        t.expect(r">>> ")
        t.send("/help\r")
        t.expect(r"/exit, /quit")
        t.expect(r">>> ")
        t.send("/exit!\r")                                   # leaves at once, unsaved turns and all
        assert t.wait() == 0
    assert out.read_text() == "2 + 3 = 5.\n"                  # replies only


@pytest.mark.slow
def test_a_multi_line_message_is_one_history_entry(terminal, tmp_path):
    """The lines between two \"\"\" fences go into the history as the one message they sent (no
    fence lines), survive the history file, and Up sends the whole message again."""
    t = terminal()
    t.expect(PROMPT, timeout=STARTUP)
    t.send('"""\r')
    t.expect(r"\.\.\. $")
    t.send("What is\r")
    t.expect(r"\.\.\. $")
    t.send('17 + 25?\r')
    t.expect(r"\.\.\. $")
    t.send('"""\r')
    first = t.expect(PROMPT)
    t.send("/exit!\r")
    assert t.wait() == 0
    history = (tmp_path / "data" / "ds2" / "chat_history").read_text().splitlines()
    assert history[-2:] == ["What is\\n17 + 25?", "/exit!"], history

    t = terminal()
    t.expect(PROMPT, timeout=STARTUP)
    t.send(UP + UP + "\r")                                    # past /exit, the message itself
    again = t.expect(PROMPT)
    reply = [line for line in first.splitlines() if "=" in line or "42" in line]
    assert reply and reply[-1].strip() in again, (first, again)
    t.send("/exit!\r")
    assert t.wait() == 0
