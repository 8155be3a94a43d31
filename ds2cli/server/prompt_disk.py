"""`ds2 serve --prompt-cache-dir DIR`: the prompt cache's second tier, on disk.

A conversation the in-memory pool evicts (and, at a stop, every one it holds) is written to DIR
as a saved cache (generation/saved_cache.py: its tokens, its latents, the model's fingerprint),
and comes back when a later request, or a later server, begins with its tokens. The directory
holds at most `budget_bytes`; the files used longest ago go first. Files of another model, a
corrupt one or one ds2 did not write are left alone and never read past their header."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ds2cli.errors import Ds2Error
from ds2cli.generation import saved_cache
from ds2cli.model.cache import LatentCache, common_prefix
from ds2cli.model.transformer import Model

SUFFIX = ".ds2cache"


class DiskPool:
    def __init__(self, directory: Path, budget_bytes: int, model: Model):
        self.dir, self.budget, self.model = Path(directory), budget_bytes, model
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise Ds2Error(f"cannot use {directory} for the prompt cache: {e.strerror or e}") from None
        self.index: dict[Path, np.ndarray] = {}      # file -> the tokens it holds, least recently used first
        files = sorted(self.dir.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                self.index[path] = np.asarray(saved_cache.peek(path, model), dtype=np.int64)
            except Ds2Error:
                continue                             # another model's, or not ours: left as it is

    @property
    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.index if p.exists())

    def save(self, ids: Sequence[int], cache: LatentCache) -> None:
        """Write the latents of ids[:cache.length] (an evicted conversation), then keep the
        directory within its budget. A failed write (a full disk) loses only this entry."""
        ids = np.asarray(ids[:cache.length], dtype=np.int64)
        if len(ids) < 2:
            return
        path = self.dir / (hashlib.sha256(ids.tobytes()).hexdigest()[:24] + SUFFIX)
        if path in self.index:
            self.touch(path)
            return
        if cache.bytes_per_token * len(ids) > self.budget:
            return
        try:
            saved_cache.save(path, self.model, cache, ids.tolist())
        except Ds2Error:
            return
        self.index[path] = ids
        self.trim()

    def trim(self) -> None:
        total = self.nbytes
        for path in list(self.index):
            if total <= self.budget:
                break
            try:
                total -= path.stat().st_size
                path.unlink()
            except OSError:
                pass
            del self.index[path]

    def touch(self, path: Path) -> None:
        self.index[path] = self.index.pop(path)
        try:
            os.utime(path)
        except OSError:
            pass

    def best(self, prompt: np.ndarray) -> tuple[Path | None, int]:
        """The file sharing the longest prefix with `prompt` (all but its last token at most)."""
        best, keep = None, 0
        for path, ids in self.index.items():
            n = min(common_prefix(ids, prompt), len(prompt) - 1)
            if n > keep:
                best, keep = path, n
        return best, keep

    def load(self, path: Path, prompt: np.ndarray, cache: LatentCache) -> int:
        """Fill `cache` from `path` with the prefix it shares with `prompt`; 0 when the file is
        gone or no longer loads (it is then forgotten)."""
        try:
            kept, _ = saved_cache.load_into(path, self.model, cache, match=prompt.tolist())
        except Ds2Error:
            self.index.pop(path, None)
            cache.reset()
            return 0
        self.touch(path)
        return len(kept)
