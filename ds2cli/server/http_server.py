"""The HTTP layer of `ds2 serve`, on the standard library's ThreadingHTTPServer: the shared
state, the server, and the handler's request path: routing, the API key, CORS, errors, metrics
and one log line per request. Each request runs on its own handler thread, which parses it
(jobs.py), hands its choices to the scheduler (scheduler.py) and writes their chunks as they come
(responses.py shapes them). What each endpoint does is endpoints.py; bodies read within their
limit and the writers (JSON, server-sent events) are http_io.py. serve.py has the command and
its graceful stop.

Why http.server rather than an ASGI stack: the scheduler's one thread runs every pass, so
the connections need only blocking threads, not an event loop; and ds2 gains no dependency.
"""

from __future__ import annotations

import hmac
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ds2cli import __version__
from ds2cli.server.request_fields import ApiError, Defaults
from ds2cli.server.endpoints import Endpoints
from ds2cli.server.http_io import MAX_BODY_BYTES, BodyIO
from ds2cli.server.scheduler import ClientGone, Scheduler, Refused
from ds2cli.errors import Ds2Error, UnavailableError
from ds2cli.generation.grammar import GrammarError
from ds2cli.server.metrics import Metrics
from ds2cli.wording import packed

IDLE_TIMEOUT_S = 120                # a connection that sends nothing for this long is closed
CORS_MAX_AGE_S = 600                # how long a browser may reuse a preflight's answer
# RFC 9110's token: what a header name may hold; a preflight's list is echoed only if made of them
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
MAX_ASKED_HEADERS = 64
OPEN_PATHS = ("/health", "/", "/favicon.ico")       # no API key needed: the probe, and the chat page (which asks for the key)
# the /metrics labels; other paths count as "other"
ENDPOINTS = ("/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
             "/infill", "/tokenize", "/detokenize", "/tokenizer_info")


def printable(text: str) -> str:
    """Request paths and error messages come from clients: no control character (a line break
    included) reaches a terminal or splits a log entry."""
    return "".join(c if c.isprintable() else "?" for c in text)

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

    def log(self, line: str, packed: bool = False) -> None:
        """One entry on stderr, or to the sink: one line, or wording.packed's lines when `packed`
        (whose parts went through printable() already)."""
        if not packed:
            line = printable(line)
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






def somaxconn() -> int:
    """The kernel's cap on a listen backlog (Linux); listen() silently truncates to it."""
    try:
        return max(1, int(Path("/proc/sys/net/core/somaxconn").read_text()))
    except (OSError, ValueError):
        return socket.SOMAXCONN






class Handler(Endpoints, BodyIO, BaseHTTPRequestHandler):
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
                  "/v1/completions": ("POST", self.completions), "/infill": ("POST", self.infill),
                  "/health": ("GET", self.health),
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

    # ---- http.server's own errors ----
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

    # ---- logging: one line per request, ours only ----
    def log_line(self, method: str, path: str) -> None:
        seconds = time.perf_counter() - self.t0
        parts = [f"{self.client_address[0]} \"{method} {path[:200]}\" {self.status}",
                 *self.note.split(" | "), f"{seconds:.2f}s"]
        self.server.state.log(packed([printable(p) for p in parts if p]), packed=True)     # within 80 columns

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format, *args):  # http.server's own lines (timeouts, requests): not wanted
        pass

