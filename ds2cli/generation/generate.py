"""The generation loop: prefill once, then decode token by token, as a generator of chunks
that the CLI renders (text streamed, stats and finish reason at the end)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator, Sequence

import numpy as np

from ds2cli.model.cache import LatentCache
from ds2cli.generation.draft import DraftLength, DraftSource, PromptLookup
from ds2cli.errors import GenerationError
from ds2cli.model.transformer import Model, Step
from ds2cli.generation.sampling import Sampler


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
    logprobs: list | None = None          # serve: logprobs.Entry of the tokens this chunk sends (TokenLogprobs)

    @property
    def prefill_tok_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_per_s(self) -> float:
        # the first generated token comes from the prefill logits; decode steps = generated - 1
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0


# Stop strings together may hold at most this many characters (the server answers 400, the CLI a
# usage error): the matcher's automaton is built from them once per request.
MAX_STOP_CHARS = 16_384


def check_stops(stops: Sequence[str]) -> str | None:
    """Why these stop strings are refused, or None."""
    total = sum(len(s) for s in stops)
    if total > MAX_STOP_CHARS:
        return f"the stop strings hold {total} characters together, more than the {MAX_STOP_CHARS} allowed"
    return None


class StopMatcher:
    """Holds back text that could be the start of a stop string, and cuts at the first stop.

    An Aho-Corasick automaton over the stop strings: each character of the generated text moves
    one state (a failure link per mismatch, amortized constant), so a token costs its length
    whatever the stops' lengths, never their square. The state's depth is the longest tail of
    the text that begins some stop string: exactly what must be held back. A stop is cut at the
    first position where one ends (the longest of those ending there)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.goto: list[dict[str, int]] = [{}]       # the trie of the stops' prefixes
        self.depth = [0]                             # each state's prefix length
        self.match = [0]                             # the longest stop ending at each state, 0 if none
        for s in self.stops:
            node = 0
            for ch in s:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = self.goto[node][ch] = len(self.goto)
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.match.append(0)
                node = nxt
            self.match[node] = len(s)
        self.fail = self._failure_links()
        self.state = 0
        self.pending = ""

    def _failure_links(self) -> list[int]:
        """Breadth first: a state's failure is the longest proper suffix of its prefix that is
        also a prefix in the trie; a stop ending at the failure ends here too."""
        fail = [0] * len(self.goto)
        queue = list(self.goto[0].values())
        for node in queue:
            for ch, child in self.goto[node].items():
                f = fail[node]
                while f and ch not in self.goto[f]:
                    f = fail[f]
                fail[child] = self.goto[f].get(ch, 0) if self.goto[f].get(ch) != child else 0
                self.match[child] = max(self.match[child], self.match[fail[child]])
                queue.append(child)
        return fail

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        state = self.state
        for i, ch in enumerate(text):
            while state and ch not in self.goto[state]:
                state = self.fail[state]
            state = self.goto[state].get(ch, 0)
            if self.match[state]:
                seen = self.pending + text[:i + 1]
                self.pending, self.state = "", 0
                return seen[:len(seen) - self.match[state]], True
        self.state = state
        seen = self.pending + text
        hold = self.depth[state]
        self.pending = seen[len(seen) - hold:] if hold else ""
        return seen[:len(seen) - hold], False

    def flush(self) -> str:
        out, self.pending, self.state = self.pending, "", 0
        return out


class ReplyStart:
    """Drops the whitespace a chat reply starts with (templates end the prompt at "Assistant:"):
    called on each of one reply's chunks in order."""

    def __init__(self):
        self.started = False

    def __call__(self, chunk: Chunk) -> Chunk:
        if not self.started:
            chunk.text = chunk.text.lstrip()
            self.started = bool(chunk.text)
        return chunk


def lstrip_reply(chunks: Iterator[Chunk]) -> Iterator[Chunk]:
    """One reply's chunks with its leading whitespace dropped (ReplyStart)."""
    start = ReplyStart()
    return (start(chunk) for chunk in chunks)


def check_logits(logits: np.ndarray) -> np.ndarray:
    if not np.all(np.isfinite(logits)):
        raise GenerationError("the model produced non-finite logits (NaN or Inf): "
                              "the weights are probably corrupt (try `ds2 inspect --check`)")
    return logits


