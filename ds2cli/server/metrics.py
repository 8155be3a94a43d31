"""`GET /metrics`: the server's counters in the Prometheus text format (version 0.0.4).

Counters only grow (a scraper takes rates of them); gauges are read when scraped. The token
rates are given both ways: the running totals of tokens and of seconds (rate() of one over the
other is the rate over any window), and the last request's own rates, for a glance.
"""

from __future__ import annotations

import collections
import threading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """What the handler threads report (`request`, `generation`), rendered by `render`."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()   # (endpoint, status) -> count
        self.totals = dict.fromkeys(("prompt_tokens", "generation_tokens", "prefill_seconds", "decode_seconds",
                                     "prompt_cache_hits", "prompt_cache_cached_tokens"), 0.0)
        self.last = {"prefill": 0.0, "decode": 0.0}

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[endpoint, status] += 1

    def generation(self, prompt_tokens: int, cached: int, last) -> None:
        """One finished generation: `last` is its last Chunk (counts and timings)."""
        with self.lock:
            t = self.totals
            t["prompt_tokens"] += prompt_tokens
            t["generation_tokens"] += last.generated_tokens
            t["prefill_seconds"] += last.prefill_s
            t["decode_seconds"] += last.decode_s
            t["prompt_cache_hits"] += cached > 0
            t["prompt_cache_cached_tokens"] += cached
            self.last = {"prefill": last.prefill_tok_per_s, "decode": last.decode_tok_per_s}

    def render(self, running: int, waiting: int, cache_entries: int, cluster: dict | None = None) -> str:
        """`cluster`: a cluster's healing counters (RayPasses.healed), over --ray."""
        with self.lock:
            t, last, requests = dict(self.totals), dict(self.last), sorted(self.requests.items())
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples) -> None:
            out.extend([f"# HELP ds2_{name} {help_}", f"# TYPE ds2_{name} {kind}"])
            out.extend(f"ds2_{name}{labels} {_number(v)}" for labels, v in samples)

        metric("requests_total", "counter", "HTTP requests answered, by endpoint and status code.",
               [(f'{{endpoint="{_label(e)}",code="{s}"}}', n) for (e, s), n in requests])
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished generations (cached ones included).",
               [("", t["prompt_tokens"])])
        metric("generation_tokens_total", "counter", "Tokens generated.", [("", t["generation_tokens"])])
        metric("prefill_seconds_total", "counter", "Seconds spent prefilling prompts.", [("", t["prefill_seconds"])])
        metric("decode_seconds_total", "counter", "Seconds spent decoding.", [("", t["decode_seconds"])])
        metric("prompt_cache_hits_total", "counter", "Generations that started from a cached prefix.",
               [("", t["prompt_cache_hits"])])
        metric("prompt_cache_cached_tokens_total", "counter", "Prompt tokens taken from the prompt cache.",
               [("", t["prompt_cache_cached_tokens"])])
        metric("prompt_cache_entries", "gauge", "Conversations held in the prompt cache.", [("", cache_entries)])
        metric("requests_running", "gauge", "Generations running now.", [("", running)])
        metric("requests_waiting", "gauge", "Requests waiting for their turn (the queue depth).", [("", waiting)])
        metric("last_prefill_tokens_per_second", "gauge", "The last generation's prefill rate.",
               [("", last["prefill"])])
        metric("last_decode_tokens_per_second", "gauge", "The last generation's decode rate.",
               [("", last["decode"])])
        if cluster is not None:
            metric("cluster_nodes_lost_total", "counter", "Cluster nodes lost, whose layers moved to the nodes left.",
                   [("", cluster["nodes_lost"])])
            metric("cluster_heal_seconds_total", "counter", "Seconds spent moving lost nodes' layers and "
                   "rebuilding their caches.", [("", cluster["heal_seconds"])])
        return "\n".join(out) + "\n"


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _label(value: str) -> str:
    """A label value as the text format escapes it (request paths come from clients)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
