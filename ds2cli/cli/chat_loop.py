"""The terminal side of `ds2 chat`: the chat loop (messages in, replies out, /commands), and
reading messages, with a line editor where there is one.

On a terminal, the standard library's `readline` gives line editing, a history that persists in
the user's data directory, and bracketed paste (a pasted block arrives as one message). A line
holding only `\"\"\"` opens a multi-line message and the next such line closes it, on a terminal
and from a pipe alike. Ctrl-C at the prompt clears the line, as shells do; Ctrl-D (end of input)
is the only way out besides /exit. Prompts go to stderr when stdout is not a terminal, so
`ds2 chat > replies.txt` keeps the file to replies.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from pathlib import Path

from ds2cli.cli import console
from ds2cli.generation.conversation import ChatSession
from ds2cli.cli.console import write_out
from ds2cli.wording import plural
from ds2cli.errors import Ds2Error
from ds2cli.generation.generate import Chunk
from ds2cli.cli.options import argument_text

PROMPT, CONTINUATION = ">>> ", "... "
MULTILINE_FENCE = '"""'
HISTORY_LENGTH = 1000


def history_path() -> Path:
    """$XDG_DATA_HOME/ds2/chat_history, else ~/.local/share/ds2/chat_history."""
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data_home) / "ds2" / "chat_history"


def clean_line(line: str) -> str:
    """No carriage return reaches a message: CRLF (Windows files, some terminals' paste) and a
    lone CR become LF, and the line's own end is dropped."""
    return line.replace("\r\n", "\n").replace("\r", "\n").removesuffix("\n")


class LineEditor:
    """Reads lines from stdin: through readline when stdin and stdout are both terminals, else
    plainly, prompting on stderr when only stdin is a terminal, and not at all from a pipe."""

    def __init__(self, interactive: bool, history: Path | None = None):
        self.interactive = interactive
        self.readline = None
        self.history = history
        if interactive and sys.stdout.isatty():
            self.readline = _readline(history)

    def read(self, prompt: str) -> str:
        """One line, without its end; EOFError at end of input, KeyboardInterrupt on Ctrl-C.
        SIGTERM and SIGHUP end the process at once meanwhile: everything said is on disk by then
        (a --session is saved after every turn), and readline's wait would hold a Python
        handler's exception until the next key."""
        with default_signals():
            return self._read(prompt)

    def _read(self, prompt: str) -> str:
        if self.readline is not None:
            return clean_line(input(prompt))
        if self.interactive:
            sys.stderr.write(prompt)
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return clean_line(line)

    def history_length(self) -> int:
        return self.readline.get_current_history_length() if self.readline is not None else 0

    def collapse_history(self, since: int, entry: str) -> None:
        """The lines readline kept since `since` (a multi-line message and its fences) become
        one entry, the message itself: Up brings it back whole."""
        if self.readline is None:
            return
        while self.readline.get_current_history_length() > since:
            self.readline.remove_history_item(self.readline.get_current_history_length() - 1)
        self.readline.add_history(entry)

    def close(self) -> None:
        """Save the history; a data directory that cannot be written is not worth an error.
        Written by ds2 rather than readline, one entry a line with its newlines escaped, so a
        multi-line message comes back as one entry (readline would split it into lines)."""
        if self.readline is None or self.history is None:
            return
        n = self.readline.get_current_history_length()
        entries = [self.readline.get_history_item(i) for i in range(max(1, n - HISTORY_LENGTH + 1), n + 1)]
        try:
            self.history.parent.mkdir(parents=True, exist_ok=True)
            self.history.write_text("".join(escape_entry(e) + "\n" for e in entries if e is not None),
                                    encoding="utf-8", errors="surrogateescape")
        except OSError:
            pass


ENDING = (signal.SIGTERM, signal.SIGHUP)   # the signals that end a chat: a kill, a closed terminal


@contextlib.contextmanager
def ending_signals(handler):
    """SIGTERM and SIGHUP handled by `handler` for the block, as they were after it."""
    before = {sig: signal.signal(sig, handler) for sig in ENDING}
    try:
        yield
    finally:
        for sig, previous in before.items():
            signal.signal(sig, previous)


def default_signals():
    """SIGTERM and SIGHUP as the system handles them (the process ends) for the block; the
    handlers the chat set (which save the session first) again after it."""
    return ending_signals(signal.SIG_DFL)


def escape_entry(entry: str) -> str:
    return entry.replace("\\", "\\\\").replace("\n", "\\n")


