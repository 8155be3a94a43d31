"""What each endpoint of `ds2 serve` does, one method an endpoint: the chat page and its icon,
/health, /metrics, the models, the tokenizer's endpoints, and chat and text completions (parsed
by jobs.py, run by the scheduler, shaped by responses.py, written whole or as events). A mixin of
the handler (http_server.Handler), whose routing calls these."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from ds2cli.errors import Ds2Error, UnavailableError
from ds2cli.server.jobs import parse_jobs
from ds2cli.server.request_fields import ApiError
from ds2cli.server.http_io import Read
from ds2cli.server.infill import InfillResponse, infill_job
from ds2cli.server.metrics import CONTENT_TYPE as METRICS_TYPE
from ds2cli.server.responses import Response
from ds2cli.server.tokenizer_endpoints import detokenize_request, tokenize_request, tokenizer_info

CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"


def png(size: int, rgba: tuple[int, int, int, int]) -> bytes:
    """A square PNG of one colour with a lighter border: the favicon, made without a file."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    light = bytes(min(255, c + 80) if i < 3 else c for i, c in enumerate(rgba))
    rows = b"".join(b"\0" + b"".join(light if x in (0, size - 1) or y in (0, size - 1) else bytes(rgba)
                                     for x in range(size)) for y in range(size))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 6, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


FAVICON = png(16, (40, 90, 200, 255))


