"""The HTTP layer of `ds2 serve`, on the standard library's ThreadingHTTPServer: routing, keys,
bodies, CORS, server-sent events, one log line per request. Each request runs on its own handler
thread, which parses it (api.py), hands its choices to the scheduler (scheduler.py) and writes their
chunks as they come (responses.py shapes them). serve.py has the command and its graceful stop.

Why http.server rather than an ASGI stack: the scheduler's one thread runs every pass, so
the connections need only blocking threads, not an event loop; and ds2 gains no dependency.
"""

from __future__ import annotations

import hmac
import re
import struct
import zlib
import json
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ds2cli import __version__
from ds2cli.server.api import ApiError, Defaults, parse_jobs
from ds2cli.json_files import JSON_ERRORS, json_error
from ds2cli.server.scheduler import ClientGone, Scheduler, Refused
from ds2cli.errors import Ds2Error, UnavailableError
from ds2cli.generation.grammar import GrammarError
from ds2cli.server.metrics import CONTENT_TYPE as METRICS_TYPE
from ds2cli.server.metrics import Metrics
from ds2cli.server.responses import Response
from ds2cli.server.tokenizer_endpoints import detokenize_request, tokenize_request, tokenizer_info

MAX_BODY_BYTES = 4 * 1024 * 1024    # a request body beyond this gets 413 (a 160k-token prompt fits)
IDLE_TIMEOUT_S = 120                # a connection that sends nothing for this long is closed
LINGER_S = 1.0                      # after a 413, how long to swallow the unread body before closing
CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"
CORS_MAX_AGE_S = 600                # how long a browser may reuse a preflight's answer
# RFC 9110's token: what a header name may hold; a preflight's list is echoed only if made of them
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
MAX_ASKED_HEADERS = 64
OPEN_PATHS = ("/health", "/", "/favicon.ico")       # no API key needed: the probe, and the chat page (which asks for the key)
ENDPOINTS = ("/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
             "/tokenize", "/detokenize", "/tokenizer_info")   # the /metrics labels; other paths count as "other"


class State:
    """What every handler thread shares: the scheduler and the server's settings. `scheduler`
    (and `defaults`) are None while the model loads: the port is bound first, so a taken port is
    known at once, and /health answers 503 "loading" meanwhile."""

    def __init__(self, scheduler: Scheduler | None, model_id: str, defaults: Defaults | None, api_key: str | None,
                 sink=None, cors_origins: tuple[str, ...] = ()):
        self.scheduler, self.model_id, self.defaults, self.api_key = scheduler, model_id, defaults, api_key
        self.sink = sink                    # where log lines go (tests collect them); default stderr
        self.max_body = MAX_BODY_BYTES      # a request body beyond this gets 413 (--max-prompt-bytes)
        self.cors_origins = tuple(cors_origins)     # --cors-origin: the origins whose pages may call us ("*": any)
        self.metrics = Metrics()
        self.created = int(time.time())
        self.active = 0                     # requests being handled, for a graceful stop
        self.active_cond = threading.Condition()
        self.log_lock = threading.Lock()

    def wait_handlers(self) -> None:
        with self.active_cond:
            while self.active > 0:
                self.active_cond.wait(0.2)

    def log(self, line: str) -> None:
        # request paths and error messages come from clients: no control characters reach a terminal
        line = "".join(c if c.isprintable() else "?" for c in line)
        with self.log_lock:
            if self.sink is not None:
                self.sink(line)
                return
            sys.stderr.write(line + "\n")
            sys.stderr.flush()


class Server(ThreadingHTTPServer):
    daemon_threads = True   # idle keep-alive connections must not hold up the exit

    def __init__(self, address, state: State, holds: int | None = None):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.state = state
        # socketserver's backlog is 5: a burst of clients got TCP resets instead of a 503 with
        # Retry-After. Room for every request the scheduler can hold (`holds`: --queue +
        # --parallel), capped by the system's.
        if holds is None:
            holds = state.scheduler.max_queue + state.scheduler.parallel
        self.request_queue_size = min(max(128, holds), somaxconn())
        super().__init__(address, Handler)

    def handle_error(self, request, client_address):
        # socketserver would print a traceback; a server log gets one line, and a client that
        # resets an idle keep-alive connection (no request in flight) gets none
        e = sys.exc_info()[1]
        if isinstance(e, (ConnectionError, TimeoutError)):
            return
        self.state.log(f"{client_address[0]} connection error: {type(e).__name__}: {' '.join(str(e).split())}")


