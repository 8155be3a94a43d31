"""A download run in a child process, so that every wait in it is bounded and Ctrl-C ends it at
once: the Hub's (weights/hub.py), which huggingface_hub runs on threads of its own that nothing
can stop mid-read (a Ctrl-C waited for them, more than 30 s on a slow server).

The child counts the bytes it receives (`Meter`: each response's headers as they arrive, its
body as it is read, before any decoding) and gives up when the download stalls: less than
STALL_BYTES in the last DS2_HUB_IDLE_S seconds (IDLE_S by default). A server that sends one byte
a second defeats huggingface_hub's own timeout, which is per read. The child reports one JSON
line, its result or its error, and exits; the parent kills it when the parent is interrupted
(Ctrl-C: exit 130 as soon as the signal comes) and the child ends itself when the parent is
gone (its stdin closes). The child runs in a session of its own, so the terminal's Ctrl-C
reaches the parent only.

The work is a function named as `module:function`, which the child imports and calls with
the job (a JSON object) and the Meter.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

from ds2cli.errors import ConfigError, Ds2Error

IDLE_ENV = "DS2_HUB_IDLE_S"
IDLE_S = 60.0               # seconds a download may go with less than STALL_BYTES received
STALL_BYTES = 16 << 10      # ... which a download of the slowest real link passes many times over


class Stalled(Ds2Error):
    """The download received less than STALL_BYTES in the idle time, while `doing` (what the
    work had said it was doing: Meter.doing)."""

    def __init__(self, message: str, doing: str = ""):
        super().__init__(message)
        self.doing = doing


class ChildError(Exception):
    """The work failed in the child with an error other than a Ds2Error: its text, on one line."""


def idle_seconds() -> float:
    """DS2_HUB_IDLE_S, or IDLE_S when it is not set."""
    raw = os.environ.get(IDLE_ENV, "").strip()
    if not raw:
        return IDLE_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ConfigError(f"{IDLE_ENV} must be a number of seconds above 0, not {raw[:40]!r}")
    return value


class Meter:
    """The bytes a download has received, and whether it has stalled: less than STALL_BYTES in
    the last `idle_s` seconds, once it has run that long. `stalled` is asked a few times a
    second; it keeps the totals it saw over the last `idle_s` seconds."""

    def __init__(self, idle_s: float, clock=time.monotonic):
        self.idle_s, self.clock = idle_s, clock
        self.lock = threading.Lock()
        self.total = 0
        self.marks = None       # (time, total) as stalled() saw them; None until begin()
        self.doing = ""         # what the work is doing, for the stall's report
        self.shows_progress = False     # a progress bar is on stderr: a stall ends its line first

    def begin(self) -> None:
        """The window starts now: the child's imports do not count against it."""
        with self.lock:
            self.marks = collections.deque([(self.clock(), self.total)])

    def add(self, n: int) -> None:
        with self.lock:
            self.total += n

    def stalled(self) -> bool:
        now = self.clock()
        with self.lock:
            if self.marks is None:
                return False
            self.marks.append((now, self.total))
            while len(self.marks) > 1 and self.marks[1][0] <= now - self.idle_s:
                self.marks.popleft()
            since, then = self.marks[0]
            return since <= now - self.idle_s and self.total - then < STALL_BYTES

    def reason(self) -> str:
        return (f"it received less than {STALL_BYTES >> 10} KiB in {self.idle_s:g} s (a stalled server; "
                f"{IDLE_ENV} sets how long)")


def meter_session(session, meter: Meter) -> None:
    """Count what every response of `session` (an httpx Client, as huggingface_hub's get_session
    gives) brings: its headers when they arrive, its body as it is read."""
    httpx = sys.modules[type(session).__module__.partition(".")[0]]

    class Metered(httpx.SyncByteStream):
        def __init__(self, stream):
            self.stream = stream

        def __iter__(self):
            for chunk in self.stream:
                meter.add(len(chunk))
                yield chunk

        def close(self) -> None:
            self.stream.close()

    def on_response(response) -> None:
        meter.add(16 + sum(len(k) + len(v) + 4 for k, v in response.headers.raw))
        response.stream = Metered(response.stream)

    hooks = session.event_hooks
    session.event_hooks = {**hooks, "response": [*hooks.get("response", []), on_response]}
    meter.begin()


# ---- the parent's side ----

def run(call: str, job: dict, idle_s: float) -> dict:
    """`call`(job, meter) in a child process: its result, or Stalled, or the Ds2Error it raised
    (as ConfigError), or for any other error a ChildError of its text. Ctrl-C (any exception
    here) kills the child and goes on at once."""
    spec = json.dumps({"call": call, "job": job, "idle_s": idle_s})
    child = subprocess.Popen([sys.executable, "-c", "from ds2cli.weights.downloads import child; child()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                             env={**os.environ, "HF_HUB_DISABLE_XET": "1"})
    try:
        child.stdin.write(spec.encode() + b"\n")
        child.stdin.flush()
        out = child.stdout.read()           # until the child ends (its stdin stays open until then)
        child.wait()
    except BaseException:
        child.kill()
        child.wait()
        raise
    finally:
        for pipe in (child.stdin, child.stdout):
            try:
                pipe.close()
            except OSError:
                pass
    lines = out.decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise ChildError(f"the download's process ended with code {child.returncode} and no answer") from None
    if "result" in answer:
        return answer["result"]
    if answer["kind"] == "stalled":
        raise Stalled(answer["error"], answer.get("doing", ""))
    raise (ConfigError if answer["kind"] == "ds2" else ChildError)(answer["error"])


# ---- the child's side ----

def child() -> None:
    """The child process: one spec on stdin, one JSON line on stdout, then exit (os._exit: no
    wait for the download's threads, which a stalled server may hold)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answer_to = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)               # anything the download prints goes to stderr, never into the answer
    spec = json.loads(sys.stdin.readline())
    meter = Meter(spec["idle_s"])
    lock = threading.Lock()

    def answer(obj: dict, code: int) -> None:
        with lock:              # the first answer is the only one
            answer_to.write(json.dumps(obj) + "\n")
            answer_to.flush()
            os._exit(code)

    def watch() -> None:
        while not meter.stalled():
            time.sleep(min(0.25, meter.idle_s / 8))
        if meter.shows_progress:
            sys.stderr.write("\n")
        answer({"error": meter.reason(), "kind": "stalled", "doing": meter.doing}, 1)

    def parent() -> None:
        sys.stdin.read()        # EOF: the parent is gone
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    threading.Thread(target=parent, daemon=True).start()
    module, _, name = spec["call"].partition(":")
    try:
        result = getattr(importlib.import_module(module), name)(spec["job"], meter)
    except Ds2Error as e:
        answer({"error": str(e), "kind": "ds2"}, 1)
    except Exception as e:      # noqa: BLE001 - the network, the Hub, the files: reported by the parent
        answer({"error": first_line(e), "kind": "other"}, 1)
    answer({"result": result}, 0)


def first_line(e: Exception) -> str:
    """An error's text on one line (huggingface_hub's run on for lines), or its type's name."""
    return " ".join(str(e).split()) or type(e).__name__
