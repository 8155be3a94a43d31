"""The server's scheduler: one model, its prompt cache, and a thread that runs up to `parallel`
requests in each forward pass (continuous batching).

What the HTTP layer calls is the whole interface:

    with scheduler.admit(jobs, gone) as admitted:     # waits for a slot; Refused, ClientGone
        for index, chunk in admitted.chunks: ...       # each choice's last chunk has finish_reason
        admitted.outcomes[index]                       # what the scheduler found: cached tokens, echo's logprobs
    scheduler.close()                             # refuse new requests, send waiting ones away
    scheduler.abort()                             # end running generations at their next token
    scheduler.wait_idle()

The scheduler's thread owns the model. Each pass, every running request whose prompt is done
adds its next token (or its token and drafts), and one request still reading its prompt adds a
chunk of it (at most `prefill_chunk` tokens while any other request runs, `alone_chunk` when
none does, so that no stream or newcomer waits longer than one chunk and one step): the prompt
with the fewest tokens left, and every fourth chunk the one waiting longest. When every slot but
one holds a prompt longer than a chunk, the last slot is kept for a prompt of one chunk.
A request's chunks go to its own queue (shared by the choices of one HTTP request: n samples,
a list of prompts), which its handler thread drains onto its connection; a request whose queue
is full (a client reading slowly) sits out passes until it drains. The n samples of one prompt
share its prefill: the later ones wait until the first has read the prompt, then copy its latents. A request
leaves the batch at once when it ends, fails, or its client leaves.

Over a cluster spread by layers (the model's executor says pipeline_depth() > 1) the running
requests go in as many micro-batches as there are stages, and a micro-batch's next pass is sent
as soon as its last one's tokens are taken, while the others' are still on their stages: each
stage works on a different micro-batch at once (model.start_batch). A request is in one pass
at a time; one cancelled meanwhile leaves once its pass is back.

No HTTP here (http_server.py and endpoints.py do that) and no request parsing (jobs.py).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import threading
from typing import Callable, Iterator

import numpy as np

from ds2cli.server.jobs import ABORTED, Job
from ds2cli.generation.generate import Chunk, Generation, ReplyStart
from ds2cli.generation.logprobs import PROMPT_CHUNK, ObservedSampler, TokenLogprobs, entry
from ds2cli.model.transformer import Model
from ds2cli.model.cache import common_prefix
from ds2cli.server.prompt_cache import PromptCache, copy_prefix
from ds2cli.generation.sampling import make_sampler

DEFAULT_PARALLEL = 4
DEFAULT_PREFILL_CHUNK = 128
ALONE_CHUNK = 512          # a prompt's chunk when no other request runs (chunk)
STARVE_EVERY = 4           # every 4th prompt chunk goes to the prompt waiting longest (plan)
BACKLOG = 256              # chunks a request may have waiting for its client before it sits out


class ClientGone(Exception):
    """The request's client hung up: stop generating, write nothing more."""


class Refused(Exception):
    """No turn for this request (the queue is full, or the scheduler is closing); `code` says which."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Outcome:
    """What the scheduler found for one choice beside its chunks: the prompt tokens it took from
    the prompt cache (or a running request), and under echo an entry per prompt token (None first)."""
    cached: int = 0
    prompt_logprobs: list | None = None


@dataclasses.dataclass
class Admitted:
    """An admitted HTTP request's choices: their (index, chunk) pairs as they come, and each
    choice's Outcome by index (complete once its first chunk has come)."""
    chunks: Iterator[tuple[int, Chunk]]
    outcomes: dict[int, Outcome]


class Request:
    """One job in the scheduler: waiting for a slot, then running as a Generation over its cache."""

    def __init__(self, job: Job, out: queue.Queue, after: Request | None = None):
        self.job, self.out, self.after = job, out, after
        self.outcome = Outcome()
        self.gen: Generation | None = None          # set when it gets a slot
        self.logprobs: TokenLogprobs | None = None  # the generated tokens' entries, when asked for
        self.read = None                            # prompt_disk.Prefix its thread read from disk, or None
        self.cancelled = False                      # its client left, or its handler ended
        self.running = False
        self.chunk_at = -1                          # when a chunk of its prompt last ran (plan)

    def backlog(self) -> int:
        return self.out.qsize()


