"""Continuous batching in `ds2 serve`, measured as its clients see it.

    python examples/batch_bench.py -m ~/.cache/ds2/bench/deepseek-v2-lite-27-layers-q8 --rounds 3

Starts `ds2 serve --parallel 4` on the checkpoint, then, each round:
- 1, 2 and 4 concurrent greedy streams, each a 128-token prompt of random token ids (distinct
  per stream, so nothing is shared) and 64 generated tokens. The aggregate decode rate is counted
  over the window in which every stream is decoding: from the last first token to the first end.
- an arrival: a request whose prompt comes while 3 others stream; its time to first token
  against a lone request's (same prompt length) plus 2 decode steps, and the longest gap the
  running streams saw meanwhile.
Prints min/median/max over the rounds, and every stream's inter-token latency p50/p99.

A synthesized checkpoint (`ds2 bench --layers 27`) has a small tokenizer, in which most of the
random weights' tokens decode to nothing, and a stream carries only text: the server runs it
with DeepSeek-V2's own tokenizer instead (a directory of links to the weights beside it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(port: int, ids: list[int], max_tokens: int, out: dict) -> None:
    """One streamed completion; out gets the send time and every token's arrival time."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    out["sent"] = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    r = conn.getresponse()
    times = out.setdefault("times", [])
    for line in r:
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"]:
                times.append(time.perf_counter())
    conn.close()


def run_streams(port: int, prompts: list[list[int]], max_tokens: int, delays=None) -> list[dict]:
    outs = [{} for _ in prompts]
    threads = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        t = threading.Thread(target=stream, args=(port, p, max_tokens, o))
        if delays:
            time.sleep(delays[i])
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return outs


def aggregate_decode(outs: list[dict]) -> float:
    """Tokens per second over the window where every stream is decoding."""
    start = max(o["times"][0] for o in outs)
    end = min(o["times"][-1] for o in outs)
    tokens = sum(sum(1 for t in o["times"] if start < t <= end) for o in outs)
    return tokens / (end - start) if end > start else float("nan")


def gaps(o: dict) -> np.ndarray:
    return np.diff(o["times"])


def spread(values) -> str:
    values = [v for v in values if v == v]
    return f"{min(values):.3g} / {statistics.median(values):.3g} / {max(values):.3g}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=128)
    args = ap.parse_args()
    port = free_port()
    model = Path(tempfile.mkdtemp(prefix="ds2-batch-bench-"))
    for f in Path(args.model).expanduser().iterdir():
        if not f.name.startswith("tokenizer"):
            os.symlink(f.resolve(), model / f.name)
    for f in (Path(__file__).parent.parent / "tests" / "data" / "tokenizers" / "deepseek-v2").iterdir():
        shutil.copy(f, model / f.name)
    server = subprocess.Popen([sys.executable, "-m", "ds2cli", "serve", "-m", str(model), "--port", str(port),
                               "--parallel", "4", "--ctx", str(args.prompt + args.tokens + 8),
                               "--prefill-chunk", str(args.prefill_chunk), "--prompt-cache-mb", "0"],
                              stderr=subprocess.PIPE, text=True)
    for line in server.stderr:
        print(line.rstrip(), file=sys.stderr)
        if " on http://" in line:
            break
    threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()
    rng = np.random.default_rng(0)
    vocab = 100000                   # the tokenizer's own tokens, so that prompts are text it has

    def prompts(n):
        return [rng.integers(100, vocab, size=args.prompt).tolist() for _ in range(n)]

    try:
        run_streams(port, prompts(1), 4)                     # warm up
        rates = {1: [], 2: [], 4: []}
        ttft_alone, ttft_arrival, step_s, worst_gap, lat = [], [], [], [], {}
        for r in range(args.rounds):
            for n in (1, 2, 4):
                outs = run_streams(port, prompts(n), args.tokens)
                rates[n].append(aggregate_decode(outs))
                lat.setdefault(n, []).extend(gaps(o) for o in outs)
                if n == 1:
                    ttft_alone.append(outs[0]["times"][0] - outs[0]["sent"])
                    step_s.append(float(np.median(gaps(outs[0]))))
            # an arrival while 3 stream: it starts once they are well into their decode
            outs = [{} for _ in range(3)]
            threads = [threading.Thread(target=stream, args=(port, p, args.tokens, o))
                       for p, o in zip(prompts(3), outs)]
            for t in threads:
                t.start()
            while not all(len(o.get("times", [])) >= 4 for o in outs):
                time.sleep(0.01)
            late = {}
            stream(port, prompts(1)[0], 8, late)
            for t in threads:
                t.join()
            ttft_arrival.append(late["times"][0] - late["sent"])
            during = [np.diff([t for t in o["times"] if late["sent"] <= t <= late["times"][0] + 1e-9] +
                              [min((t for t in o["times"] if t > late["times"][0]), default=late["times"][0])])
                      for o in outs]
            worst_gap.append(max(float(d.max()) for d in during if len(d)))
            print(f"round {r + 1}: " + ", ".join(f"{n} streams {rates[n][-1]:.2f} tok/s" for n in rates)
                  + f", arrival ttft {ttft_arrival[-1]:.2f} s", file=sys.stderr)
        base = rates[1]
        print(f"aggregate decode tok/s (min / median / max over {args.rounds} rounds):")
        for n in rates:
            ratio = [a / b for a, b in zip(rates[n], base)]
            print(f"  {n} stream{'s' * (n > 1)}: {spread(rates[n])}   x one stream: {spread(ratio)}")
        bound = [a + 2 * s for a, s in zip(ttft_alone, step_s)]
        print(f"time to first token alone: {spread(ttft_alone)} s; decode step alone {spread(step_s)} s")
        print(f"arriving while 3 stream: {spread(ttft_arrival)} s; the bound 1.5 x alone + 2 steps: "
              f"{spread([1.5 * a + 2 * s for a, s in zip(ttft_alone, step_s)])} s "
              f"(alone + 2 steps: {spread(bound)} s)")
        print(f"longest gap of a running stream meanwhile: {spread(worst_gap)} s")
        for n, gs in lat.items():
            g = np.concatenate(gs)
            print(f"  inter-token latency with {n} stream{'s' * (n > 1)}: p50 {np.percentile(g, 50) * 1e3:.0f} ms, "
                  f"p99 {np.percentile(g, 99) * 1e3:.0f} ms")
    finally:
        server.terminate()
        server.wait(120)
        shutil.rmtree(model)


if __name__ == "__main__":
    main()
