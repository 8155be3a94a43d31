"""The serving engine: one model, its prompt cache, and the line of requests waiting for it.

Batch 1 today: requests take turns in arrival order, and each runs its generation on its own
(handler) thread when its turn comes. What the HTTP layer calls is the whole interface:

    with engine.admit(job, gone) as chunks:    # waits for a turn; Refused, ClientGone
        for chunk in chunks: ...               # the last chunk has finish_reason
    engine.close()                             # refuse new requests, send waiting ones away
    engine.abort()                             # end running generations at their next token
    engine.wait_idle()

A continuous-batching scheduler can keep it: admit() then waits for a slot in the batch, and
the chunks come from the scheduler's thread instead of this one.

No HTTP here (serve.py does that) and no request parsing (api.py).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Callable, Iterator

import numpy as np

from ds2cli.api import ABORTED, Job
from ds2cli.generate import Chunk, lstrip_reply, stream_generate
from ds2cli.model import Model
from ds2cli.prompt_cache import PromptCache
from ds2cli.sampling import make_sampler


class ClientGone(Exception):
    """The request's client hung up: stop generating, write nothing more."""


class Refused(Exception):
    """No turn for this request (the queue is full, or the engine is closing); `code` says which."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class _Aborted(Exception):
    """Raised by the sampler when abort() was called: the generation ends before its next token."""


class Engine:
    """The model and its prompt cache, used by one request at a time, in arrival order."""

    def __init__(self, model: Model, ctx: int, cache_budget_bytes: int, max_queue: int):
        self.model, self.ctx, self.max_queue = model, ctx, max_queue
        cache_bytes = model.new_cache(1).bytes_per_token * ctx
        self.prompt_cache = PromptCache(lambda: model.new_cache(ctx), cache_bytes, cache_budget_bytes)
        self.line: collections.deque = collections.deque()   # line[0] runs, the rest wait
        self.cond = threading.Condition()
        self.closing = False
        self.aborting = threading.Event()

    # ---- the interface ----
    @contextlib.contextmanager
    def admit(self, job: Job, gone: Callable[[], bool]) -> Iterator[Iterator[Chunk]]:
        """Wait for `job`'s turn (`gone()` says whether its client left meanwhile), then give
        its chunks; leaving the block ends the generation and frees the turn."""
        with self.turn(gone), contextlib.closing(self.generate(job)) as chunks:
            yield chunks

    def check_open(self) -> None:
        if self.closing:
            raise Refused("the server is shutting down", code="shutting_down")

    def close(self) -> None:
        """Refuse new requests and send the waiting ones away; the running one goes on."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()

    def abort(self) -> None:
        """End the running generation at its next token, with finish_reason ABORTED."""
        self.close()
        self.aborting.set()

    def wait_idle(self) -> None:
        with self.cond:
            while self.line:
                self.cond.wait(0.2)

    def running(self) -> int:
        return min(1, len(self.line))

    def waiting(self) -> int:
        return max(0, len(self.line) - 1)

    # ---- the pieces ----
    @contextlib.contextmanager
    def turn(self, gone: Callable[[], bool]):
        """Wait for this request's turn (Refused when the queue is full or the engine is closing)."""
        ticket = object()
        with self.cond:
            self.check_open()
            if len(self.line) > self.max_queue:
                raise Refused(f"the server is busy: {len(self.line) - 1} requests are already waiting "
                              f"(queue limit {self.max_queue}); retry later", code="queue_full")
            self.line.append(ticket)
            try:
                while self.line[0] is not ticket:
                    self.cond.wait(0.25)
                    self.check_open()
                    if gone():
                        raise ClientGone()
            except BaseException:
                self.line.remove(ticket)
                self.cond.notify_all()
                raise
        try:
            yield
        finally:
            with self.cond:
                self.line.popleft()
                self.cond.notify_all()

    def generate(self, job: Job) -> Iterator[Chunk]:
        """Chunks for `job` (call within turn()), starting from the longest cached prefix, which
        it records in job.cached. After abort() the last chunk says ABORTED. Closed early (a
        client gone), the cache still returns to the pool, holding the prompt and the reply so far."""
        cache, job.cached = self.prompt_cache.take(job.ids)
        keep = job.cached
        sampled: list[int] = []             # every token sampled, however the generation ends
        first_sample_t = None               # when the prefill ended
        constraint = job.constraint()      # grammar hook: None, or this sequence's grammar state
        sample = make_sampler(job.params, constraint)

        def sampler(logits, history) -> int:
            nonlocal first_sample_t
            if self.aborting.is_set():
                raise _Aborted()
            first_sample_t = first_sample_t or time.perf_counter()
            sampled.append(sample(logits, history))
            return sampled[-1]

        t0 = time.perf_counter()
        chunks = stream_generate(self.model, job.ids[keep:], cache, sampler, job.max_tokens, job.stop,
                                 context=job.ids[:keep],
                                 finished=(lambda: constraint.done) if constraint else None)
        try:
            with np.errstate(all="ignore"):  # non-finite logits are reported as GenerationError
                try:
                    yield from (lstrip_reply(chunks) if job.chat else chunks)
                except _Aborted:
                    t1 = first_sample_t or time.perf_counter()
                    yield Chunk("", None, ABORTED, len(job.ids) - keep, len(sampled), t1 - t0,
                                time.perf_counter() - t1, list(sampled))
        finally:
            chunks.close()
            self.prompt_cache.put(job.ids + sampled, cache)