class Scheduler:
    """The model and its prompt cache, shared by up to `parallel` requests in each pass."""

    def __init__(self, model: Model, ctx: int, cache_budget_bytes: int, max_queue: int,
                 parallel: int = 1, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, draft: int = 0, disk=None,
                 alone_chunk: int = ALONE_CHUNK):
        self.model, self.ctx, self.max_queue = model, ctx, max_queue
        self.parallel, self.prefill_chunk, self.draft = parallel, prefill_chunk, draft
        self.alone_chunk = max(prefill_chunk, alone_chunk)
        cache_bytes = model.new_cache(1).bytes_per_token * ctx
        self.prompt_cache = PromptCache(lambda: model.new_cache(ctx), cache_bytes,
                                        max(cache_budget_bytes, parallel * cache_bytes), disk)
        self.waiting_line: collections.deque[Request] = collections.deque()
        self.batch: list[Request] = []
        self.cond = threading.Condition()
        self.closing = False
        self.aborting = threading.Event()
        self.steps = 0                              # passes run (the tests count them)
        # passes under way at once: more than one over a cluster's stages (model.start_batch)
        self.depth = max(1, model.executor.pipeline_depth())
        self.flying: list[tuple[list[Request], Callable]] = []    # (its requests, wait for its logits)
        self.most_flying = 0                        # the most passes under way at once (the tests look)
        self.chunks_run = 0                         # prompt chunks planned (which prompt: plan)
        self.thread = threading.Thread(target=self.run, name="ds2-scheduler", daemon=True)
        self.thread.start()

    # ---- the interface ----
    @contextlib.contextmanager
    def admit(self, jobs: list[Job], gone: Callable[[], bool]) -> Iterator[Admitted]:
        """Queue `jobs` (one HTTP request's choices) and wait until the first has a slot
        (`gone()` says whether the client left meanwhile), then give their (index, chunk) pairs
        and outcomes; leaving the block ends every generation still running and frees the slots."""
        requests = self.enter(jobs, gone)
        try:
            yield Admitted(self.chunks(requests, gone), {r.job.index: r.outcome for r in requests})
        finally:
            with self.cond:
                self.cancel(requests)

    def cancel(self, requests: list[Request]) -> None:
        """End `requests` (their client left, or their handler ended): out of the waiting line
        now, out of the batch at the next pass. Called holding `cond`."""
        for request in requests:
            request.cancelled = True
            if request in self.waiting_line:
                self.waiting_line.remove(request)
        self.cond.notify_all()

    def check_open(self) -> None:
        if self.closing:
            raise Refused("the server is shutting down", code="shutting_down")

    def close(self) -> None:
        """Refuse new requests and send the waiting ones away; the running ones go on."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()

    def abort(self) -> None:
        """End the running generations at their next token, with finish_reason ABORTED."""
        self.close()
        self.aborting.set()
        with self.cond:
            self.cond.notify_all()

    def wait_idle(self) -> None:
        with self.cond:
            while self.batch or self.waiting_line:
                self.cond.wait(0.2)

    def running(self) -> int:
        return len(self.batch)

    def waiting(self) -> int:
        return len(self.waiting_line)

    # ---- the handler's side ----
    def enter(self, jobs: list[Job], gone: Callable[[], bool]) -> list[Request]:
        """Queue `jobs` and wait until the scheduler gives the first a slot."""
        out: queue.Queue = queue.Queue()
        requests, first = [], {}
        for job in jobs:         # a prompt's later samples wait for its first to read it
            key = tuple(job.ids)
            requests.append(Request(job, out, after=first.get(key)))
            first.setdefault(key, requests[-1])
        with self.cond:
            self.check_room(len(requests))           # before a file is read for a request turned away
        self.read_from_disk(requests)
        with self.cond:
            self.check_room(len(requests))
            self.waiting_line.extend(requests)
            self.cond.notify_all()
            try:
                while not requests[0].running:
                    self.cond.wait(0.25)
                    if requests[0].running:
                        break
                    self.check_open()
                    if gone():
                        raise ClientGone()
            except BaseException:
                self.cancel(requests)
                raise
        return requests

    def check_room(self, count: int) -> None:
        """Refused unless the scheduler is open and its queue can take `count` more. Called holding `cond`."""
        self.check_open()
        free = max(0, self.parallel - len(self.batch))
        if len(self.waiting_line) + count > self.max_queue + free:
            raise Refused(f"the server is busy: {len(self.waiting_line)} requests are already waiting "
                          f"(queue limit {self.max_queue}); retry later", code="queue_full")

    def read_from_disk(self, requests: list[Request]) -> None:
        """On the request's thread, so that no pass waits for a file: each prompt's longest
        prefix in --prompt-cache-dir, when it is longer than what the pool in memory holds."""
        disk = self.prompt_cache.disk
        if disk is None:
            return
        for request in requests:
            job = request.job
            if request.after is not None or (job.echo and job.logprobs is not None):
                continue            # a later sample copies the first's prompt; echo reuses nothing
            with self.cond:
                in_memory = self.prompt_cache.longest(job.ids)[1]
            request.read = disk.read(job.ids, in_memory)

    def chunks(self, requests: list[Request], gone: Callable[[], bool]) -> Iterator[tuple[int, Chunk]]:
        """The requests' (index, chunk) pairs as the scheduler makes them, until each has given
        its last. A chat reply's leading whitespace is dropped (templates end at "Assistant:")."""
        out = requests[0].out
        unfinished = {r.job.index for r in requests}
        job = requests[0].job
        starts = {i: ReplyStart() for i in unfinished} if job.chat and not job.continue_final else None
        while unfinished:
            try:
                index, item = out.get(timeout=0.25)
            except queue.Empty:
                if gone():
                    raise ClientGone() from None
                continue
            if isinstance(item, BaseException):
                raise item
            yield index, starts[index](item) if starts else item
            if item.finish_reason is not None:
                unfinished.discard(index)

    # ---- the scheduler's side ----
    def run(self) -> None:
        """The scheduler: admit, run one pass, deliver; forever (a daemon thread). Pipelined
        (depth > 1): send a micro-batch's pass while fewer than `depth` are under way, else
        take the oldest's tokens."""
        while True:
            try:
                with self.cond:
                    if self.closing and not self.batch and not self.waiting_line and not self.flying:
                        return                      # closed and idle: nothing can come any more
                    self.admit_waiting()
                    self.drop_cancelled()
                    if self.aborting.is_set():
                        for request in [r for r in self.batch if not self.in_flight(r)]:
                            self.deliver(request, request.gen.finish([], ABORTED))
                    plan = self.plan()
                    if not plan and not self.flying:
                        self.cond.wait(0.25 if not self.batch else 0.01)
                        continue
                if self.depth == 1:
                    self.run_pass(plan)
                elif plan and len(self.flying) < self.depth:
                    self.start_pass(plan)
                else:
                    self.finish_pass(*self.flying.pop(0))
            except Exception as e:  # a bug of the scheduler's own: no request may wait forever on it
                with self.cond:
                    self.flying.clear()
                    for request in list(self.batch):
                        self.fail(request, e)

    def in_flight(self, request: Request) -> bool:
        return any(request in plan for plan, _ in self.flying)

    def admit_waiting(self) -> None:
        """Give free slots to waiting requests, first come first served (closing: send them away)."""
        if self.closing:
            # a request not yet started gets its 503 (enter sees `closing`); the later choices
            # of a started one end with nothing generated
            for request in self.waiting_line:
                request.cancelled = True
                request.out.put((request.job.index, Chunk("", None, ABORTED, len(request.job.ids))))
            self.waiting_line.clear()
            self.cond.notify_all()
        for request in list(self.waiting_line):
            if len(self.batch) >= self.parallel:
                break
            if request.cancelled:
                self.waiting_line.remove(request)
                continue
            if self.is_long(request) and self.parallel > 1 and \
                    sum(self.is_long(r) and bool(r.gen.pending) for r in self.batch) >= self.parallel - 1:
                continue                        # the last slot is kept for a prompt of one chunk
            if request.after is not None and request.after.running and request.after.gen is not None \
                    and request.after.gen.pending and not request.after.cancelled:
                continue                        # its prompt's first sample is still reading it
            self.waiting_line.remove(request)
            request.running = True          # from here its handler reads its queue
            self.cond.notify_all()
            self.start(request)

    def start(self, request: Request) -> None:
        """`request` into the batch, its Generation over a cache from the pool (its error to its
        handler when it cannot start). Called holding `cond`."""
        job, cache = request.job, None
        try:
            # echo: the prompt's logprobs need every position's logits, so it reuses no
            # cached prefix (and takes none from the pool: it is kept when the job ends)
            scored = job.echo and job.logprobs is not None
            outcome = request.outcome
            cache, outcome.cached = self.prompt_cache.take(job.ids[:1] if scored else job.ids, request.read)
            request.read = None             # in the cache now: its arrays are let go
            if scored:
                outcome.prompt_logprobs = [None]
            else:
                self.share_prefix(request, cache)
            keep = outcome.cached
            constraint = job.constraint()      # grammar hook: None, or this sequence's grammar state
            sampler = make_sampler(job.params, constraint)
            if job.logprobs is not None:
                request.logprobs = TokenLogprobs(job.logprobs, keep_eos=job.echo)
                sampler = ObservedSampler(sampler, request.logprobs)
            request.gen = Generation(self.model, job.ids[keep:], cache, sampler, job.max_tokens, job.stop,
                                     eos_ids=self.eos_ids(job), context=job.ids[:keep],
                                     draft=job.draft if job.draft is not None else self.draft,
                                     prompt_rows=self.prompt_rows(request) if scored else None,
                                     prompt_rows_chunk=PROMPT_CHUNK,
                                     finished=(lambda c=constraint: c.done) if constraint else None)
        except Exception as e:
            request.out.put((job.index, e))
            if cache is not None:
                self.prompt_cache.put([], cache)
            return
        self.batch.append(request)

    def eos_ids(self, job: Job) -> tuple[int, ...] | None:
        """What ends the job's reply: the model's eos (None), nothing (ignore_eos), or eos and
        the job's own end tokens (a fill's FIM tokens)."""
        if job.ignore_eos:
            return ()
        return (*self.model.eos_token_ids, *job.end_ids) if job.end_ids else None

    def is_long(self, request: Request) -> bool:
        """A prompt of more than one chunk (what the last free slot is not given to)."""
        return len(request.job.ids) > self.prefill_chunk

    @staticmethod
    def prompt_rows(request: Request):
        """Where an echo job's prompt rows go: each reduced to its entry as its pass ends."""
        def take(rows, tokens):
            request.outcome.prompt_logprobs += [entry(row, t, request.job.logprobs) for row, t in zip(rows, tokens)]
        return take

    def share_prefix(self, request: Request, cache) -> None:
        """A running request whose prompt is in its cache may share more of this prompt than the
        prompt cache had (n samples of one prompt, one system prompt for many users): copy it."""
        for other in self.batch:
            if other.gen.pending:
                continue
            job = request.job
            n = min(common_prefix(np.asarray(other.job.ids), np.asarray(job.ids)), len(job.ids) - 1)
            if n > request.outcome.cached:
                copy_prefix(other.gen.cache, cache, n)
                request.outcome.cached = n

    def drop_cancelled(self) -> None:
        for request in [r for r in self.batch if r.cancelled and not self.in_flight(r)]:
            self.leave(request)

    def plan(self) -> list[Request]:
        """The requests of the next pass: every decoding one whose client keeps up, and one
        chunk of one prompt: the prompt with the fewest tokens left (a short chat's first token
        comes after at most one chunk of any long prompt), except every STARVE_EVERY-th chunk,
        which goes to the prompt that has waited longest (a stream of short prompts never
        starves a long one)."""
        ready = [r for r in self.batch if not self.in_flight(r)] if self.flying else self.batch
        decoding = [r for r in ready if not r.gen.pending and r.backlog() < BACKLOG]
        prefilling = [r for r in ready if r.gen.pending]
        if self.depth > 1:          # a micro-batch: the running requests shared among the stages
            decoding = decoding[:-(-len(self.batch) // self.depth)]
        if not prefilling:
            return decoding
        self.chunks_run += 1
        if self.chunks_run % STARVE_EVERY == 0:
            chosen = min(prefilling, key=lambda r: r.chunk_at)
        else:
            chosen = min(prefilling, key=lambda r: (len(r.gen.pending), r.chunk_at))
        chosen.chunk_at = self.chunks_run
        return decoding + [chosen]

    def chunk(self) -> int:
        """The one rule for how many prompt tokens the chosen prompt reads in the next pass, on
        every path (run_pass, start_pass): `prefill_chunk` while any other request is in the
        batch, `alone_chunk` when none is. Counted over the batch, not over the pass: a request
        that sits out this pass (a second prompt waiting its turn, a client reading slowly, a
        micro-batch still on the stages) wants the pass after it, so a short request beside a
        long prompt waits one short chunk, never a long one. A prompt read alone keeps its
        single-pass speed (docs/performance.md), and a newcomer still waits one chunk only."""
        return self.prefill_chunk if len(self.batch) > 1 else self.alone_chunk

    def run_pass(self, plan: list[Request]) -> None:
        """One pass sent, waited for and its tokens delivered (depth 1)."""
        wait = self.send(plan)
        if wait is not None:
            self.finish_pass(plan, wait)

    def start_pass(self, plan: list[Request]) -> None:
        """A micro-batch's pass sent, not waited for (pipelined): finish_pass takes its tokens."""
        wait = self.send(plan)
        if wait is not None:
            self.flying.append((plan, wait))
            self.most_flying = max(self.most_flying, len(self.flying))

    def send(self, plan: list[Request]) -> Callable | None:
        """The pass of `plan` begun on the model (model.start_batch: run at once unless the
        executor pipelines it); the call that waits for its logits, or None if it failed."""
        chunk = self.chunk()
        steps = [r.gen.step(chunk if r.gen.pending else None) for r in plan]
        return self.guarded(plan, lambda: self.model.start_batch(steps))

    def finish_pass(self, plan: list[Request], wait: Callable) -> None:
        """A pass under way waited for, and its tokens delivered."""
        logits = self.guarded(plan, wait)
        if logits is not None:
            self.take(plan, logits)

    def guarded(self, plan: list[Request], call: Callable):
        """call()'s result, or None when it raised: nothing of this pass can be trusted, so each
        request of `plan` gets the error."""
        try:
            with np.errstate(all="ignore"):  # non-finite logits are reported as GenerationError
                return call()
        except Exception as e:
            with self.cond:
                for r in plan:
                    self.fail(r, e)
            return None

    def take(self, plan: list[Request], logits: list) -> None:
        self.steps += 1
        with self.cond:
            for r, rows in zip(plan, logits):
                if r.cancelled:
                    continue
                try:
                    with np.errstate(all="ignore"):
                        self.deliver(r, r.gen.take(rows))
                except Exception as e:
                    self.fail(r, e)

    def deliver(self, request: Request, chunks: list[Chunk]) -> None:
        if request.logprobs is not None:     # each token's entry rides the chunk of its pass
            chunks = list(request.logprobs.attach(chunks))
        for chunk in chunks:
            request.out.put((request.job.index, chunk))
        if request.gen.done:
            self.leave(request)

    def fail(self, request: Request, error: Exception) -> None:
        request.out.put((request.job.index, error))
        request.gen.cache.reset()           # what the failed pass wrote is not kept
        self.leave(request, keep=False)

    def leave(self, request: Request, keep: bool = True) -> None:
        """Take `request` out of the batch; its cache returns to the pool holding its prompt and
        the reply so far."""
        if request in self.batch:
            self.batch.remove(request)
            gen = request.gen
            self.prompt_cache.put(request.job.ids + gen.generated if keep else [], gen.cache)
            self.cond.notify_all()
