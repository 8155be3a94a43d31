"""`ds2 serve --prompt-cache-dir DIR`: the prompt cache's second tier, on disk.

A conversation the in-memory pool lets go of (evicted as least recently used, and at a stop
every one it holds) is written to DIR as a saved cache (generation/saved_cache.py: its tokens,
its latents, the model's fingerprint), and comes back when a later request, or a later server,
begins with its tokens. The request's own thread reads it (`read`), never the scheduler's.

What is this model's is told by the name: `FP-DIGEST.ds2cache`, FP the first 16 hex digits of
the model's fingerprint (weights/fingerprint.py), DIGEST the tokens'. Files of another model,
or of no model, are never opened, written over or counted; the header's fingerprint is checked
too. Only regular files are read: a symlink, a FIFO or a device under this model's name (or any
`*.ds2cache`) is skipped with a log line, and opens never block or follow links. A header is
bounded before it is read (saved_cache.read_header).

The directory holds at most `budget_bytes` of this model's files, the temporaries of a write in
progress included: the files used longest ago go first. A writer killed mid-write leaves
`.FP-DIGEST.ds2cache.*.tmp`: a server that holds the model's lock on the directory
(`.FP.lock`) removes them at start; one that does not (another server of the same model is
writing there) counts them against its budget instead."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ds2cli.errors import Ds2Error
from ds2cli.generation import saved_cache
from ds2cli.model.cache import LatentCache, common_prefix
from ds2cli.model.transformer import Model
from ds2cli.user_files import Lock, LockedError, file_kind

SUFFIX = ".ds2cache"
HEADER_SLACK = 4096                 # a header's fields beside its tokens, in bytes (a write's reservation)


@dataclasses.dataclass
class Saved:
    ids: np.ndarray          # (n,) int64: the tokens the file holds
    size: int                # its bytes


@dataclasses.dataclass
class Prefix:
    """What a file gave for a prompt, read on the request's thread: its first n positions."""
    tokens: list[int]        # (n,)
    latent: np.ndarray       # (L, n, C)
    k_pe: np.ndarray         # (L, n, R)


