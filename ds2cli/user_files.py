"""A user's files, read and written so that nothing is lost: inputs measured before they are read,
outputs checked before any work and replaced atomically, a file one process at a time.

  read_bounded(path, limit, what)   the bytes of a file, stdin ("-") or a special file, refused
                                    with its size when over `limit`, never read past it; a FIFO's
                                    writer waited for FIFO_WAIT_S at most
  check_destination(path, what)     before any work: the directory exists and is writable, the
                                    file (a symlink's target) is a regular file or absent
  write_atomic(path, write)         a temporary file beside the target (a symlink's target), its
                                    mode kept, fsynced, renamed over it; stale temporaries of a
                                    killed writer removed
  open_regular(path, follow)        a regular file opened for reading, never blocking on a FIFO,
                                    never through a symlink unless `follow`
  Lock(path)                        one process at a time: an flock that dies with its process
Below every package, beside json_files: the CLI, the generation layer and the server use it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from ds2cli.errors import Ds2Error
from ds2cli.wording import human_bytes

READ_BLOCK = 1 << 20
FIFO_WAIT_S = 10.0      # a FIFO read as a file: how long its writer may take to come (docs/cli.md)


class TooLargeError(Ds2Error):
    """An input larger than the limit it is read with."""


def read_bounded(path: Path | str, limit: int, what: str, option: str = "",
                 fifo_wait: float = FIFO_WAIT_S) -> bytes:
    """The bytes of `path` ("-": stdin), at most `limit`: a regular file is refused by its size
    before a byte is read, anything else (a pipe, a device, a FIFO) is read until it ends or
    passes the limit. A FIFO waits `fifo_wait` seconds for its writer (its first bytes, or its
    end), then is refused, so that neither side waits forever; a directory is refused."""
    hint = f" ({option})" if option else ""
    if str(path) == "-":
        return _read_stream(sys.stdin.buffer, limit, what, hint)
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)       # a FIFO opens without a writer
    except IsADirectoryError:
        raise Ds2Error(f"{what} {path} is a directory") from None
    except OSError as e:
        raise Ds2Error(f"cannot read {what} {path}: {e.strerror}") from None
    if stat.S_ISDIR(os.fstat(fd).st_mode):      # Linux opens a directory read-only; fdopen refuses it
        os.close(fd)
        raise Ds2Error(f"{what} {path} is a directory")
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            if st.st_size > limit:
                raise TooLargeError(f"{what} {path} is {human_bytes(st.st_size)}; the limit is "
                                    f"{human_bytes(limit)}{hint}")
        elif stat.S_ISFIFO(st.st_mode):
            if not _writer_came(fd, fifo_wait):
                raise Ds2Error(f"{what} {path} is a FIFO that nothing was written to within {fifo_wait:g} s")
            os.set_blocking(fd, True)        # the writer came: read as a pipe, to its end
        try:
            return _read_stream(f, limit, f"{what} {path}", hint)
        except OSError as e:
            raise Ds2Error(f"cannot read {what} {path}: {e.strerror}") from None


def _writer_came(fd: int, wait: float) -> bool:
    """Whether a writer came to a FIFO opened for reading (without blocking) within `wait`
    seconds: Linux reports nothing until one writes (POLLIN) or comes and goes (POLLHUP), and a
    read before that would find no writer and end at once, empty. A writer that opens the FIFO
    and writes nothing for `wait` seconds is not told apart from none."""
    import select
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(max(0, int(wait * 1000))))


def _read_stream(f: BinaryIO, limit: int, what: str, hint: str) -> bytes:
    chunks, n = [], 0
    while True:
        chunk = f.read(min(READ_BLOCK, limit + 1 - n))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        n += len(chunk)
        if n > limit:
            raise TooLargeError(f"{what} is larger than the limit of {human_bytes(limit)}{hint}")


class NotRegularError(Ds2Error):
    """Something other than a regular file (a FIFO, a device, a socket) where one is read."""


def file_kind(mode: int) -> str:
    """What st_mode says a path is, in words."""
    for test, kind in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return kind
    return "not a regular file"


def open_regular(path: Path, follow: bool = True) -> BinaryIO:
    """`path` opened for reading if it is a regular file. The open never waits for a FIFO's
    writer (O_NONBLOCK) and, unless `follow`, fails on a symlink (O_NOFOLLOW: ELOOP); a
    directory raises IsADirectoryError, a FIFO or a device NotRegularError, checked on the open
    file (fstat), so nothing swapped in after a look at the name is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "Is a directory", str(path))
        if not stat.S_ISREG(mode):
            raise NotRegularError(f"{path} is {file_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def target_of(path: Path) -> Path:
    """The file a path names, its symlinks followed (a dangling one: where it points)."""
    return Path(os.path.realpath(path))


def check_destination(path: Path, what: str) -> None:
    """Refuse, before any work, a destination that could not be written at the end: a missing or
    read-only directory, or something other than a regular file in the way."""
    target = target_of(path)
    if target.exists() and not target.is_file():
        kind = "a directory" if target.is_dir() else "not a regular file (a FIFO or a device)"
        raise Ds2Error(f"{what} {path} is {kind}")
    parent = target.parent
    if not parent.is_dir():
        raise Ds2Error(f"{what} {path}: the directory {parent} does not exist")
    # a file made and removed at once: the only test a read-only file system (or a full one's
    # inode table) cannot pass, and root's os.access would
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".ds2-probe.")     # not a temporary write_atomic cleans
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise Ds2Error(f"{what} {path}: cannot write in {parent}: {e.strerror}") from None


def temporaries(target: Path) -> list[Path]:
    """Temporary files write_atomic leaves beside `target` when its writer is killed."""
    with contextlib.suppress(OSError):
        return [p for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.") and p.name.endswith(".tmp")]
    return []


def write_atomic(path: Path, write: Callable[[BinaryIO], None], clean: bool = True) -> None:
    """`write(f)` into a temporary file beside the target (a symlink's target), then a rename
    over it: an interrupt or a full disk leaves the previous file whole. The file keeps its mode
    (a new one gets the umask's); with `clean`, temporaries a killed writer left are removed
    (the caller holds the file's Lock, so no other writer is alive)."""
    target = target_of(path)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    if clean:
        for stale in temporaries(target):
            stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class LockedError(Ds2Error):
    """Another process holds the file."""


class Lock:
    """One process at a time on a file: an exclusive flock on `.NAME.lock` beside it (the file
    itself is replaced by every save, so it cannot carry the lock). The kernel drops the lock
    when its process ends, however it ends; `release` removes the lock file."""

    def __init__(self, path: Path, what: str):
        self.target = target_of(path)
        self.path = self.target.parent / f".{self.target.name}.lock"
        self.fd: int | None = None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise LockedError(f"{what} {path} is in use by another ds2 process; "
                                  f"one at a time keeps both from overwriting each other") from None
            # the holder before us may have removed the file after we opened it: lock the one
            # that is there now
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return
            os.close(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
