"""A pool of latent caches of recent conversations, so a request prefills only what is new.

Chat clients resend the whole conversation every turn. Each pooled cache remembers the token
ids whose latents it holds; a request starts from the entry sharing the longest token prefix
with its prompt, keeps that prefix and prefills the rest (as ChatSession does for one
conversation). The pool holds at most `budget_bytes` of caches, counted at full capacity
(the ones in use included), and evicts the least recently used first, to the disk tier
(prompt_disk.py) when there is one; a conversation is never cut short to make room for another.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from ds2cli.model.cache import LatentCache, common_prefix
from ds2cli.server.prompt_disk import Prefix


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

    def longest(self, ids: Sequence[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with prompt `ids` (all but its last token at
        most, since generation needs its logits), and that prefix's length."""
        best, keep = None, 0
        prompt = np.asarray(ids, dtype=np.int64)
        for entry in self.entries:
            n = min(common_prefix(entry.ids, prompt), len(ids) - 1)
            if n > keep:
                best, keep = entry, n
        return best, keep

    def take(self, ids: Sequence[int], read: Prefix | None = None) -> tuple[LatentCache, int]:
        """A cache for prompt `ids` holding its longest cached prefix, and that prefix's length.

        `read` is what the request's thread read from the disk tier (prompt_disk.DiskPool.read),
        used when it is longer than what memory holds. An entry whose tokens all match is
        handed over. Otherwise the request gets a new cache if the budget has room, else the
        least recently used entry's (that entry evicted: to disk first), and the prefix it
        shares with an entry (another conversation with the same system prompt) is copied, so
        that entry stays whole."""
        best, keep = self.longest(ids)
        room = len(self.entries) + self.in_use + 1 <= self.slots
        self.in_use += 1
        if (read is None or len(read.tokens) <= keep) and best is not None and keep == len(best.ids):
            self.entries.remove(best)
            return best.cache, keep
        if room or not self.entries:
            cache = self.new_cache()
        else:  # full: the least recently used entry's memory becomes this request's cache
            oldest = self.entries[0]
            cache = self.evict(0)
            if oldest is best:         # the prefix it shares is in place already
                cache.truncate(keep)
                best = None
            else:
                cache.reset()
        if read is not None and len(read.tokens) > keep:     # evicted earlier, or before a restart
            cache.set_prefix(read.latent, read.k_pe)
            return cache, len(read.tokens)
        if best is not None:
            copy_prefix(best.cache, cache, keep)
        return cache, keep

    def evict(self, k: int) -> LatentCache:
        """Drop entry k (to disk first, with --prompt-cache-dir); its cache is free for reuse."""
        entry = self.entries.pop(k)
        if self.disk is not None:
            self.disk.save(entry.ids, entry.cache)
        return entry.cache

    def flush(self) -> None:
        """At a stop: every pooled conversation to disk (with --prompt-cache-dir), and the
        directory's lock let go."""
        if self.disk is not None:
            for entry in self.entries:
                self.disk.save(entry.ids, entry.cache)
            self.disk.close()

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