class Endpoints:
    """The endpoints (a mixin of the handler)."""

    def page(self) -> None:
        """The chat page: one static file in the package."""
        self.send_body(200, CHAT_PAGE.read_bytes(), "text/html; charset=utf-8")

    def favicon(self) -> None:
        """The icon browsers ask for with every page: a small PNG drawn at import (no file, no 404)."""
        self.extra_headers["Cache-Control"] = "max-age=86400"
        self.send_body(200, FAVICON, "image/png")

    def metrics(self) -> None:
        scheduler = self.server.state.scheduler
        healed = getattr(getattr(scheduler.model.executor, "passes", None), "healed", None)   # over --ray
        text = self.server.state.metrics.render(scheduler.running(), scheduler.waiting(),
                                                len(scheduler.prompt_cache.entries), healed)
        self.send_body(200, text.encode(), METRICS_TYPE)

    def tokenize(self) -> None:
        state = self.server.state
        self.send_json(200, tokenize_request(self.read_json(), state.scheduler.model.tokenizer, state.defaults))

    def detokenize(self) -> None:
        model = self.server.state.scheduler.model
        self.send_json(200, detokenize_request(self.read_json(), model.tokenizer, model.config.vocab_size))

    def tokenizer_info(self) -> None:
        model = self.server.state.scheduler.model
        self.send_json(200, tokenizer_info(model.tokenizer, model.path, self.server.state.defaults.ctx))

    def health(self) -> None:
        """The probe: 200 while serving, 503 while stopping; `requests_running` and
        `requests_waiting` are the counts docs/server.md names (one pair, no aliases)."""
        scheduler = self.server.state.scheduler
        if scheduler is None:
            self.extra_headers["Retry-After"] = "1"
            self.send_json(503, {"status": "loading", "model": self.server.state.model_id,
                                 "requests_running": 0, "requests_waiting": 0})
            return
        lost = scheduler.model.executor.health()       # a cluster that lost a node: degraded
        status = 503 if scheduler.closing or lost else 200
        running, waiting = scheduler.running(), scheduler.waiting()
        self.send_json(status, {"status": "shutting down" if scheduler.closing else "degraded" if lost else "ok",
                                **({"error": lost} if lost else {}),
                                "model": self.server.state.model_id,
                                "requests_running": running, "requests_waiting": waiting,
                                "slots": scheduler.parallel, "queue": scheduler.max_queue})

    def models(self) -> None:
        self.send_json(200, {"object": "list", "data": [self.model_object()]})

    def model_info(self, model_id: str) -> None:
        if model_id != self.server.state.model_id:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server runs "
                                f"{self.server.state.model_id!r}", param="model", code="model_not_found")
        self.send_json(200, self.model_object())

    def model_object(self) -> dict:
        state = self.server.state
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "ds2"}

    def chat(self) -> None:
        self.complete(chat=True)

    def completions(self) -> None:
        self.complete(chat=False)

    def infill(self) -> None:
        """llama-server's /infill: a fill in the middle, answered in llama-server's shape."""
        self.complete(chat=False, infill=True)

    def complete(self, chat: bool, infill: bool = False) -> None:
        state = self.server.state
        scheduler, model = state.scheduler, state.scheduler.model
        scheduler.check_open()     # while stopping, 503 before the body is read
        body = Read(self.read_json())
        if infill:
            jobs = [infill_job(body, model.tokenizer, model.config.vocab_size, state.defaults, state.model_id)]
        else:
            jobs = parse_jobs(body, chat, model.tokenizer, model.config.vocab_size, state.defaults, state.model_id)
        ignored = body.ignored()
        if ignored:     # accepted, as OpenAI's and llama-server's servers do, but said: never silently
            self.extra_headers["X-Ds2-Ignored-Fields"] = ",".join(ignored)[:200]
            state.log(f"{self.client_address[0]} ignored request fields: {', '.join(ignored)[:200]}")
        most = scheduler.max_queue + scheduler.parallel
        if len(jobs) > most:     # never admissible, however long the client waits: not a 503
            n = 1 + max(j.sample for j in jobs)
            asked = f"n = {n} is" if n == len(jobs) else f"{len(jobs) // n} prompts x n = {n} is {len(jobs)} choices,"
            raise ApiError(400, f"{asked} more than this server can ever hold "
                                f"at once ({scheduler.parallel} running + {scheduler.max_queue} waiting: "
                                f"--parallel and --queue)", param="n")
        prompt = sum(len(j.ids) for j in jobs if j.sample == 0)
        self.note = f"prompt {prompt} tok" + (f", {len(jobs)} choices" if len(jobs) > 1 else "")
        response = (InfillResponse(jobs[0], state.model_id, model.tokenizer) if infill
                    else Response(jobs, state.model_id, model.tokenizer))
        with scheduler.admit(jobs, self.client_gone) as admitted:
            response.outcomes = admitted.outcomes
            lasts = (self.stream if jobs[0].stream else self.collect)(response, admitted.chunks)
        found = {j.index: admitted.outcomes[j.index].cached if j.sample == 0 else 0 for j in jobs}
        for job in jobs:
            state.metrics.generation(len(job.ids) if job.sample == 0 else 0, found[job.index], lasts[job.index])
        cached = sum(found.values())
        generated = sum(last.generated_tokens for last in lasts.values())
        rate = max(last.decode_tok_per_s for last in lasts.values())
        reasons = sorted({last.finish_reason for last in lasts.values()})
        self.note = (f"prompt {prompt} tok, {cached} cached | gen {generated} tok, {rate:.1f} tok/s"
                     f"{' (best choice)' if len(lasts) > 1 else ''} | {'/'.join(reasons)}")

    def collect(self, response: Response, chunks) -> dict:
        pieces: dict = {i: [] for i in response.jobs}
        entries: dict = {i: [] for i in response.jobs}
        lasts: dict = {}
        for index, chunk in chunks:
            pieces[index].append(chunk.text)
            entries[index] += chunk.logprobs or []
            if chunk.finish_reason is not None:
                lasts[index] = chunk
            self.tokens += 1
            self.check_alive()
        self.send_json(200, response.whole({i: "".join(p) for i, p in pieces.items()}, lasts, entries))
        return lasts

    def stream(self, response: Response | InfillResponse, chunks) -> dict:
        self.start_events()
        if response.job.chat:
            for index in response.jobs:
                self.send_event(response.chunk("", role=True, index=index))
        lasts: dict = {}
        try:
            started: set = set()
            for index, chunk in chunks:
                if response.jobs[index].echo and index not in started:   # scored once its prompt ran
                    self.send_event(response.echo_chunk(index))
                started.add(index)
                # held back where it may be a marker of reasoning or a tool call
                piece = response.piece_chunk(*response.pieces(chunk.text, index), index=index, entries=chunk.logprobs)
                if piece is not None:
                    self.send_event(piece)
                if chunk.finish_reason is not None:
                    lasts[index] = chunk
                    for obj in response.finish_chunks(chunk, index):
                        self.send_event(obj)
                self.tokens += 1
                self.check_alive()
        except Ds2Error as e:  # the status is sent: the error travels as an event, then the stream ends
            error = ApiError(503, str(e), code="unavailable") if isinstance(e, UnavailableError) else ApiError(500, str(e))
            self.send_event(error.body())
            self.end_events(response.done_event)
            raise error from None
        for obj in response.usage_chunk(lasts):
            self.send_event(obj)
        self.end_events(response.done_event)
        return lasts
