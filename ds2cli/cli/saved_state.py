"""What `ds2 chat --session` and `ds2 generate --prompt-cache` do so that nothing is lost:
the files checked before anything loads, a session saved however the chat ends (SIGTERM and
SIGHUP leave through its `finally`), a prompt cache written while this process holds it."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

from ds2cli.cli import console
from ds2cli.cli.chat_loop import ENDING, ending_signals
from ds2cli.errors import Ds2Error
from ds2cli.generation import saved_cache
from ds2cli.generation.conversation import ChatSession
from ds2cli.model.transformer import Model
from ds2cli.user_files import Lock, check_destination
from ds2cli.wording import plural


def check_prompt_cache(path: Path | None, config) -> None:
    """--prompt-cache, before anything loads: a place a file can be written, and, if something is
    there, a prompt cache (a chat session or any other file is refused, never written over)."""
    if path is None:
        return
    if path.is_dir():
        raise Ds2Error(f"--prompt-cache {path} is a directory, not a prompt cache file")
    check_destination(path, "--prompt-cache")
    saved_cache.check_kind(path, config, saved_cache.PROMPT_CACHE)


def hold_session(path: Path, config) -> Lock:
    """All a session's end depends on, checked before the model loads: its place, its kind; then
    this process's hold on it (released by the caller, or by the kernel however the process ends)."""
    if path.is_dir():
        raise Ds2Error(f"--session {path} is a directory, not a session file")
    check_destination(path, "--session")
    saved_cache.check_kind(path, config, saved_cache.SESSION)
    return Lock(path, "--session")


def save_prompt_cache(path: Path, model: Model, cache, ids: list[int]) -> None:
    """The prompt's cache, written while this process holds the file (another generate waits its
    turn by failing, never by interleaving two writes)."""
    with Lock(path, "--prompt-cache"):
        saved_cache.save(path, model, cache, ids, kind=saved_cache.PROMPT_CACHE, clean=True)


class Left(BaseException):
    """SIGTERM or SIGHUP (a closed terminal) arrived: leave as from /exit, saving what there is."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def leaving_on_signals():
    """SIGTERM and SIGHUP leave the block through its finally clauses (a chat's session is saved),
    once: a second one while saving is ignored. Yields a list that gets the signal's number."""
    left: list[int] = []

    def leave(signum, _frame):
        for sig in ENDING:
            signal.signal(sig, signal.SIG_IGN)
        left.append(signum)
        raise Left(signum)
    with ending_signals(leave):
        try:
            yield left
        except Left:
            pass


def save_on_leaving(session: ChatSession, path: Path) -> bool:
    """The session saved once more as the chat ends, however it ends; False when it could not be
    (a full disk, `ulimit -f`), said in one error line naming the file, for the chat to exit 1.
    Saying so may fail when the terminal is gone (SIGHUP), which must not undo the save."""
    try:
        session.save_session(path)
    except Ds2Error as e:
        with contextlib.suppress(OSError):
            console.error(str(e))
        return False
    with contextlib.suppress(OSError):
        console.info(f"(session saved to {path}: {plural(len(session.messages), 'message')}, "
                     f"{plural(len(session.cached_ids), 'token')} cached)")
    return True