def unescape_entry(line: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1] if m[1] == "\\" else m[0], line)


def _readline(history: Path | None):
    try:
        import readline
    except ImportError:          # Python built without it: plain input() still works
        return None
    if "libedit" not in (readline.__doc__ or ""):
        # GNU readline: a paste arrives as one string (newlines kept) instead of line by line
        readline.parse_and_bind("set enable-bracketed-paste on")
    readline.set_history_length(HISTORY_LENGTH)
    readline.clear_history()
    if history is not None:
        try:
            for line in history.read_text(encoding="utf-8", errors="surrogateescape").splitlines():
                readline.add_history(unescape_entry(line))
        except OSError:
            pass
    return readline


class MessageReader:
    """Messages from a LineEditor: one line, or the lines between two `\"\"\"` lines joined by
    newlines. Ctrl-C drops what was typed (the line, or the whole unfinished block)."""

    def __init__(self, editor: LineEditor, on_interrupt=lambda: None):
        self.editor = editor
        self.on_interrupt = on_interrupt

    def __iter__(self):
        while True:
            try:
                mark = self.editor.history_length()
                line = self.editor.read(PROMPT)
                if line.strip() == MULTILINE_FENCE:
                    line = self._block()
                    self.editor.collapse_history(mark, line)
            except KeyboardInterrupt:
                self.on_interrupt()
                continue
            except EOFError:
                return
            yield line

    def _block(self) -> str:
        lines = []
        while True:
            try:
                line = self.editor.read(CONTINUATION)
            except EOFError:     # the input ended inside the block: send what there is
                return "\n".join(lines)
            if line.strip() == MULTILINE_FENCE:
                return "\n".join(lines)
            lines.append(line)


CHAT_HELP = """commands:
  /clear         start a new conversation (the system message stays)
  /system [TEXT] set the system message (without TEXT: show it)
  /save PATH     save the conversation as JSON (ds2 chat --load resumes it)
  /help          this help
  /exit, /quit   leave (Ctrl-D too; Ctrl-C clears the line or stops a reply);
                 unsaved turns are pointed out first: /exit! leaves at once
input:
  a line holding only \""" starts a multi-line message; the next one sends it
  a bracketed paste (most terminals) arrives as one message, newlines kept
  on a terminal: line editing, and Up/Down for the history kept in
  $XDG_DATA_HOME/ds2/chat_history (default ~/.local/share/ds2/chat_history)"""

