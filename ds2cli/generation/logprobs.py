"""Token log-probabilities for `ds2 serve`: what `logprobs`, `top_logprobs` and `echo` report.

Every figure is the model's raw log-softmax over its logits row, before the repetition penalty,
logit_bias, temperature and the top-k/top-p/min-p filters (as vLLM reports by default): an
evaluation scores with temperature 0, where the sampled distribution would be a point mass.

Three pieces, each small:
- `entry(row, token, top_n)`: one position's figures, from one logits row (V,).
- `TokenLogprobs`: called where the sampler is (`observe`), it hands each generated token's
  entry to the chunk that goes out once the token is sampled (`attach`): exactly once, in order,
  whatever text the stop-string matcher or an unfinished UTF-8 character holds back meanwhile.
- `PROMPT_CHUNK`: under `echo` a prompt runs at most this many tokens a pass with every row's
  logits, each pass's rows reduced to entries at once (the engine's `prompt_rows`, through
  generate.Generation), so that the (T, V) logits of a whole prompt never exist at once
  (0.84 GB for 2048 tokens of V2-Lite).

And the OpenAI shapes of a list of entries, for chat (`content[]`) and for completions
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).
"""

from __future__ import annotations

import codecs
import dataclasses
from typing import Iterator, Sequence

import numpy as np

from ds2cli.generation.generate import Chunk
from ds2cli.text.tokenizer import Tokenizer

MAX_TOP = 20            # top_logprobs may ask for 0..20 alternatives (OpenAI's limit)
PROMPT_CHUNK = 256      # echo scores a prompt this many positions per forward pass: (256, V) logits at most


@dataclasses.dataclass(frozen=True)
class Entry:
    """One position: the token there, its log-probability, and the top_n most likely tokens
    (most likely first; ties by lower id) with theirs."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(row: np.ndarray) -> np.ndarray:
    """(V,) logits -> (V,) float64 log-probabilities; the max is subtracted first, so no exp overflows."""
    x = row.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def entry(row: np.ndarray, token: int, top_n: int) -> Entry:
    """The figures of one position from its logits row. The chosen token's logprob and the top
    ones come from the same array, so a greedy token's logprob equals the top value exactly
    (lm-eval's is_greedy compares them with !=)."""
    lp = log_softmax(row)                                                  # (V,)
    top: tuple = ()
    if top_n > 0:
        n = min(top_n, len(lp))
        best = np.argpartition(-lp, n - 1)[:n]                             # (n,) unordered
        best = best[np.lexsort((best, -lp[best]))]                         # by logprob, then id
        top = tuple((int(t), float(lp[t])) for t in best)
    return Entry(int(token), float(lp[token]), top)


class TokenLogprobs:
    """The entries of one generation's tokens, riding on the chunks (`Chunk.logprobs`).

    `observe(row, token)` where the sampler picks each token; `attach(chunks)` wraps the
    generation's chunks. A chunk goes out right after the token it was made for was sampled, so
    each chunk takes every entry observed since the previous one: a token whose text is held
    back (a possible stop string, half a character) has its entry sent with the chunk of its own
    step or a later one, never twice and never out of order. The eos token is not part of the
    reply: its entry is dropped, as its text is, except under echo (`keep_eos`), where a scorer
    such as lm-eval takes the last entry for the generated token and the prompt's for the rest:
    without the eos entry it would drop a prompt token's instead."""

    def __init__(self, top_n: int, keep_eos: bool = False):
        self.top_n, self.keep_eos = top_n, keep_eos
        self.pending: list[Entry] = []

    def observe(self, row: np.ndarray, token: int) -> None:
        self.pending.append(entry(row, token, self.top_n))

    def attach(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        for chunk in chunks:
            if chunk.finish_reason == "eos" and self.pending and not self.keep_eos:
                self.pending.pop()
            chunk.logprobs, self.pending = self.pending, []
            yield chunk


class ObservedSampler:
    """A sampler whose every pick (a sample, or a verified draft's outcome) is observed with the
    raw logits row it came from: the generation's tokens get their entries in order."""

    def __init__(self, sampler, logprobs: TokenLogprobs):
        self.sampler, self.logprobs = sampler, logprobs

    def __call__(self, logits: np.ndarray, history) -> int:
        token = self.sampler(logits, history)
        self.logprobs.observe(logits, token)
        return token

    def verify(self, row: np.ndarray, history, guessed: int):
        ok, token = self.sampler.verify(row, history, guessed)
        self.logprobs.observe(row, token)
        return ok, token


# ---- the OpenAI shapes ----
def token_string(tokenizer: Tokenizer, token: int) -> str:
    """A token's own text ('\\ufffd' for a piece of a character that spans tokens)."""
    return tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def chat_content(tokenizer: Tokenizer, entries: Sequence[Entry]) -> list[dict]:
    """chat's choices[].logprobs.content: {token, logprob, bytes, top_logprobs[]} per token."""
    def one(token: int, logprob: float) -> dict:
        return {"token": token_string(tokenizer, token), "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token))}
    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


class TextOffsets:
    """Where each token's text starts in the answer's text, in characters: the count of
    characters that the bytes before it complete (a token that finishes a character begun by
    the one before starts where that character does)."""

    def __init__(self, tokenizer: Tokenizer, start: int = 0):
        self.tokenizer, self.at = tokenizer, start
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, token: int) -> int:
        at = self.at
        self.at += len(self.utf8.decode(self.tokenizer.token_bytes(token)))
        return at


def top_map(tokenizer: Tokenizer, e: Entry) -> dict:
    """{text: logprob} of the alternatives; two tokens with the same text (pieces of characters
    both shown as '\ufffd') keep the likelier one's figure, so the max is still the top one's."""
    out: dict = {}
    for t, lp in e.top:
        out.setdefault(token_string(tokenizer, t), lp)
    return out


def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[Entry | None], offsets: TextOffsets,
                        tokens: Sequence[int] | None = None) -> dict:
    """completions' choices[].logprobs for `entries` (None: the first prompt token under echo,
    whose id is then `tokens[i]`): top_logprobs maps each alternative's text to its logprob."""
    ids = [e.token if e is not None else tokens[i] for i, e in enumerate(entries)]
    return {"tokens": [token_string(tokenizer, t) for t in ids],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else top_map(tokenizer, e) for e in entries],
            "text_offset": [offsets.next(t) for t in ids]}
