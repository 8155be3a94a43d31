"""The terminal side of `ds2 chat`: reading messages, with a line editor where there is one.

On a terminal, the standard library's `readline` gives line editing, a history that persists in
the user's data directory, and bracketed paste (a pasted block arrives as one message). A line
holding only `\"\"\"` opens a multi-line message and the next such line closes it, on a terminal
and from a pipe alike. Ctrl-C at the prompt clears the line, as shells do; Ctrl-D (end of input)
is the only way out besides /exit. Prompts go to stderr when stdout is not a terminal, so
`ds2 chat > replies.txt` keeps the file to replies.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
        """One line, without its end; EOFError at end of input, KeyboardInterrupt on Ctrl-C."""
        if self.readline is not None:
            return clean_line(input(prompt))
        if self.interactive:
            sys.stderr.write(prompt)
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return clean_line(line)

    def close(self) -> None:
        """Save the history; a data directory that cannot be written is not worth an error."""
        if self.readline is None or self.history is None:
            return
        try:
            self.history.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(str(self.history))
        except OSError:
            pass


def _readline(history: Path | None):
    try:
        import readline
    except ImportError:          # Python built without it: plain input() still works
        return None
    if "libedit" not in (readline.__doc__ or ""):
        # GNU readline: a paste arrives as one string (newlines kept) instead of line by line
        readline.parse_and_bind("set enable-bracketed-paste on")
    readline.set_history_length(HISTORY_LENGTH)
    if history is not None:
        try:
            readline.read_history_file(str(history))
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
                line = self.editor.read(PROMPT)
                if line.strip() == MULTILINE_FENCE:
                    line = self._block()
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