class DiskPool:
    def __init__(self, directory: Path, budget_bytes: int, model: Model,
                 log: Callable[[str], None] = lambda line: None):
        self.dir, self.budget, self.model, self.log = Path(directory), budget_bytes, model, log
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise Ds2Error(f"cannot use {directory} for the prompt cache: {e.strerror or e}") from None
        self.prefix = saved_cache.model_identity(model)[:16]
        self.lock = threading.Lock()                 # the index: the scheduler saves, request threads read
        self.index: dict[Path, Saved] = {}           # this model's files, least recently used first
        try:
            self.owner: Lock | None = Lock(self.dir / self.prefix, "the prompt cache of this model in")
        except LockedError:
            self.owner = None
            log(f"ds2 serve: another server of this model uses {self.dir}: its temporaries are counted, not removed")
        except OSError as e:
            raise Ds2Error(f"cannot use {directory} for the prompt cache: {e.strerror or e}") from None
        self.scan()

    def mine(self, name: str) -> bool:
        return name.startswith(f"{self.prefix}-") and name.endswith(SUFFIX)

    def temporary(self, name: str) -> bool:
        """A temporary of user_files.write_atomic writing one of this model's files."""
        return name.startswith(f".{self.prefix}-") and name.endswith(".tmp")

    def scan(self) -> None:
        """This model's files into the index, oldest first; a killed writer's temporaries removed
        (holding the model's lock); every `*.ds2cache` that is not a regular file skipped with a
        log line. Nothing is followed, and only this model's regular files are opened."""
        found = []
        with os.scandir(self.dir) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue                         # gone since the listing
                if self.temporary(entry.name) and self.owner is not None and entry.is_file(follow_symlinks=False):
                    self.forget_file(Path(entry.path), f"removed {entry.name}, left by a writer that was stopped")
                elif entry.name.endswith(SUFFIX) and not entry.is_file(follow_symlinks=False):
                    self.log(f"ds2 serve: prompt cache: skipping {entry.path}: {file_kind(st.st_mode)}, "
                             f"not a regular file")
                elif self.mine(entry.name):
                    found.append((st.st_mtime, Path(entry.path), st.st_size))
        for _, path, size in sorted(found):
            try:
                self.index[path] = Saved(np.asarray(saved_cache.peek(path, self.model, follow=False), np.int64), size)
            except Ds2Error as e:                    # corrupt, or swapped for something else: left as it is
                self.log(f"ds2 serve: prompt cache: skipping {path}: {e}")

    def forget_file(self, path: Path, line: str) -> None:
        try:
            path.unlink()
            self.log(f"ds2 serve: prompt cache: {line}")
        except OSError:
            pass

    @property
    def nbytes(self) -> int:
        """This model's files and the temporaries of writes under way or killed."""
        with self.lock:
            files = sum(saved.size for saved in self.index.values())
        return files + self.temporaries_bytes()

    def temporaries_bytes(self) -> int:
        total = 0
        try:
            with os.scandir(self.dir) as entries:
                for entry in entries:
                    if self.temporary(entry.name):
                        try:
                            total += entry.stat(follow_symlinks=False).st_size
                        except OSError:
                            pass        # finished (renamed) since the listing
        except OSError:
            pass
        return total

    def path_for(self, ids: np.ndarray) -> Path:
        return self.dir / f"{self.prefix}-{hashlib.sha256(ids.tobytes()).hexdigest()[:24]}{SUFFIX}"

    def save(self, ids: Sequence[int], cache: LatentCache) -> None:
        """Write the latents of ids[:cache.length] (a conversation the pool lets go of), room
        for it made first (the oldest files go), so the directory never passes its budget. A
        failed write (a full disk) loses only this entry."""
        ids = np.asarray(ids[:cache.length], dtype=np.int64)
        if len(ids) < 2:
            return
        path = self.path_for(ids)
        with self.lock:
            if path in self.index:
                self.touch(path)
                return
        size = cache.bytes_per_token * len(ids) + 8 * len(ids) + HEADER_SLACK       # at most, tokens as JSON
        if size > self.budget:
            return
        self.trim(self.budget - size)
        try:
            saved_cache.save(path, self.model, cache, ids.tolist())
            size = os.stat(path, follow_symlinks=False).st_size
        except (Ds2Error, OSError):
            return
        with self.lock:
            self.index[path] = Saved(ids, size)
        self.trim(self.budget)

    def trim(self, budget: int) -> None:
        """The oldest files out until this model's bytes are within `budget`."""
        total = self.nbytes
        with self.lock:
            for path in list(self.index):
                if total <= budget:
                    break
                total -= self.index.pop(path).size
                try:
                    path.unlink()
                except OSError:
                    pass

    def touch(self, path: Path) -> None:
        """`path` is the most recently used (called holding `lock`)."""
        self.index[path] = self.index.pop(path)
        try:
            os.utime(path, follow_symlinks=False)
        except OSError:
            pass

    def best(self, prompt: np.ndarray) -> tuple[Path | None, int]:
        """The file sharing the longest prefix with `prompt` (all but its last token at most)."""
        best, keep = None, 0
        with self.lock:
            for path, saved in self.index.items():
                n = min(common_prefix(saved.ids, prompt), len(prompt) - 1)
                if n > keep:
                    best, keep = path, n
        return best, keep

    def read(self, prompt: Sequence[int], beyond: int) -> Prefix | None:
        """On the request's thread: the positions of the file sharing the longest prefix with
        `prompt`, when that is more than `beyond` tokens (what memory holds); None otherwise, or
        when the file is gone or no longer loads (it is then forgotten)."""
        prompt = np.asarray(prompt, dtype=np.int64)
        path, keep = self.best(prompt)
        if path is None or keep <= beyond:
            return None
        try:
            tokens, _, latent, k_pe = saved_cache.read(path, self.model, prompt.tolist(), follow=False)
        except Ds2Error as e:
            with self.lock:
                self.index.pop(path, None)
            self.log(f"ds2 serve: prompt cache: skipping {path}: {e}")
            return None
        with self.lock:
            if path in self.index:
                self.touch(path)
        return Prefix(tokens, latent, k_pe)

    def close(self) -> None:
        """Let go of the model's lock on the directory (at a stop)."""
        if self.owner is not None:
            self.owner.release()
            self.owner = None