class Generation:
    """One sequence's generation as a series of forward passes: `step()` says what the next pass
    runs for it (a model Step), `take(logits)` takes that pass's logits and returns the chunks
    they produce; `done` after the last one. stream_generate drives one Generation alone; the
    serving engine drives several in each pass (Model.forward_batch): one code path, B = 1 or more.

    The prompt runs after what `cache` holds, in one pass or in chunks (step's `limit`);
    then up to max_new_tokens tokens are sampled. The cache ends holding the prompt and every
    generated token that was fed back; the last sampled token (eos or the limit's) is not fed
    back, since nothing needs its logits. `context` lists the tokens already cached, for the
    repetition penalty.

    With `draft` N > 0, speculative decoding: after each token, up to N tokens are drafted
    (`drafts`, default prompt lookup; the length adapts, DraftLength) and verified in one pass of
    1 + N tokens; the longest agreeing prefix is kept (the sampler's `verify` keeps the output
    distribution exactly the sampler's), the cache is rolled back past the rest, and the pass's
    next logits give one more token. Everything else (eos, stop strings, limits) is as without.

    With `prompt_rows(rows, tokens)`, every prompt position's logits come back (serve's echo):
    the prompt runs at most `prompt_rows_chunk` tokens a pass, and each pass hands its rows with
    the prompt tokens they predict.

    `finished()` (grammar hook: the sampler's Constraint.done) ends generation after a token that
    completes a constrained reply, with reason "grammar", sparing the pass that would give eos."""

    def __init__(self, model: Model, prompt_ids: Sequence[int], cache: LatentCache, sampler: Sampler,
                 max_new_tokens: int, stop: Sequence[str] = (), eos_ids: Sequence[int] | None = None,
                 context: Sequence[int] = (), draft: int = 0, drafts: DraftSource | None = None,
                 prompt_rows=None, prompt_rows_chunk: int = 256,
                 finished: Callable[[], bool] | None = None, special: bool = False):
        if len(prompt_ids) == 0:
            raise GenerationError("a generation needs at least one prompt token")
        self.cache, self.sampler, self.max_new_tokens = cache, sampler, max_new_tokens
        self.eos = set(model.eos_token_ids if eos_ids is None else eos_ids)
        # special tokens (bos, eos under ignore_eos ...) add no text unless `special` asks for it
        self.decoder, self.stops = model.tokenizer.stream_decoder(special), StopMatcher(stop)
        self.prompt = list(prompt_ids)
        self.pending = list(prompt_ids)             # prompt tokens not yet run
        self.fed = 0                                # how many of them the last step ran
        self.prompt_rows, self.prompt_rows_chunk = prompt_rows, prompt_rows_chunk
        self.finished = finished
        self.history = [*context, *prompt_ids]
        self.base = cache.length + len(prompt_ids)  # the cache length before the first generated token
        self.generated: list[int] = []
        self.drafted = self.accepted = 0
        self.reason = "length"
        self.source = drafts or (PromptLookup() if draft > 0 else None)
        self.length = DraftLength(draft) if draft > 0 else None
        self.token: int | None = None               # sampled, to be fed by the next pass
        self.guess: list[int] = []                  # the drafts that pass verifies
        self.done = False
        self.t0 = self.t1 = None                    # when the prompt started, and when it ended
        self.prefill_s = 0.0
        self.passed = 0.0                           # when the last step was made

    # ---- the two calls ----
    def step(self, limit: int | None = None) -> Step:
        """What the next forward pass runs for this sequence: at most `limit` prompt tokens."""
        self.passed = time.perf_counter()
        if self.t0 is None:
            self.t0 = self.passed
        if self.pending:
            if self.prompt_rows is not None:
                limit = min(limit or self.prompt_rows_chunk, self.prompt_rows_chunk)
            part = self.pending[:max(1, limit or len(self.pending))]
            self.fed = len(part)
            if self.prompt_rows is not None:
                return Step(part, self.cache, "all")
            return Step(part, self.cache, "last" if len(part) == len(self.pending) else "none")
        n = 0
        if self.length:
            n = min(self.length.next(), self.max_new_tokens - len(self.generated) - 1, self.cache.free - 1)
        self.guess = self.source.propose(self.history, n)[:n] if n > 0 else []
        return Step([self.token, *self.guess], self.cache, "all" if self.guess else "last")

    def take(self, logits: np.ndarray | None) -> list[Chunk]:
        """The chunks that this sequence's logits from the pass of `step()` produce."""
        took = time.perf_counter() - self.passed
        out: list[Chunk] = []
        if self.pending:
            part = self.pending[:self.fed]
            del self.pending[:self.fed]
            if self.prompt_rows is not None:     # rows (fed, V): each predicts the next prompt token
                nexts = part[1:] + self.pending[:1]
                self.prompt_rows(check_logits(logits[:len(nexts)]), nexts)
                logits = logits[-1]
            if self.pending:
                return out
            self.t1 = time.perf_counter()
            self.prefill_s = self.t1 - self.t0
            if self.max_new_tokens <= 0:
                return self.finish(out)
            token = self.sampler(check_logits(logits), self.history)
        elif not self.guess:
            token = self.sampler(check_logits(logits), self.history)
            if self.length:
                self.length.record_step(took)
        else:
            token = self.verify(check_logits(logits), took, out)
            if token is None:
                return self.finish(out)
        if not self.emit(token, out) or self.cache.free <= 0:
            return self.finish(out)
        self.token = token
        return out

    def finish(self, out: list[Chunk], reason: str | None = None) -> list[Chunk]:
        """End the generation (`reason` overrides why, e.g. a server's abort): the last chunk."""
        self.reason = reason or self.reason
        tail = ""
        if self.reason != "stop":  # held-back bytes or a held-back stop-string prefix may remain
            tail, hit = self.stops.feed(self.decoder.flush())
            tail, self.reason = (tail, "stop") if hit else (tail + self.stops.flush(), self.reason)
        self.done = True
        out.append(Chunk(tail, None, self.reason, *self.so_far(), self.generated,
                         self.drafted, self.accepted))
        return out

    # ---- the pieces ----
    def so_far(self) -> tuple:
        decode_s = time.perf_counter() - self.t1 if self.t1 is not None else 0.0
        return len(self.prompt), len(self.generated), self.prefill_s, decode_s

    def emit(self, token: int, out: list[Chunk]) -> bool:
        """Take one generated token (its text joins `out`); return whether generation goes on."""
        self.generated.append(token)
        self.history.append(token)
        if token in self.eos:
            self.reason = "eos"
            return False
        text, hit = self.stops.feed(self.decoder.push(token))
        if hit:
            self.reason = "stop"
        if text or hit:
            out.append(Chunk(text, token, None, *self.so_far()))
        if not hit and self.finished is not None and self.finished():     # grammar hook
            self.reason = "grammar"
            return False
        return not hit and len(self.generated) < self.max_new_tokens

    def verify(self, rows: np.ndarray, took: float, out: list[Chunk]) -> int | None:
        """Keep the longest prefix of the drafts that the sampler agrees with (rows (1 + d, V));
        return the next token, or None when generation ended among the drafts."""
        accepted, going = 0, True
        token = None
        for row, guessed in zip(rows, self.guess):
            ok, token = self.sampler.verify(row, self.history, guessed)
            if not ok:
                break
            accepted += 1
            going = self.emit(guessed, out)
            if not going:
                break
        self.drafted += len(self.guess)
        self.accepted += accepted
        self.length.record(len(self.guess), accepted, took)
        # the cache keeps every token fed that plain decoding would have fed: all the generated
        # ones, but for the last when generation ends there (a rejected draft's replacement, or
        # the next token, is fed by the next pass)
        self.cache.truncate(self.base + len(self.generated) - (not going))
        if not going:
            return None
        if accepted == len(self.guess):      # every draft taken: the pass's last row gives one more
            token = self.sampler(rows[-1], self.history)
        return token


def stream_generate(model: Model, prompt_ids: Sequence[int], cache: LatentCache, sampler: Sampler,
                    max_new_tokens: int, stop: Sequence[str] = (),
                    eos_ids: Sequence[int] | None = None,
                    context: Sequence[int] = (), draft: int = 0,
                    drafts: DraftSource | None = None,
                    finished: Callable[[], bool] | None = None,
                    progress: Callable[[int, int], None] | None = None, special: bool = False) -> Iterator[Chunk]:
    """One Generation (see there) run alone, as a generator of its chunks. The prompt is one
    step; the model reads a long one in passes of its memory chunk, telling `progress(done, total)`."""
    gen = Generation(model, prompt_ids, cache, sampler, max_new_tokens, stop, eos_ids, context,
                     draft, drafts, finished=finished, special=special)
    while not gen.done:
        step = gen.step()
        if gen.pending and progress is not None:      # the prompt, read in passes of the memory chunk
            yield from gen.take(model.forward_batch([step], progress=progress)[0])
        else:
            yield from gen.take(model.forward_batch([step])[0])
