"""Fairness in `ds2 serve`: how long a short chat waits beside long prompts, and how long a
running stream pauses while they arrive.

    python examples/fairness.py                      # ds2-tiny stretched to 16,384 positions
    python examples/fairness.py -m DIR --long-words 700 --ctx 2048 --rounds 3

Starts `ds2 serve --ctx CTX` on the model (by default a copy of ds2-tiny whose
max_position_embeddings and model_max_length say 16384, served with --ctx 8192), then, each
round, with 0, 1 and 2 long prompts (LONG_WORDS words each, streamed, a few tokens generated)
sent first:
- a short chat sent 0.3 s after them: its time to first token;
- a stream already decoding (a short completion of many tokens, started before the long
  prompts): the longest gap between its tokens while they are read.
Prints min / median / max over the rounds. Every client runs on this machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

WORDS = ("the history of the city begins with a river a market and a road that crossed the hills "
         "where farmers brought grain and salt to trade").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stretched_tiny(where: Path) -> Path:
    """ds2-tiny with 16,384 positions: its config and tokenizer_config say so (YaRN scales it)."""
    from ds2cli.weights.source import bundled_model_dir
    out = where / "ds2-tiny-16k"
    shutil.copytree(bundled_model_dir(), out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    (out / "config.json").write_text(json.dumps(config))
    tc = out / "tokenizer_config.json"
    if tc.exists():
        t = json.loads(tc.read_text())
        t["model_max_length"] = 16384
        tc.write_text(json.dumps(t))
    return out


def post(port: int, path: str, body: dict, out: dict) -> None:
    """A streamed request; out gets its send time and each text event's arrival time."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    out["sent"] = time.perf_counter()
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
    times = out.setdefault("times", [])
    for line in conn.getresponse():
        if line.startswith(b"data: {"):
            choice = json.loads(line[6:])["choices"]
            delta = choice[0].get("delta", {}).get("content") if choice and "delta" in choice[0] else \
                (choice[0].get("text") if choice else None)
            if delta:
                times.append(time.perf_counter())
    conn.close()


def start(target, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=target, args=(*args, out))
    t.start()
    return t, out


def spread(values) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--long-words", type=int, default=7000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-args", default="", help="more options for ds2 serve, e.g. '--prefill-chunk 128'")
    ap.add_argument("--no-runner", action="store_true",
                    help="no stream decoding meanwhile: the long prompts alone, then the short chat")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ds2-fairness-"))
    model = a.model or str(stretched_tiny(tmp))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "ds2cli", "serve", "-m", model, "--port", str(port),
                               "--ctx", str(a.ctx), "--parallel", "4", *a.serve_args.split()],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        long_text = " ".join(WORDS[i % len(WORDS)] for i in range(a.long_words))
        from ds2cli.weights.source import open_model
        no_eos = {str(e): -100 for e in open_model(model).config.eos_token_ids}   # the runner never stops early
        short = {"messages": [{"role": "user", "content": "What is 451 - 123?"}], "temperature": 0, "max_tokens": 8}
        results = {k: {"ttft": [], "gap": []} for k in (0, 1, 2)}
        for r in range(a.rounds):
            for k in (0, 1, 2):
                runner, ran = start(post, port, "/v1/completions",
                                    {"prompt": "Once upon a time", "max_tokens": 1 if a.no_runner else 400,
                                     "temperature": 0, "logit_bias": no_eos})
                time.sleep(1.0)                                   # it decodes before the others come
                # each long prompt new to the server (a prompt it has cached would cost nothing)
                longs = [start(post, port, "/v1/completions", {"prompt": f"Document {r}.{k}.{j}: {long_text}",
                                                                "max_tokens": 4, "temperature": 0})
                         for j in range(k)]
                time.sleep(0.3)
                t, s = start(post, port, "/v1/chat/completions", short)
                t.join()
                for lt, _ in longs:
                    lt.join()
                runner.join()
                ttft = s["times"][0] - s["sent"] if s.get("times") else float("nan")
                window = [x for x in ran.get("times", []) if x >= s["sent"] - 0.3]
                gap = max((b - c for c, b in zip(window, window[1:])), default=0.0)
                results[k]["ttft"].append(ttft)
                results[k]["gap"].append(gap)
                print(f"round {r + 1}, {k} long prompts: short chat's first token {ttft:.2f} s, "
                      f"the running stream's longest gap {gap:.2f} s", file=sys.stderr)
        print(f"model {model}, --ctx {a.ctx}, long prompts of {a.long_words} words; min / median / max of "
              f"{a.rounds} rounds")
        for k, v in results.items():
            print(f"  {k} long prompts: short chat's first token {spread(v['ttft'])} s; "
                  f"running stream's longest gap {spread(v['gap'])} s")
    finally:
        server.terminate()
        server.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
