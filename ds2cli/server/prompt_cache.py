"""A pool of latent caches of recent conversations, so a request prefills only what is new.

Chat clients resend the whole conversation every turn. Each pooled cache remembers the token
ids whose latents it holds; a request starts from the entry sharing the longest token prefix
with its prompt, keeps that prefix and prefills the rest (as ChatSession does for one
conversation). The pool holds at most `budget_bytes` of caches, counted at full capacity
(the ones in use included), and evicts the least recently used first.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from ds2cli.model.cache import LatentCache, common_prefix


@dataclasses.dataclass(eq=False)   # entries are told apart by identity (list.remove)
class Entry:
    ids: np.ndarray         # (n,) int64: the tokens whose latents cache[:n] holds
    cache: LatentCache


class PromptCache:
    """`slots` caches of `new_cache()`'s size fit in the budget: the ones requests are using plus
    the pooled ones. With no room beyond those in use, nothing is kept between requests."""

    def __init__(self, new_cache: Callable[[], LatentCache], cache_bytes: int, budget_bytes: int, disk=None):
        self.new_cache = new_cache
        self.slots = budget_bytes // cache_bytes
        self.entries: list[Entry] = []      # least recently used first
        self.in_use = 0                     # caches taken and not yet put back
        self.disk = disk                    # prompt_disk.DiskPool: where evicted entries go, or None

    def take(self, ids: Sequence[int]) -> tuple[LatentCache, int]:
        """A cache for prompt `ids` holding its longest cached prefix, and that prefix's length.

        At least one prompt token is left to run, since generation needs its logits. An entry
        whose tokens all match is handed over; one that matches only in part (another
        conversation with the same system prompt) is copied from and kept, if the budget has
        room for another cache, else handed over and cut."""
        best, keep = None, 0
        prompt = np.asarray(ids, dtype=np.int64)
        for entry in self.entries:
            n = min(common_prefix(entry.ids, prompt), len(ids) - 1)
            if n > keep:
                best, keep = entry, n
        on_disk, disk_keep = self.disk.best(prompt) if self.disk is not None else (None, 0)
        room = len(self.entries) + self.in_use + 1 <= self.slots
        self.in_use += 1
        if best is not None and disk_keep <= keep and (keep == len(best.ids) or not room):
            self.entries.remove(best)
            best.cache.truncate(keep)
            return best.cache, keep
        if room or not self.entries:
            cache = self.new_cache()
        else:  # full: the least recently used entry's memory becomes this request's cache
            cache = self.evict(0)
            cache.reset()
        if on_disk is not None and disk_keep > keep:     # a conversation evicted earlier, or before a restart
            kept = self.disk.load(on_disk, prompt, cache)
            if kept:
                return cache, kept
        if best is not None and best in self.entries:
            copy_prefix(best.cache, cache, keep)
            return cache, keep
        return cache, 0

    def evict(self, k: int) -> LatentCache:
        """Drop entry k (to disk first, with --prompt-cache-dir); its cache is free for reuse."""
        entry = self.entries.pop(k)
        if self.disk is not None:
            self.disk.save(entry.ids, entry.cache)
        return entry.cache

    def flush(self) -> None:
        """At a stop: every pooled conversation to disk (with --prompt-cache-dir)."""
        if self.disk is not None:
            for entry in self.entries:
                self.disk.save(entry.ids, entry.cache)

    def put(self, ids: Sequence[int], cache: LatentCache) -> None:
        """Keep `cache`, which holds the latents of ids[:cache.length], as most recently used."""
        self.in_use = max(0, self.in_use - 1)
        kept = np.asarray(ids[:cache.length], dtype=np.int64)
        cache.truncate(len(kept))
        room = self.slots - self.in_use
        if len(kept) and room > 0:
            self.entries.append(Entry(kept, cache))
        elif len(kept) and self.disk is not None:        # no room to pool it: it goes to disk at once
            self.disk.save(kept, cache)
        for _ in range(max(0, len(self.entries) - room)):
            self.evict(0)

    @property
    def cached_tokens(self) -> int:
        return sum(len(e.ids) for e in self.entries)


def copy_prefix(src: LatentCache, dst: LatentCache, n: int) -> None:
    """dst holds src's first n positions (and nothing after)."""
    dst.copy_prefix(src, n)
