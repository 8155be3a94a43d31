"""Directories built beside their target and renamed into place only when complete, so an
interrupted `ds2 quantize` or bench synthesis never leaves anything that looks finished."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Iterator

from ds2cli.errors import Ds2Error


def check_free_disk(directory: Path, needed: int, what: str, error: type[Exception], hint: str = "") -> None:
    """Raise `error`, naming both figures, if `directory`'s file system has fewer than `needed`
    bytes free: checked before anything is written (bench's synthesis, ds2 quantize)."""
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise error(f"not enough disk for {what} in {directory}: it needs {needed / 1e9:.1f} GB and "
                    f"{free / 1e9:.1f} GB is free" + (f" ({hint})" if hint else ""))


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(target: Path) -> None:
    """A build killed outright leaves `.NAME.partial-PID` behind: remove those whose process is gone."""
    for path in target.parent.glob(f".{target.name}.partial-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def existing_ancestor(path: Path) -> Path:
    """The nearest directory at or above `path` that exists (where its file system is asked)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@contextlib.contextmanager
def building(target: Path, replace: bool) -> Iterator[Path]:
    """Yield an empty hidden sibling of `target` to build in. On success it becomes `target`:
    an existing `target` is replaced (moved aside first, removed last) when `replace`, else kept
    and the new build discarded (another process finished the same work first). On any error
    or interrupt the partial directory is removed, and so are the parent directories made for
    it: nothing is left behind. A Ctrl-C during the final renames is too late to stop them, and
    is not raised: the build is complete."""
    made = [p for p in [target.parent, *target.parent.parents] if not p.exists()]
    partial = target.parent / f".{target.name}.partial-{os.getpid()}"
    try:
        with terminate_as_exit():
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                remove_stale_partials(target)
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir()
            except OSError as e:     # a name too long for the file system, a read-only disk ...
                raise Ds2Error(f"cannot create {target}: {e.strerror or e}") from None
            yield partial
            with interrupts_deferred():
                commit(partial, target, replace)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        for directory in made:                   # deepest first; only if still empty
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise


def commit(partial: Path, target: Path, replace: bool) -> None:
    if target.exists() and not replace:
        shutil.rmtree(partial)
        return
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        target.rename(old)
    partial.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def terminate_as_exit():
    """SIGTERM (a `kill`, a service manager stopping the job) unwinds like Ctrl-C for the block,
    so the partial build is removed, and the process then exits 143 (128 + SIGTERM) as a killed
    one would. On the main thread; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise SystemExit(128 + signal.SIGTERM)
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def interrupts_deferred():
    """SIGINT is noted, not raised, for the block (on the main thread; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
