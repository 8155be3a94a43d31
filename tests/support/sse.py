"""What the clients of a served model share (the cluster tests' and bench/cluster_heal.py's, run in
a cluster's network namespace): waiting for the server to load, and the events of a streamed
OpenAI-style response (server-sent events)."""

import json
import time
import urllib.request


def healthy(base: str, within: float) -> None:
    """Until the server at `base` answers /health "ok" (it loads first), `within` seconds at most."""
    deadline = time.time() + within
    while True:
        try:
            if json.load(urllib.request.urlopen(base + "/health", timeout=30))["status"] == "ok":
                return
        except Exception:
            if time.time() > deadline:
                raise
        if time.time() > deadline:
            raise TimeoutError(f"{base} did not answer /health ok within {within:.0f} s")
        time.sleep(0.5)


def events(response):
    """Each `data:` event's JSON, in order, up to `data: [DONE]`; other lines skipped."""
    for line in response:
        line = line.decode().strip()
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            yield json.loads(line[6:])
