"""A request's bytes: its JSON body read within the server's limit (and checked: valid JSON, an
object, no lone surrogate), an early 413's unread body swallowed, and the answers written: a
JSON body, an error in OpenAI's shape, server-sent events (chunked on HTTP/1.1). A mixin of the
handler (http_server.Handler), which gives it `server.state`, `extra_headers` and `status`."""

from __future__ import annotations

import json
import select
import socket
import time

from ds2cli.json_files import JSON_ERRORS, json_error
from ds2cli.server.request_fields import ApiError
from ds2cli.server.scheduler import ClientGone

MAX_BODY_BYTES = 4 * 1024 * 1024    # a request body beyond this gets 413 (a 160k-token prompt fits)
LINGER_S = 1.0                      # after a 413, how long to swallow the unread body before closing


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


class Read(dict):
    """A request's body that records which fields the parsing read: what is left over was
    ignored, and the handler names it (a warning log line and the X-Ds2-Ignored-Fields header)."""

    def __init__(self, body: dict):
        super().__init__(body)
        self.read: set = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def ignored(self) -> list[str]:
        return sorted(k for k in self if k not in self.read)


class BodyIO:
    """Reading a request's body and writing its answer (a mixin of the handler)."""

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

    def end_events(self, done: bool = True) -> None:
        """The stream's end: OpenAI's `data: [DONE]` (unless `done` is false: llama-server's
        own endpoints send none), then the last chunk."""
        self.count_request()
        if done:
            self.send_event(b"[DONE]")
        if self.chunked:
            self.wfile.write(b"0\r\n\r\n")

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
