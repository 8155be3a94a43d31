"""`ds2 serve`: an OpenAI-compatible HTTP server on the standard library's ThreadingHTTPServer.

The HTTP layer: routing, keys, bodies, server-sent events, one log line per request, and the
command with its graceful stop. Each request runs on its own handler thread, which parses it
(api.py), waits for its turn at the engine (engine.py) and streams the chunks as they come.

Why http.server rather than an ASGI stack: a CPU engine serves one request at a time, so the
server needs blocking threads, not an event loop; and this keeps ds2 free of new dependencies.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import select
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import click

from ds2cli import __version__, console
from ds2cli import grammar as grammars
from ds2cli.api import ApiError, Defaults, Response, parse_job
from ds2cli.config import JSON_ERRORS, json_error
from ds2cli.engine import ClientGone, Engine, Refused
from ds2cli.errors import Ds2Error
from ds2cli.generate import Chunk
from ds2cli.options import (argument_text, chat_template_option, check_ctx, load_model, max_new_tokens_for,
                            memory_options, model_config, model_option, sampling_options, sampling_params,
                            thread_limits)

MAX_BODY_BYTES = 4 * 1024 * 1024    # a request body beyond this gets 413 (a 160k-token prompt fits)
DEFAULT_CTX = 4096                  # per-request context (cache capacity), as ds2 chat
DEFAULT_QUEUE = 16                  # requests that may wait while one runs
DEFAULT_PROMPT_CACHE_MB = 1024
IDLE_TIMEOUT_S = 120                # a connection that sends nothing for this long is closed
LINGER_S = 1.0                      # after a 413, how long to swallow the unread body before closing


class State:
    """What every handler thread shares: the engine and the server's settings."""

    def __init__(self, engine: Engine, model_id: str, defaults: Defaults, api_key: str | None,
                 sink=None):
        self.engine, self.model_id, self.defaults, self.api_key = engine, model_id, defaults, api_key
        self.sink = sink                    # where log lines go (tests collect them); default stderr
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

    def __init__(self, address, state: State):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.state = state
        super().__init__(address, Handler)

    def handle_error(self, request, client_address):
        # socketserver would print a traceback; a server log gets one line, and a client that
        # resets an idle keep-alive connection (no request in flight) gets none
        e = sys.exc_info()[1]
        if isinstance(e, (ConnectionError, TimeoutError)):
            return
        self.state.log(f"{client_address[0]} connection error: {type(e).__name__}: {' '.join(str(e).split())}")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"ds2/{__version__}"
    timeout = IDLE_TIMEOUT_S
    disable_nagle_algorithm = True      # one small write per token: send each at once

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
                  "/v1/completions": ("POST", self.completions), "/health": ("GET", self.health)}
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
        path = urlsplit(self.path).path
        try:
            path, handler = self.route(method, path.rstrip("/") or "/")
            if path != "/health":
                self.check_key()
            handler()
        except ApiError as e:
            self.fail(e)
        except Refused as e:    # the queue is full, or the server is stopping
            self.fail(ApiError(503, str(e), code=e.code))
        except Ds2Error as e:  # the model failed mid-request (e.g. non-finite logits)
            self.fail(ApiError(500, str(e)))
        except (ClientGone, ConnectionError, TimeoutError):  # BrokenPipeError is a ConnectionError
            self.status, self.close_connection = self.status or 499, True
            self.note = f"client gone after {self.tokens} chunks"
        except Exception as e:  # never a traceback to the client or the log: one line each
            self.fail(ApiError(500, f"internal error: {type(e).__name__}: {' '.join(str(e).split())}"))
        finally:
            self.log_line(method, path)
            if self.linger:
                self.swallow_body()
            with state.active_cond:
                state.active -= 1
                state.active_cond.notify_all()

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

    # ---- endpoints ----
    def health(self) -> None:
        engine = self.server.state.engine
        status = 503 if engine.closing else 200
        self.send_json(status, {"status": "shutting down" if engine.closing else "ok",
                                "model": self.server.state.model_id,
                                "running": engine.running() > 0, "waiting": engine.waiting()})

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
        engine, model = state.engine, state.engine.model
        engine.check_open()     # while stopping, 503 before the body is read
        job = parse_job(self.read_json(), chat, model.tokenizer, model.config.vocab_size, state.defaults)
        self.note = f"prompt {len(job.ids)} tok"
        response = Response(job, state.model_id)
        with engine.admit(job, self.client_gone) as chunks:
            last = (self.stream if job.stream else self.collect)(response, chunks)
        self.note = (f"prompt {len(job.ids)} tok, {job.cached} cached | gen {last.generated_tokens} tok, "
                     f"{last.decode_tok_per_s:.1f} tok/s | {last.finish_reason}")

    def collect(self, response: Response, chunks) -> Chunk:
        pieces = []
        for chunk in chunks:
            pieces.append(chunk.text)
            self.tokens += 1
            self.check_alive()
        self.send_json(200, response.whole("".join(pieces), chunk))
        return chunk

    def stream(self, response: Response, chunks) -> Chunk:
        self.start_events()
        if response.job.chat:
            self.send_event(response.chunk("", role=True))
        try:
            for chunk in chunks:
                text = response.content(chunk.text)     # held back where it may be a tool call
                if text:
                    self.send_event(response.chunk(text))
                self.tokens += 1
                self.check_alive()
        except Ds2Error as e:  # the status is sent: the error travels as an event, then the stream ends
            error = ApiError(500, str(e))
            self.send_event(error.body())
            self.end_events()
            raise error from None
        for obj in response.final_chunks(chunk):
            self.send_event(obj)
        self.end_events()
        return chunk

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
        if n > MAX_BODY_BYTES:
            self.linger = True
            raise ApiError(413, f"the request body is {n} bytes, more than the limit of {MAX_BODY_BYTES} bytes",
                           code="request_too_large")
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
        return body

    def body_pending(self) -> bool:
        length = self.headers.get("Content-Length") if self.headers else None
        return not self.body_read and (bool(self.headers.get("Transfer-Encoding")) or
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
        data = json.dumps(obj, ensure_ascii=False).encode()
        if self.body_pending() or self.server.state.engine.closing:
            self.close_connection = True   # an unread body would be parsed as the next request
        self.status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in self.extra_headers.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def fail(self, e: ApiError) -> None:
        self.note = f"error: {e.message}"
        if e.status == 503 and e.code == "queue_full":
            self.extra_headers["Retry-After"] = "1"
        if self.status:  # a response has started; nothing more can be said
            self.close_connection = True
            return
        try:
            self.send_json(e.status, e.body())
        except OSError:
            self.close_connection = True

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (bad request line, unsupported method, ...) in OpenAI's format."""
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
def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_forever(server: Server, state: State) -> None:
    """serve_until() a first SIGINT/SIGTERM; a second one aborts the running request. Signals
    that come after are ignored: the work is done, and a late Ctrl-C arriving while Python shuts
    down (where it would kill the process with the signal) must not turn a clean stop into a failure."""
    stop = threading.Event()

    def on_signal(signum, frame):
        if stop.is_set():
            state.engine.abort()
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve_until(server, state, stop)
    except BaseException:
        for s, handler in previous.items():
            signal.signal(s, handler)
        raise
    for s in previous:
        signal.signal(s, signal.SIG_IGN)


def serve_until(server: Server, state: State, stop: threading.Event) -> None:
    """Serve until `stop` is set; then refuse new requests (503, /health too) and send waiting
    ones away while the running one finishes, still accepting connections to say so; then close
    the listening socket, let the handlers write their last answers, and return."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    while not stop.wait(0.2):   # a timeout, so that the main thread runs its signal handlers
        pass
    state.log("ds2 serve: stopping (a second Ctrl-C ends the running request at its next token)")
    state.engine.close()
    state.engine.wait_idle()
    server.shutdown()
    server.server_close()       # the listening socket: new connections are refused from now on
    state.wait_handlers()


@click.command()
@model_option
@click.option("--alias", metavar="NAME", help="The model id the server reports (in /v1/models, responses and "
              "the log). Default: what -m was given, else ds2-tiny.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0 = any free port).")
@click.option("--ctx", type=click.IntRange(min=1), help=f"Context per request, in tokens. Default: "
              f"min(max_position_embeddings, {DEFAULT_CTX}).")
@click.option("--api-key", envvar="DS2_API_KEY", help="Require Authorization: Bearer KEY (or set DS2_API_KEY).")
@click.option("--prompt-cache-mb", default=DEFAULT_PROMPT_CACHE_MB, show_default=True, type=click.IntRange(min=0),
              help="Memory for latent caches of recent conversations (0 = no reuse).")
@click.option("--queue", "max_queue", default=DEFAULT_QUEUE, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait while one runs; beyond, 503.")
@click.option("--system", metavar="TEXT", help="A default system message, for chat requests that bring "
              "no system (or developer) message.")
@chat_template_option()
@sampling_options
@memory_options
def serve(model_dir, alias, host, port, ctx, api_key, prompt_cache_mb, max_queue, system, chat_template,
          quantize, no_memory_check, **opts):
    """Serve the model over an OpenAI-compatible HTTP API (chat and completions, streaming).

    Listens on 127.0.0.1:8000 unless told otherwise. The sampling options and -n are the defaults
    of requests that do not give them. Ctrl-C (or SIGTERM) stops gracefully: the running request
    finishes (a second one ends it at its next token)."""
    system = argument_text(system, "--system argument", hint="give it in UTF-8") or None
    path, config = model_config(model_dir)          # config.json only: --ctx is checked before any load
    check_ctx(config, ctx)
    with thread_limits(opts["threads"]):
        model, load_s = load_model(path, quantize, ctx or DEFAULT_CTX, not no_memory_check, chat_template)
        ctx = ctx or min(model.config.max_position_embeddings, DEFAULT_CTX)
        defaults = Defaults(sampling_params(model, opts), max_new_tokens_for(model, opts["max_new_tokens"]),
                            ctx, system, tuple(model.eos_token_ids))
        engine = Engine(model, ctx, prompt_cache_mb * 1024 * 1024, max_queue)
        if grammars.available():    # llguidance's view of the vocabulary (1.5 s, 80 MB for DeepSeek's 100k
            # tokens), built off the first constrained request's path; that request waits for it if need be
            threading.Thread(target=grammars.warm, daemon=True,
                             args=(model.tokenizer, model.config.vocab_size, defaults.eos_ids)).start()
        model_id = alias or (str(model_dir) if model_dir is not None else "ds2-tiny")
        state = State(engine, model_id, defaults, api_key or None)
        server = listen(host, port, state)
        slots = engine.prompt_cache.slots
        state.log(f"ds2 serve: {model_id} (loaded in {load_s:.2f}s) on {url(server)} | ctx {ctx} | prompt cache "
                  f"{prompt_cache_mb} MB = {slots} conversation{'s' * (slots != 1)} | queue {max_queue}")
        serve_forever(server, state)
    state.log("ds2 serve: stopped")


def listen(host: str, port: int, state: State) -> Server:
    try:
        server = Server((host, port), state)
    except OSError as e:
        raise Ds2Error(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    if state.api_key is None and not is_loopback(server.server_address[0]):
        console.warn(f"listening on {server.server_address[0]} without --api-key: anyone who can reach this "
                     f"machine can use the model")
    return server


def url(server: Server) -> str:
    host, port = server.server_address[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
