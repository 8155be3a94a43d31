"""Draft sources for speculative decoding: guesses of the next few tokens that one forward pass
then verifies (generate.py). One small interface, `propose(history, n) -> up to n token ids`, so
that other sources (DeepSeek-V3's multi-token-prediction layer, a small draft model) can be
added beside prompt lookup.

Prompt lookup (as Hugging Face's `prompt_lookup_num_tokens` and llama.cpp's lookup decoding):
the last few tokens are looked up among everything before them (the prompt and the reply so far),
and the tokens that followed their latest earlier occurrence are the draft. It costs no model,
and it guesses well where the output copies its input: code edits, quotes, summaries, RAG
answers, structured output."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class DraftSource(Protocol):
    def propose(self, history: Sequence[int], n: int) -> list[int]:
        """Up to n tokens that might follow `history` (none: no guess)."""


class PromptLookup:
    """Drafts copied from the latest earlier occurrence of the longest matching suffix of up to
    `max_ngram` tokens (at least `min_ngram`)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, history: Sequence[int], n: int) -> list[int]:
        tokens = np.asarray(history)
        end = len(tokens)
        for size in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            # every start (before the suffix's own) where the `size` tokens equal the suffix
            match = np.ones(end - size, dtype=bool)
            for j in range(size):
                match &= tokens[j:end - size + j] == tokens[end - size + j]
            starts = np.flatnonzero(match)
            if len(starts):      # the latest occurrence: what the text did most recently
                start = int(starts[-1]) + size
                return [int(t) for t in tokens[start:start + n]]
        return []


class DraftLength:
    """How many tokens to draft next, adapted to how the drafts fare: longer after a draft
    accepted whole, shorter after a rejection, and after drafts that were wholly rejected, a
    pause of plain decode steps that doubles each time (so a text that never repeats itself
    costs next to nothing: the floor is plain decoding)."""

    def __init__(self, most: int):
        self.most = most
        self.n = min(most, 4)
        self.pause = 0          # plain steps left before the next draft
        self.backoff = 1        # the pause after the next wholly rejected draft

    def next(self) -> int:
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.n

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.n = min(self.most, self.n + 2)
            self.backoff = 1
        elif accepted == 0:
            self.n = max(1, self.n // 2)
            self.pause, self.backoff = self.backoff, min(2 * self.backoff, 64)
        else:
            self.n = max(1, accepted + 1)
            self.backoff = 1