def encodable(text: str) -> bool:
    """UTF-8 can encode it: no lone surrogate (checked by the codec, at C speed: a 4 MiB body
    checked character by character in Python would hold its handler for a fraction of a second)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate(body) -> str | None:
    """Where (as a param path, `messages[0].content`) the first string holding a lone surrogate
    sits in a parsed JSON body, keys included; None when there is none. Iterative: a body is at
    most MAX_BODY_BYTES, and its nesting is what json.loads accepted."""
    stack = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not encodable(value):
                return path or "the body"
        elif isinstance(value, dict):
            for k, v in value.items():
                here = f"{path}.{k}" if path else k
                if not encodable(k):
                    return (path or "the body") + " (a key)"
                stack.append((here, v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


def somaxconn() -> int:
    """The kernel's cap on a listen backlog (Linux); listen() silently truncates to it."""
    try:
        return max(1, int(Path("/proc/sys/net/core/somaxconn").read_text()))
    except (OSError, ValueError):
        return socket.SOMAXCONN


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


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"ds2/{__version__}"
    timeout = IDLE_TIMEOUT_S
    disable_nagle_algorithm = True      # one small write per token: send each at once
    counted = True                      # outside dispatch (http.server's own errors): not counted

    server: Server

    # ---- routing ----
    def do_GET(self):
        self.dispatch("GET")

    def do_POST(self):
        self.dispatch("POST")

    def do_PUT(self):
        self.dispatch("PUT")

    def do_DELETE(self):
        self.dispatch("DELETE")

    def do_PATCH(self):
        self.dispatch("PATCH")

    def do_HEAD(self):
        self.dispatch("HEAD")

    def do_OPTIONS(self):
        self.dispatch("OPTIONS")

    def route(self, method: str, path: str):
        routes = {"/v1/models": ("GET", self.models), "/v1/chat/completions": ("POST", self.chat),
                  "/v1/completions": ("POST", self.completions), "/health": ("GET", self.health),
                  "/": ("GET", self.page), "/metrics": ("GET", self.metrics),
                  "/tokenize": ("POST", self.tokenize), "/detokenize": ("POST", self.detokenize),
                  "/tokenizer_info": ("GET", self.tokenizer_info), "/favicon.ico": ("GET", self.favicon)}
        if path in ("/models", "/chat/completions", "/completions"):
            path = "/v1" + path
        if path.startswith("/v1/models/"):
            routes[path] = ("GET", lambda: self.model_info(unquote(path[len("/v1/models/"):])))
        if path not in routes:
            raise ApiError(404, f"no such endpoint: {path}", code="not_found")
        allowed, handler = routes[path]
        if method != allowed and not (method == "HEAD" and allowed == "GET"):  # HEAD: GET's headers
            self.extra_headers["Allow"] = allowed
            raise ApiError(405, f"{path} takes {allowed}, not {method}", code="method_not_allowed")
        return path, handler

    def dispatch(self, method: str) -> None:
        state = self.server.state
        with state.active_cond:
            state.active += 1
        self.t0, self.status, self.note, self.tokens = time.perf_counter(), 0, "", 0
        self.extra_headers: dict = {}
        self.body_read = False
        self.linger = False
        path = self.metric_path = urlsplit(self.path).path
        self.counted = False
        try:
            if method == "OPTIONS" and self.cors_origin() is not None:    # a CORS preflight: no key asked
                self.preflight()
                return
            path, handler = self.route(method, path.rstrip("/") or "/")
            self.metric_path = path
            if path not in OPEN_PATHS:
                self.check_key()
            if state.scheduler is None and path not in OPEN_PATHS:
                raise ApiError(503, "the model is still loading; retry in a moment", code="loading")
            handler()
        except ApiError as e:
            self.fail(e)
        except Refused as e:    # the queue is full, or the server is stopping
            self.fail(ApiError(503, str(e), code=e.code))
        except GrammarError as e:  # the request's grammar failed while generating (a schema that loops)
            self.fail(ApiError(400, f"the constrained output cannot continue: {e}", param="response_format"))
        except UnavailableError as e:  # what the model runs on is gone (a cluster's node)
            self.fail(ApiError(503, str(e), code="unavailable"))
        except Ds2Error as e:  # the model failed mid-request (e.g. non-finite logits)
            self.fail(ApiError(500, str(e)))
        except (ClientGone, ConnectionError, TimeoutError):  # BrokenPipeError is a ConnectionError
            self.status, self.close_connection = self.status or 499, True
            self.note = f"client gone after {self.tokens} chunks"
        except Exception as e:  # never a traceback to the client or the log: one line each
            self.fail(ApiError(500, f"internal error: {type(e).__name__}: {' '.join(str(e).split())}"))
        finally:
            self.count_request()                # one that got no answer (a client gone: 499)
            self.log_line(method, path)
            if self.linger:
                self.swallow_body()
            with state.active_cond:
                state.active -= 1
                state.active_cond.notify_all()

    def count_request(self) -> None:
        """This request into the metrics, once, by its status: as its answer's last bytes go out,
        so that a client which reads the answer and then asks /metrics finds it counted (counted
        after the answer, it raced the next request on a busy machine), or at the end for one
        that got no answer."""
        if not self.counted:
            self.counted = True
            path = self.metric_path
            self.server.state.metrics.request(path if path in ENDPOINTS else "other", self.status)

    def check_key(self) -> None:
        key = self.server.state.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            self.extra_headers["WWW-Authenticate"] = "Bearer"
            raise ApiError(401, ("incorrect" if token else "missing") + " API key: send Authorization: Bearer KEY"
                           " with the key ds2 serve was given", code="invalid_api_key")

    # ---- CORS ----
    def cors_origin(self) -> str | None:
        """What Access-Control-Allow-Origin says to this request: its Origin when --cors-origin
        lists it, "*" when that lists "*"; None (no CORS headers) otherwise."""
        headers, allowed = getattr(self, "headers", None), self.server.state.cors_origins
        origin = headers.get("Origin") if headers is not None else None
        if origin is None or not allowed:
            return None
        return origin if origin in allowed else "*" if "*" in allowed else None

    def cors_headers(self) -> None:
        origin = self.cors_origin()
        if origin is not None:
            self.send_header("Access-Control-Allow-Origin", origin)
            if origin != "*":
                self.send_header("Vary", "Origin")

    def preflight(self) -> None:
        """An allowed origin may send the headers it asks for (the openai JS SDK sends its own
        X-Stainless-* headers, and browsers ask before sending them), if they are header names."""
        asked = self.headers.get("Access-Control-Request-Headers", "")
        names = [n.strip() for n in asked.split(",") if n.strip()]
        allowed = ["Authorization", "Content-Type"] + [n for n in names if HEADER_NAME.fullmatch(n)
                                                        and n.lower() not in ("authorization", "content-type")]
        self.status = 204
        self.send_response(204)
        self.cors_headers()
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", ", ".join(dict.fromkeys(allowed[:MAX_ASKED_HEADERS])))
        self.send_header("Access-Control-Max-Age", str(CORS_MAX_AGE_S))
        self.send_header("Content-Length", "0")
        self.count_request()
        self.end_headers()

    # ---- endpoints ----
    def page(self) -> None:
        """The chat page: one static file in the package."""
        self.send_body(200, CHAT_PAGE.read_bytes(), "text/html; charset=utf-8")

    def favicon(self) -> None:
        """The icon browsers ask for with every page: a small PNG drawn at import (no file, no 404)."""
        self.extra_headers["Cache-Control"] = "max-age=86400"
        self.send_body(200, FAVICON, "image/png")

    def metrics(self) -> None:
        scheduler = self.server.state.scheduler
        text = self.server.state.metrics.render(scheduler.running(), scheduler.waiting(), len(scheduler.prompt_cache.entries))
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
        """The probe: 200 while serving, 503 while stopping. `running` stays the boolean it
        always was; `requests_running` and `requests_waiting` are the counts."""
        scheduler = self.server.state.scheduler
        if scheduler is None:
            self.extra_headers["Retry-After"] = "1"
            self.send_json(503, {"status": "loading", "model": self.server.state.model_id, "running": False,
                                 "waiting": 0, "requests_running": 0, "requests_waiting": 0})
            return
        lost = scheduler.model.executor.health()       # a cluster that lost a node: degraded
        status = 503 if scheduler.closing or lost else 200
        running, waiting = scheduler.running(), scheduler.waiting()
        self.send_json(status, {"status": "shutting down" if scheduler.closing else "degraded" if lost else "ok",
                                **({"error": lost} if lost else {}),
                                "model": self.server.state.model_id,
                                "running": running > 0, "waiting": waiting,
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

    def complete(self, chat: bool) -> None:
        state = self.server.state
        scheduler, model = state.scheduler, state.scheduler.model
        scheduler.check_open()     # while stopping, 503 before the body is read
        jobs = parse_jobs(self.read_json(), chat, model.tokenizer, model.config.vocab_size, state.defaults)
        most = scheduler.max_queue + scheduler.parallel
        if len(jobs) > most:     # never admissible, however long the client waits: not a 503
            raise ApiError(400, f"n is {len(jobs)} (with best_of), more choices than this server can ever hold "
                                f"at once ({scheduler.parallel} running + {scheduler.max_queue} waiting: "
                                f"--parallel and --queue)", param="n")
        prompt = sum(len(j.ids) for j in jobs if j.sample == 0)
        self.note = f"prompt {prompt} tok" + (f", {len(jobs)} choices" if len(jobs) > 1 else "")
        response = Response(jobs, state.model_id, model.tokenizer)
        with scheduler.admit(jobs, self.client_gone) as chunks:
            lasts = (self.stream if jobs[0].stream else self.collect)(response, chunks)
        for job in jobs:
            state.metrics.generation(len(job.ids) if job.sample == 0 else 0, job.cached if job.sample == 0 else 0,
                                     lasts[job.index])
        cached = sum(j.cached for j in jobs if j.sample == 0)
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

    def stream(self, response: Response, chunks) -> dict:
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
                text = response.content(chunk.text, index)     # held back where it may be a tool call
                if text or chunk.logprobs:
                    self.send_event(response.chunk(text, index=index, entries=chunk.logprobs))
                if chunk.finish_reason is not None:
                    lasts[index] = chunk
                    for obj in response.finish_chunks(chunk, index):
                        self.send_event(obj)
                self.tokens += 1
                self.check_alive()
        except Ds2Error as e:  # the status is sent: the error travels as an event, then the stream ends
            error = ApiError(503, str(e), code="unavailable") if isinstance(e, UnavailableError) else ApiError(500, str(e))
            self.send_event(error.body())
            self.end_events()
            raise error from None
        for obj in response.usage_chunk(lasts):
            self.send_event(obj)
        self.end_events()
        return lasts

    def check_alive(self) -> None:
        if self.client_gone():
            raise ClientGone()

    def client_gone(self) -> bool:
        """Whether the peer has closed its end: readable with nothing to read means EOF."""
        sock = self.connection
        try:
            if hasattr(select, "poll"):     # select.select fails on descriptors past 1023
                poller = select.poll()
                poller.register(sock, select.POLLIN)
                ready = bool(poller.poll(0))
            else:
                ready = bool(select.select([sock], [], [], 0)[0])
            return ready and sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # ---- bodies ----
    def read_json(self) -> dict:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise ApiError(411, "send the body with a Content-Length header (chunked bodies are not read)")
        length = self.headers.get("Content-Length")
        if length is None:
            raise ApiError(411, "a POST needs a Content-Length header")
        if not (length.strip().isascii() and length.strip().isdigit()):  # int() would take "-1", "1_0"
            self.close_connection = True
            raise ApiError(400, f"bad Content-Length {length[:40]!r}")
        n = int(length)
        limit = self.server.state.max_body
        if n > limit:
            self.linger = True
            raise ApiError(413, f"the request body is {n} bytes, more than the limit of {limit} bytes "
                                f"(ds2 serve --max-prompt-bytes)", code="request_too_large")
        raw = self.rfile.read(n)
        self.body_read = True
        if len(raw) < n:
            raise ClientGone()
        try:
            body = json.loads(raw)
        except JSON_ERRORS as e:
            raise ApiError(400, f"the body is not valid JSON: {json_error(e)}") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a JSON object, not {type(body).__name__}")
        where = lone_surrogate(body)
        if where is not None:      # JSON's \ud800 escapes decode to text no tokenizer can encode
            raise ApiError(400, f"{where} is not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff "
                                f"without its pair)", param=where.split(".")[0].split("[")[0] or None)
        return body

    def body_pending(self) -> bool:
        headers = getattr(self, "headers", None)    # unset when the request line or headers were bad
        if headers is None:
            return False
        length = headers.get("Content-Length")
        return not self.body_read and (bool(headers.get("Transfer-Encoding")) or
                                       (length is not None and length.strip() not in ("", "0")))

    def swallow_body(self) -> None:
        """After an early 413, read (and drop) what the client is still sending for a moment,
        so that closing the socket does not reset the connection before it reads the answer."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_S)
            deadline = time.monotonic() + LINGER_S
            while time.monotonic() < deadline and self.connection.recv(65536):
                pass
        except OSError:
            pass

    # ---- writing ----
    def send_json(self, status: int, obj: dict) -> None:
        self.send_body(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json")

    def send_body(self, status: int, data: bytes, content_type: str) -> None:
        scheduler = self.server.state.scheduler
        if self.body_pending() or (scheduler is not None and scheduler.closing):
            self.close_connection = True   # an unread body would be parsed as the next request
        self.status = status
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.cors_headers()
        for name, value in self.extra_headers.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.count_request()
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def fail(self, e: ApiError) -> None:
        self.note = f"error: {e.message}"
        if e.status == 503 and e.code in ("queue_full", "loading"):
            self.extra_headers["Retry-After"] = "1"
        if self.status:  # a response has started; nothing more can be said
            self.close_connection = True
            return
        try:
            self.send_json(e.status, e.body())
        except OSError:
            self.close_connection = True

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (bad request line, unsupported method, a URI or header too
        long, too many headers) in OpenAI's format, with a status line: a garbage line parses
        as HTTP/0.9, which has none, and ds2 never speaks 0.9."""
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
            self.request_version = "HTTP/1.1"
        self.t0 = time.perf_counter()
        self.extra_headers, self.body_read, self.close_connection = {}, True, True
        self.status, self.note = 0, ""
        self.fail(ApiError(code, message or "bad request", type_="invalid_request_error"))
        self.log_line(getattr(self, "command", None) or "-", getattr(self, "path", "-"))

    def start_events(self) -> None:
        self.status = 200
        self.chunked = self.request_version == "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.cors_headers()
        if self.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:   # HTTP/1.0: the end of the connection ends the stream
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()

    def send_event(self, obj) -> None:
        if not isinstance(obj, bytes):
            obj = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
        data = b"data: " + obj + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)

    def end_events(self) -> None:
        self.count_request()
        self.send_event(b"[DONE]")
        if self.chunked:
            self.wfile.write(b"0\r\n\r\n")

    # ---- logging: one line per request, ours only ----
    def log_line(self, method: str, path: str) -> None:
        seconds = time.perf_counter() - self.t0
        note = f" | {self.note}" if self.note else ""
        self.server.state.log(f"{self.client_address[0]} \"{method} {path[:200]}\" {self.status}{note}"
                              f" | {seconds:.2f}s")

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format, *args):  # http.server's own lines (timeouts, requests): not wanted
        pass


# ---- the command ----
