"""The generation loop: prefill once, then decode token by token, as a generator of chunks
that the CLI renders (text streamed, stats and finish reason at the end)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator, Sequence

import numpy as np

from ds2cli.cache import LatentCache
from ds2cli.draft import DraftLength, DraftSource, PromptLookup
from ds2cli.errors import GenerationError
from ds2cli.model import Model
from ds2cli.sampling import Sampler


@dataclasses.dataclass
class Chunk:
    """One step of generation: `text` is what may be printed now (never half a character).
    Every chunk carries the counts and timings so far, so an interrupted generation can still
    report what ran; the last one has the finish reason and every generated id."""
    text: str
    token: int | None = None
    finish_reason: str | None = None      # "eos" | "stop" | "length" | "grammar" on the last chunk
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tokens: list = dataclasses.field(default_factory=list)  # every generated id, on the last chunk
    drafted: int = 0                      # speculative decoding: tokens drafted, and accepted
    accepted: int = 0

    @property
    def prefill_tok_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_per_s(self) -> float:
        # the first generated token comes from the prefill logits; decode steps = generated - 1
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0


class StopMatcher:
    """Holds back text that could be the start of a stop string, and cuts at the first stop."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s))
                    if self.pending.endswith(s[:k])), default=0)
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def lstrip_reply(chunks: Iterator[Chunk]) -> Iterator[Chunk]:
    """Drop the whitespace a chat reply starts with (templates end the prompt at "Assistant:")."""
    started = False
    for chunk in chunks:
        if not started:
            chunk.text = chunk.text.lstrip()
            started = bool(chunk.text)
        yield chunk


def check_logits(logits: np.ndarray) -> np.ndarray:
    if not np.all(np.isfinite(logits)):
        raise GenerationError("the model produced non-finite logits (NaN or Inf): "
                              "the weights are probably corrupt (try `ds2 inspect --check`)")
    return logits


def stream_generate(model: Model, prompt_ids: Sequence[int], cache: LatentCache, sampler: Sampler,
                    max_new_tokens: int, stop: Sequence[str] = (),
                    eos_ids: Sequence[int] | None = None,
                    context: Sequence[int] = (), draft: int = 0,
                    drafts: DraftSource | None = None,
                    finished: Callable[[], bool] | None = None) -> Iterator[Chunk]:
    """Prefill `prompt_ids` after what `cache` holds, then sample up to max_new_tokens tokens.

    The cache ends holding the prompt and every generated token that was fed back; the last
    sampled token (eos or the limit's) is not fed back, since nothing needs its logits.
    `context` lists the tokens already cached, for the repetition penalty.

    With `draft` N > 0, speculative decoding: after each token, up to N tokens are drafted
    (`drafts`, default prompt lookup; the length adapts, DraftLength) and verified in one pass of
    1 + N tokens; the longest agreeing prefix is kept (the sampler's `verify` keeps the output
    distribution exactly the sampler's), the cache is rolled back past the rest, and the pass's
    next logits give one more token. Everything else (eos, stop strings, limits) is as without.

    `finished()` (grammar hook: the sampler's Constraint.done) ends generation after a token that
    completes a constrained reply, with reason "grammar", sparing the pass that would give eos."""
    eos = set(model.eos_token_ids if eos_ids is None else eos_ids)
    decoder, stops = model.tokenizer.stream_decoder(), StopMatcher(stop)
    history = [*context, *prompt_ids]
    base = cache.length + len(prompt_ids)          # the cache length before the first generated token
    t0 = time.perf_counter()
    logits = check_logits(model.forward(prompt_ids, cache))
    prefill_s, t1 = time.perf_counter() - t0, time.perf_counter()
    generated: list[int] = []
    counts = {"drafted": 0, "accepted": 0}
    reason = "length"

    def emit(token: int):
        """Take one generated token: yields its text; returns whether generation goes on."""
        nonlocal reason
        generated.append(token)
        history.append(token)
        if token in eos:
            reason = "eos"
            return False
        text, hit = stops.feed(decoder.push(token))
        so_far = (None, len(prompt_ids), len(generated), prefill_s, time.perf_counter() - t1)
        if hit:
            reason = "stop"
            yield Chunk(text, token, *so_far)
            return False
        if text:
            yield Chunk(text, token, *so_far)
        if finished is not None and finished():     # grammar hook
            reason = "grammar"
            return False
        return len(generated) < max_new_tokens

    source = drafts or (PromptLookup() if draft > 0 else None)
    length = DraftLength(draft) if draft > 0 else None
    token = sampler(logits, history) if max_new_tokens > 0 else None
    while token is not None and (yield from emit(token)) and cache.free > 0:
        n = min(length.next(), max_new_tokens - len(generated) - 1, cache.free - 1) if length else 0
        guess = source.propose(history, n)[:n] if n > 0 else []
        started = time.perf_counter()
        if not guess:
            token = sampler(check_logits(model.forward([token], cache)), history)
            if length:
                length.record_step(time.perf_counter() - started)
            continue
        rows = check_logits(model.forward([token, *guess], cache, all_logits=True))  # (1 + d, V)
        took = time.perf_counter() - started
        accepted, going = 0, True
        for row, guessed in zip(rows, guess):
            ok, token = sampler.verify(row, history, guessed)
            if not ok:
                break
            accepted += 1
            going = yield from emit(guessed)
            if not going:
                break
        counts["drafted"] += len(guess)
        counts["accepted"] += accepted
        length.record(len(guess), accepted, took)
        # the cache keeps every token fed that plain decoding would have fed: all the generated
        # ones, but for the last when generation ends there (a rejected draft's replacement, or
        # the next token, is fed by the next pass)
        cache.truncate(base + len(generated) - (not going))
        if not going:
            break
        if accepted == len(guess):      # every draft taken: the pass's last row gives one more
            token = sampler(rows[-1], history)
    tail = ""
    if reason != "stop":  # held-back bytes or a held-back stop-string prefix may remain
        tail, hit = stops.feed(decoder.flush())
        tail, reason = (tail, "stop") if hit else (tail + stops.flush(), reason)
    yield Chunk(tail, None, reason, len(prompt_ids), len(generated), prefill_s,
                time.perf_counter() - t1, generated, counts["drafted"], counts["accepted"])
