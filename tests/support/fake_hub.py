"""A stand-in for the Hugging Face Hub on 127.0.0.1, for tests that run huggingface_hub against it
through HF_ENDPOINT, with no network: one local checkpoint folder served as repository `repo` at
the fixed commit COMMIT, answering what huggingface_hub 2.x asks (read from its source):

    GET  /api/models/{repo}/revision/{rev}     repo_info: {"id", "sha", "siblings"}
    GET  /api/models/{repo}/tree/{rev}          list_repo_tree (snapshot_download, list_repo_files)
    HEAD /{repo}/resolve/{rev}/{file}           X-Repo-Commit, ETag, Content-Length, and for the
                                                LFS files (*.safetensors) X-Linked-Etag and X-Linked-Size
    GET  /{repo}/resolve/{rev}/{file}           the file, or with `Range: bytes=a-b` its bytes a..b (206)

Every request is logged (method, path, Range header) in `requests`, so that a test can say what
was fetched: `hub.requests`, `hub.bytes_sent(name)`.

    with FakeHub(bundled_model_dir(), "org/tiny") as hub:
        env["HF_ENDPOINT"] = hub.url
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "c0ffee0123456789abcdef0123456789abcdef01"
DRIP_S = 1.0                         # a dripping file's pace: a byte a second
LFS_SUFFIXES = (".safetensors",)     # what the Hub stores in LFS (of what ds2 reads)
RANGE = re.compile(r"bytes=(\d+)-(\d*)")


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    path: str                 # unquoted, without the query
    range: str | None         # the Range header as sent


class FakeHub:
    """`root`'s files (top level) as repository `repo` at COMMIT, also under the revision "main".
    With `ignore_ranges`, it answers a byte-range request with the whole file, as some servers do.
    The files named in `drip` are sent a byte every DRIP_S seconds, as a stalled server sends
    them (`dripping` is set when one starts), until the client goes or the hub closes."""

    def __init__(self, root: Path, repo: str = "org/tiny", ignore_ranges: bool = False, drip: tuple = ()):
        self.root, self.repo, self.ignore_ranges, self.drip = Path(root), repo, ignore_ranges, set(drip)
        self.files = sorted(p.name for p in self.root.iterdir() if p.is_file())
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.dripping, self.closed = threading.Event(), threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()

    def requests_for(self, name: str) -> list[Request]:
        return [r for r in self.requests if r.path.endswith("/resolve/" + COMMIT + "/" + name)
                or r.path.endswith("/resolve/main/" + name)]

    def bytes_sent(self, name: str) -> int:
        """Body bytes sent for file `name` (HEAD sends none)."""
        size = (self.root / name).stat().st_size
        total = 0
        for r in self.requests_for(name):
            span = byte_range(r.range, size) if r.range and not self.ignore_ranges else (0, size)
            if r.method == "GET" and span is not None:
                total += span[1] - span[0]
        return total

    # ---- the Hub's answers ----

    def entry(self, name: str) -> dict:
        """A tree entry as the Hub lists it (no xetHash: huggingface_hub then downloads over HTTP)."""
        data = (self.root / name).read_bytes()
        out = {"type": "file", "path": name, "size": len(data), "oid": git_blob_sha(data)}
        if name.endswith(LFS_SUFFIXES):
            out["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return out

    def file_headers(self, name: str) -> dict[str, str]:
        data = (self.root / name).read_bytes()
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{git_blob_sha(data)}"',
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if name.endswith(LFS_SUFFIXES):
            headers |= {"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data))}
        return headers

    def handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:   # the test's output stays its own
                pass

            def do_HEAD(self) -> None:
                self.answer(head=True)

            def do_GET(self) -> None:
                self.answer(head=False)

            def answer(self, head: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                with hub.lock:
                    hub.requests.append(Request(self.command, path, self.headers.get("Range")))
                api = f"/api/models/{hub.repo}/"
                resolve = f"/{hub.repo}/resolve/"
                if path.startswith(api + "revision/"):
                    self.revision(path.removeprefix(api + "revision/"))
                elif path.startswith(api + "tree/"):
                    self.tree(path.removeprefix(api + "tree/"))
                elif path.startswith(resolve):
                    rev, _, name = path.removeprefix(resolve).partition("/")
                    self.file(rev, name, head)
                else:
                    self.reply(404, b"", {"X-Error-Code": "RepoNotFound"})

            def revision(self, rev: str) -> None:
                if rev not in ("main", COMMIT):
                    return self.reply(404, b"", {"X-Error-Code": "RevisionNotFound"})
                info = {"id": hub.repo, "modelId": hub.repo, "sha": COMMIT, "private": False,
                        "siblings": [{"rfilename": n} for n in hub.files]}
                self.reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"})

            def tree(self, rev: str) -> None:
                if rev.rstrip("/") not in ("main", COMMIT):
                    return self.reply(404, b"", {"X-Error-Code": "RevisionNotFound"})
                body = json.dumps([hub.entry(n) for n in hub.files]).encode()
                self.reply(200, body, {"Content-Type": "application/json"})

            def file(self, rev: str, name: str, head: bool) -> None:
                if rev not in ("main", COMMIT) or name not in hub.files:
                    return self.reply(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
                data = (hub.root / name).read_bytes()
                headers = hub.file_headers(name)
                asked = None if hub.ignore_ranges else self.headers.get("Range")
                span = byte_range(asked, len(data)) if asked and not head else None
                if asked and not head and span is None:
                    return self.reply(416, b"", {**headers, "Content-Range": f"bytes */{len(data)}"})
                if name in hub.drip and not head:
                    return self.drip(data, headers)
                if span is None:
                    return self.reply(200, data, headers, head)
                start, stop = span
                self.reply(206, data[start:stop], {**headers, "Content-Range": f"bytes {start}-{stop - 1}/{len(data)}"})

            def drip(self, data: bytes, headers: dict[str, str]) -> None:
                self.send_response(200)
                for key, value in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(key, value)
                self.end_headers()
                hub.dripping.set()
                for i in range(len(data)):
                    if hub.closed.wait(DRIP_S):
                        return
                    try:
                        self.wfile.write(data[i:i + 1])
                        self.wfile.flush()
                    except OSError:
                        return      # the client went

            def reply(self, status: int, body: bytes, headers: dict[str, str], head: bool = False) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    try:
                        self.wfile.write(body)
                    except (BrokenPipeError, ConnectionResetError):
                        pass    # a client that read what it asked for and hung up

        return Handler


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """`bytes=a-b` (or `bytes=a-`) -> [a, min(b + 1, size)); None when absent or unsatisfiable."""
    m = RANGE.fullmatch(header or "")
    if m is None or int(m[1]) >= size:
        return None
    stop = size if not m[2] else min(int(m[2]) + 1, size)
    return int(m[1]), stop


def git_blob_sha(data: bytes) -> str:
    """The id git (and the Hub's ETag for a file not in LFS) gives a file's content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def header_length(path: Path) -> int:
    """The first 8 bytes of a safetensors file: how long its JSON header is."""
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")
