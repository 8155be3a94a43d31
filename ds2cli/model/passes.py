"""Forward passes: what one pass carries to every layer (`Pass`), the steps a caller asks for
(`Step`), their checks, and the memory chunk that cuts any request into passes of at most
PREFILL_CHUNK tokens (`chunked`): the same for generate, chat, serve, bench and the library."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from ds2cli.errors import Ds2Error
from ds2cli.model.cache import LatentCache

# The memory chunk: no pass runs more than this many tokens, so a prompt of any length is read in
# passes whose activations, router and attention working memory stay bounded (attention.py's
# budget covers the scores). 1,024 keeps each product a large GEMM: prefill tok/s is flat from
# 512 tokens on.
PREFILL_CHUNK = 1024


@dataclasses.dataclass
class Step:
    """One sequence's part of a forward pass: `ids` run after what `cache` holds, and which
    logits come back for them: "last" (V,), "all" (T, V), or "none" (a prompt chunk)."""
    ids: Sequence[int]
    cache: LatentCache
    logits: str = "last"


@dataclasses.dataclass
class Pass:
    """One forward pass as every decoder layer sees it: all sequences' new tokens stacked
    (N = sum of T), where each sequence starts in its cache, and which rows the head computes.
    Whatever runs a range of layers gets this with its own caches (Pass.with_caches)."""
    tokens: np.ndarray            # (N,) new token ids, sequence after sequence
    lengths: list[int]            # each sequence's T
    starts: list[int]             # each sequence's cached length before the pass
    wanted: list[int]             # how many logits rows each sequence gets back
    caches: list                  # each sequence's LatentCache
    trace: list | None = None     # each MoE layer appends the expert ids it chose (T, k)

    @classmethod
    def of(cls, ids: list[np.ndarray], steps: Sequence[Step], trace: list | None) -> "Pass":
        lengths = [len(t) for t in ids]
        wanted = [n if s.logits == "all" else 1 if s.logits == "last" else 0 for s, n in zip(steps, lengths)]
        return cls(np.concatenate(ids), lengths, [s.cache.length for s in steps], wanted,
                   [s.cache for s in steps], trace)

    @property
    def rows(self) -> list[slice]:
        ends = np.cumsum(self.lengths)
        return [slice(int(e - n), int(e)) for n, e in zip(self.lengths, ends)]

    @property
    def positions(self) -> np.ndarray:
        return np.concatenate([np.arange(p, p + n) for p, n in zip(self.starts, self.lengths)])   # (N,)

    @property
    def picked(self) -> np.ndarray:
        """The rows the head computes: a sequence's last (wanted 1) or all of its rows."""
        return np.concatenate([np.arange(r.stop - w, r.stop) for r, w in zip(self.rows, self.wanted)]).astype(np.int64)

    def with_caches(self, caches: list, trace: list | None) -> "Pass":
        return dataclasses.replace(self, caches=caches, trace=trace)

    def logits_of(self, ids: list[np.ndarray], steps: Sequence[Step], logits) -> list:
        """Each step's logits out of this pass's (M, V), its cache now holding its tokens."""
        for s, t, start in zip(steps, ids, self.starts):
            s.cache.length = start + len(t)
        out, at = [], 0
        for s, n in zip(steps, self.wanted):
            part = logits[at:at + n] if n else None
            out.append(None if s.logits == "none" else part[0] if s.logits == "last" else part)
            at += n
        return out


def check_ids(token_ids, vocab_size: int) -> np.ndarray:
    ids = np.asarray(token_ids).reshape(-1)
    if len(ids) == 0:
        raise Ds2Error("forward needs at least one token")
    if ids.dtype.kind not in "iu":                       # 5.0 or "5" is a caller's bug, not token 5
        raise Ds2Error(f"token ids must be integers, got {ids.dtype} values")
    ids = ids.astype(np.int64)
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = int(ids.max() if ids.max() >= vocab_size else ids.min())
        raise Ds2Error(f"token id out of range [0, {vocab_size}): {bad}")
    return ids


def check_steps(steps: Sequence[Step], vocab_size: int, ids: list | None = None) -> list[np.ndarray]:
    """Each step's ids, checked (unless given so), then the steps themselves: distinct caches, a
    known `logits`, room in each cache."""
    ids = ids if ids is not None else [check_ids(s.ids, vocab_size) for s in steps]
    if len({id(s.cache) for s in steps}) < len(steps):
        raise Ds2Error("a forward pass got the same cache twice")
    for s, t in zip(steps, ids):
        if s.logits not in ("last", "all", "none"):
            raise Ds2Error(f"a step's logits must be 'last', 'all' or 'none', not {s.logits!r}")
        s.cache.check_room(len(t))
    return ids


def chunked(ids: list[np.ndarray], steps: Sequence[Step], run: Callable, chunk: int = PREFILL_CHUNK,
            progress: Callable[[int, int], None] | None = None) -> list:
    """The steps in passes of at most `chunk` tokens, each step's tokens in order:
    run(ids, steps) runs one pass. A step's "last" logits come from its final piece, its "all"
    logits are its pieces' rows in order; `progress(done, total)` hears of each pass."""
    total, done = sum(map(len, ids)), 0
    at = [0] * len(steps)
    pieces: list[list[np.ndarray]] = [[] for _ in steps]
    while done < total:
        room, part = chunk, []
        for i, (s, t) in enumerate(zip(steps, ids)):
            n = min(len(t) - at[i], room)
            if n > 0:
                final = at[i] + n == len(t)
                mode = "all" if s.logits == "all" else "last" if s.logits == "last" and final else "none"
                part.append((i, Step(t[at[i]:at[i] + n], s.cache, mode)))
                at[i], room = at[i] + n, room - n
        out = run([st.ids for _, st in part], [st for _, st in part])
        for (i, _), logits in zip(part, out):
            if logits is not None:
                pieces[i].append(logits)
        done += sum(len(st.ids) for _, st in part)
        if progress is not None:
            progress(done, total)
    return [None if s.logits == "none" else pieces[i][-1] if s.logits == "last" else np.concatenate(pieces[i])
            for i, s in enumerate(steps)]
