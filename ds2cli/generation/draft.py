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

MAX_DRAFT = 63      # a verification pass is at most cores.FEW_TOKENS (64) tokens: a draft and one more


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
    """How many tokens to draft next, adapted to what drafting earns. A verification pass of
    1 + d tokens costs more than a plain step (little more on low-bit weights, whose few-token
    kernel widens each weight once for the pass; much more on float32, where BLAS multiplies a
    few columns slowly), so each pass is judged by its gain: the tokens it produced per second
    against a plain step's one (both timed as they run), averaged over the recent passes. While
    the gain is above 1 the draft grows after a pass that took it whole and shrinks to what was
    taken otherwise; below 1 (text that never repeats itself, weights on which passes cost too
    much) drafting pauses for FIRST_PAUSE plain steps, twice as many each time, up to MAX_PAUSE,
    so decoding runs at plain speed but for one trial pass in MAX_PAUSE steps."""

    FIRST_PAUSE, MAX_PAUSE = 8, 64      # three trial passes in the first 100 tokens of a losing text

    def __init__(self, most: int):
        self.most = most
        self.n = min(most, 4)
        self.pause = 0          # plain steps left before the next draft
        self.backoff = self.FIRST_PAUSE   # the pause after the next pass that lost
        self.step_s = None      # a plain step's seconds, a moving average
        self.gain = None        # recent passes' tokens a second / plain steps', a moving average

    def next(self) -> int:
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.n

    def record_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

    def record(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """A pass of 1 + drafted tokens that kept `accepted` of the draft (and gave one token more)."""
        if drafted == 0:
            return
        if seconds and self.step_s:
            gain = (accepted + 1) * self.step_s / seconds
        else:       # not timed yet: a pass counted as costing one step more than a plain one
            gain = (accepted + 1) / 2
        self.gain = gain if self.gain is None else 0.7 * self.gain + 0.3 * gain
        if accepted > 0 and self.gain > 1:
            self.pause, self.backoff = 0, self.FIRST_PAUSE
            self.n = min(self.most, self.n + 2) if accepted == drafted else max(1, accepted + 1)
            return
        self.n = max(1, self.n // 2)
        self.pause, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_PAUSE)