class Repl:
    """The chat loop: messages in, replies out, /commands, and the bookkeeping for leaving."""

    def __init__(self, session: ChatSession, sampler, max_new: int, stop: list[str], stats: bool, draft: int = 0,
                 hide_reasoning: bool = False):
        self.session, self.sampler, self.max_new, self.stop, self.stats = session, sampler, max_new, stop, stats
        self.draft = draft
        self.hide_reasoning = hide_reasoning    # a reply's reasoning is kept in the conversation, not shown
        self.interactive = sys.stdin.isatty()
        self.unsaved = False          # the conversation has turns no /save or --load holds
        self.session_file = None      # --session: the conversation is saved there after every turn
        self.turns = self.failed = 0
        self.warned = False           # the unsaved turns were pointed out once: the next leave leaves
        self.leave_now = False        # /exit!

    def resume(self, messages: list[dict], path: Path) -> None:
        self.session.load(messages)
        self.show_resumed(messages, path)

    def show_resumed(self, messages: list[dict], path: Path, cached: int | None = None) -> None:
        """Say what was resumed (and, from a session file, how many tokens need no reading), then
        the last exchange."""
        read = "" if cached is None else f", {plural(cached, 'token')} already read"
        console.info(f"(resumed {plural(len(messages), 'message')} from {path}{read})")
        last_user = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), None)
        if last_user is not None:
            for m in messages[last_user:]:
                console.info((PROMPT if m["role"] == "user" else "") + m["content"])

    def run(self) -> bool:
        """Read and answer until /exit or end of input; True when every turn (of a piped chat) failed."""
        if hasattr(sys.stdin, "reconfigure"):
            # messages are UTF-8 as prompts are (whatever PYTHONIOENCODING or the locale say);
            # bytes that are not are reported per message, not raised
            sys.stdin.reconfigure(encoding="utf-8", errors="surrogateescape")
        editor = LineEditor(self.interactive, history_path())
        if self.interactive:
            console.info("ds2 chat: /help for commands, \"\"\" for a multi-line message, Ctrl-D to leave")
        try:
            while True:
                for text in MessageReader(editor, on_interrupt=lambda: console.info("")):
                    try:
                        if not self.handle(text):
                            break
                    except KeyboardInterrupt:   # Ctrl-C between a reply and the prompt: keep going
                        console.info("")
                if self.may_leave():
                    break
        finally:
            editor.close()
        return not self.interactive and self.turns > 0 and self.failed == self.turns

    def may_leave(self) -> bool:
        """On a terminal, turns that nothing holds are pointed out before leaving, as editors do:
        the next /exit or Ctrl-D (or /exit! at once) leaves without them."""
        if self.leave_now or not self.interactive or not self.unsaved or self.session_file is not None \
                or self.warned:
            return True
        self.warned = True
        console.info("(this conversation has unsaved turns: /save PATH keeps them; /exit again, "
                     "/exit! or Ctrl-D leaves without saving)")
        return False

    def autosave(self) -> None:
        """--session: the conversation and its cache saved after every turn, so that nothing
        said is lost however the process ends."""
        if self.session_file is None:
            return
        try:
            self.session.save_session(self.session_file)
        except Ds2Error as e:
            console.error(f"{e} (the conversation goes on; the next turn saves it again)")

    def handle(self, text: str) -> bool:
        """One message or /command; False to leave."""
        if text.startswith("/"):
            return self.command(text)
        if not text.strip():
            return True
        self.turns += 1
        try:
            text = argument_text(text, "message", hint="it was not sent")
            last = chat_turn(self.session, text, self.sampler, self.max_new, self.stop, self.draft,
                             self.hide_reasoning)
        except Ds2Error as e:
            console.error(str(e))
            self.failed += 1
            return True
        finally:
            self.autosave()             # an interrupted reply too: the conversation kept it
        self.unsaved, self.warned = True, False
        if last is not None and self.stats:
            console.info(console.stats_line(None, last, self.session.cache, self.session.model.executor.stats()))
        return True

    def command(self, line: str) -> bool:
        """Handle a /command; return False to leave the REPL."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit") and not arg:
            return False
        if name in ("/exit!", "/quit!") and not arg:
            self.leave_now = True
            return False
        if name == "/clear" and not arg:
            self.session.clear()
            self.unsaved = False
            self.autosave()
            console.info("(new conversation)")
        elif name == "/system" and arg:
            self.session.set_system(arg)
            self.autosave()
            console.info("(system message set)")
        elif name == "/system":
            current = next((m["content"] for m in self.session.messages if m["role"] == "system"), None)
            console.info(f"(system message: {current})" if current is not None else "(no system message)")
        elif name == "/save" and arg:
            try:
                self.session.save(Path(arg).expanduser())
                self.unsaved = False
                console.info(f"(saved {plural(len(self.session.messages), 'message')} to {arg})")
            except Ds2Error as e:
                console.error(str(e))
        elif name == "/save":
            console.info("usage: /save PATH  (the conversation as JSON; ds2 chat --load PATH resumes it)")
        elif name == "/help" and not arg:
            console.info(CHAT_HELP)
        else:
            console.error(f"unknown or incomplete command {line!r}; /help lists the commands")
        return True


def chat_turn(session: ChatSession, text: str, sampler, max_new: int, stop, draft: int = 0,
              hide_reasoning: bool = False) -> Chunk | None:
    """One turn: the reply's answer on stdout, its reasoning dimmed on stderr (console.ReplyWriter)."""
    reading = console.PrefillProgress(0)     # a long message (a pasted document) shows its reading
    chunks = session.reply(text, sampler, max_new, stop, draft=draft, progress=reading)
    last, writer = None, None
    try:
        for chunk in chunks:
            reading.close()
            if writer is None:      # the prompt is rendered by now: whether it opened <think> is known
                writer = console.ReplyWriter(session.split_reasoning, session.opened, hide_reasoning)
            writer.write(chunk.text)
            last = chunk
        if writer is not None:
            writer.close()
    except KeyboardInterrupt:
        chunks.close()
        reading.close()
        if writer is not None:
            writer.close()
        write_out("\n")
        if last is None and reading.done:
            console.info(reading.summary())
        console.info("(reply interrupted; the conversation is kept)")
        return None
    except BaseException:        # SIGTERM, SIGHUP: the reply so far joins the conversation first
        chunks.close()
        reading.close()
        raise
    write_out("\n")
    if session.cut:
        console.warn(session.cut)
    return last
