"""A cluster that heals, timed (issue 62's targets): a node SIGKILLed mid-reply, the reply's text
against one process's, and the healing time against what it is bounded by: loading the moved
layers plus re-reading their share of the context.

Each run is a fresh Ray cluster on this machine inside a private network namespace
(tests/support/ray_local.py: 127.0.0.1 only, ended by process group): a head that holds nothing
and --nodes worker nodes offering --node-memory each (DS2_MEMORY_AVAILABLE) and --node-cpus CPUs.
The driver, outside them, runs `ds2 generate --ray ...` on a prompt of about --context tokens;
--kill-after seconds after the reply's first byte the --lose'th node (0-based, in the order they
joined) dies as a machine that loses power (its processes SIGKILLed). ds2 says on stderr what it
lost, what moved and how long healing took (from the loss met to the pass run again); the
script notes when that line came, so "noticed" = kill to line, minus healing. With --serve the
driver is `ds2 serve --ray ...` instead, and a client in the namespace streams the same greedy
completion (/v1/completions) from it; the reference is then one process's server answering the
same request, and the stream must end with no error event, finish_reason "length" and /health
"ok" after.

The bound, measured right after each run on this machine in a fresh process (the page cache as
the cluster left it): the moved layers loaded alone (ds2cli.load(layers=...); and from the
process's start, as a moved stage is a new process), then their share
of the context re-read: Model.compute over those layers alone for the context's positions, in
the prefill's chunks (a hidden state of the right shape as input). Healing also recomputes the
layers before a moved range into a scratch cache where the stage before it did not keep its
output (the moved layers' input) for each position; that part is reported apart as "before". With --spread experts the lost node also held a range
of every MoE layer's routed experts: the bound's load is its layers with that range, and the
re-read its layers' whole computation (every expert, as the cluster computes them). The
re-read is given twice: a fresh process's first pass and its best of three after. And at the
cluster's own rate: the run's prompt prefill (--stats, or with --serve the server's /metrics:
the first pass over every stage, with the hops between them) gives seconds a position for all the layers; the moved layers' share of
it, times the positions rebuilt, is the re-read as the cluster itself computes.

Root only (unshare, nsenter). Prints each run as JSON on stderr, then min / median / max.

    python bench/cluster_heal.py MODEL [--nodes 3] [--node-memory 8G] [--node-cpus 2]
        [--lose 1] [--context 200] [--tokens 40] [--kill-after 8] [--runs 3] [--spread layers] [--serve]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from support.ray_local import ADDRESS, Cluster   # noqa: E402  (the tests' cluster, reused)

DS2 = [sys.executable, "-m", "ds2cli"]
HEALED = re.compile(r"lost (.*): its layers(?: and experts)? moved to the nodes left"
                    r"(?: and (\d+) cached positions of .* rebuilt)? in ([0-9.]+) s \(([0-9.]+) s loading, "
                    r"([0-9.]+) s rebuilding\)")
LAYERS = re.compile(r"\(layers (\d+)-(\d+)")
EXPERTS = re.compile(r"experts (\d+)-(\d+)\)")
PREFILL = re.compile(r"prefill (\d+) tok, ([0-9.]+) tok/s")          # --stats' line

BOUND = r"""
import json, sys, time
import numpy as np
import ds2cli
from ds2cli.model.cache import LatentCache
from ds2cli.model.passes import Pass
path, first, stop, context, spawned = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
experts = range(int(sys.argv[6]), int(sys.argv[7])) if len(sys.argv) > 6 else None
t0 = time.perf_counter()
model = ds2cli.load(path, layers=range(first, stop), memory_check=False, context=context, experts=experts)
load_s, started_s = time.perf_counter() - t0, time.time() - spawned
if experts is not None:      # by experts: what moved loaded above; the re-read is its layers' whole computation
    del model
    model = ds2cli.load(path, layers=range(first, stop), memory_check=False, context=context)
cfg = model.config
rng = np.random.default_rng(0)
def reread(layers):
    cache = LatentCache(cfg.num_hidden_layers, context, cfg.kv_lora_rank, cfg.qk_rope_head_dim, layers=layers)
    t0 = time.perf_counter()
    for at in range(0, context, model.prefill_chunk):
        n = min(context, at + model.prefill_chunk) - at
        ids = rng.integers(cfg.vocab_size, size=n)
        x = None if layers.start == 0 else rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)
        model.compute(Pass(ids, [n], [at], [0], [cache]), layers, x)
    return time.perf_counter() - t0
first_s = reread(range(first, stop))     # a fresh process's first pass (what a new stage pays); then the best of 3
print(json.dumps({"load_s": load_s, "started_s": started_s, "first_reread_s": first_s,
                  "reread_s": min(reread(range(first, stop)) for _ in range(3))}))
"""


CLIENT = r"""
import json, sys, urllib.request
base, prompt, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, sys.argv[4])
from support.sse import events, healthy
healthy(base, 1800)                             # a 27-layer model loading over a cluster
body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                   "stream": True}).encode()
req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
finish, errors = None, []
with urllib.request.urlopen(req, timeout=3600) as r:
    for event in events(r):
        if "error" in event:
            errors.append(event)
            continue
        choice = event["choices"][0]
        sys.stdout.write(choice.get("text") or "")
        sys.stdout.flush()
        finish = choice.get("finish_reason") or finish
metrics = urllib.request.urlopen(base + "/metrics", timeout=60).read().decode()
health = json.load(urllib.request.urlopen(base + "/health", timeout=60))["status"]
sample = lambda name: float(next(l.split()[-1] for l in metrics.splitlines() if l.startswith(name + " ")))
print(json.dumps({"finish": finish, "errors": errors, "health": health,
                  "prefill": [sample("ds2_prompt_tokens_total"), sample("ds2_prefill_seconds_total")]}),
      file=sys.stderr)
"""
SERVE_PORT = 8790     # the cluster's server, inside its network namespace; one process's beside it outside


def prompt_of(context: int) -> str:
    """A text of about `context` tokens (numbers read as one token or two each)."""
    return " ".join(str(i) for i in range(context // 2))


def generate(args) -> list[str]:
    return [*DS2, "generate", "-m", args.model, prompt_of(args.context), "-n", str(args.tokens), "--temperature",
            "0", "--ignore-eos"]


def cluster_generate(args) -> list[str]:
    return [*generate(args), "--ray", ADDRESS, "--ray-spread", args.spread, "--stats"]


def serve(args, port: int, *ray: str) -> list[str]:
    return [*DS2, "serve", "-m", args.model, "--port", str(port), *ray]


def client(port: int, args) -> list[str]:
    return [sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", prompt_of(args.context), str(args.tokens),
            str(HERE.parent / "tests")]


def stream_ended(client_err: str) -> dict:
    """The client's last line, checked: the stream ended at its length with no error event, and
    the server says ok after."""
    try:
        end = json.loads(client_err.strip().splitlines()[-1])
    except (IndexError, ValueError):
        sys.exit(f"error: the client failed: {client_err[-3000:]}")
    if end["errors"] or end["finish"] != "length" or end["health"] != "ok":
        sys.exit(f"error: the stream did not end as a run that lost nothing: {json.dumps(end)[:3000]}")
    return end


def reference_text(args) -> str:
    """One process's greedy text for the same request: `ds2 generate`, or with --serve its server."""
    if not args.serve:
        r = subprocess.run(generate(args), capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            sys.exit(f"error: the reference run failed: {r.stderr.strip()[-3000:]}")
        return r.stdout
    port = SERVE_PORT + 1
    server = subprocess.Popen(serve(args, port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
    try:
        r = subprocess.run(client(port, args), capture_output=True, text=True, timeout=3600)
    finally:
        server.terminate()
        _, err = server.communicate(timeout=60)
    if r.returncode != 0:
        sys.exit(f"error: the reference server's stream failed: {r.stderr[-2000:]} {err.decode()[-2000:]}")
    stream_ended(r.stderr)
    return r.stdout


def cluster_run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="ds2-cluster-heal-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            cluster.env.update(RAY_memory_monitor_refresh_ms="0")
            cluster.start_head(cpus=0)
            nodes = [cluster.add_node(memory=args.node_memory, extra=("--object-store-memory", "200000000"),
                                      cpus=args.node_cpus) for _ in range(args.nodes)]
            if args.serve:      # ds2's lines come from the server, the text from a client streaming it
                server = cluster.popen(serve(args, SERVE_PORT, "--ray", ADDRESS, "--ray-spread", args.spread),
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp)
                p = cluster.popen(client(SERVE_PORT, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp)
            else:
                server = p = cluster.popen(cluster_generate(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           cwd=tmp)
            lines: list[tuple[float, str]] = []
            reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), raw.decode(errors="replace"))
                                                                  for raw in server.stderr), daemon=True)
            reader.start()
            first = p.stdout.read(1)
            if not first:
                p.wait(timeout=600)
                if server is not p:
                    server.terminate()
                reader.join(10)
                sys.exit("error: the cluster run failed: " + "".join(line for _, line in lines)[-3000:]
                         + p.stderr.read().decode(errors="replace")[-2000:])
            time.sleep(args.kill_after)
            killed = time.monotonic()
            cluster.kill(nodes[args.lose])
            rest = p.stdout.read()
            p.wait(timeout=3600)
            ended = None
            if server is not p:
                ended = stream_ended(p.stderr.read().decode(errors="replace"))
                server.terminate()
                server.wait(timeout=60)
            reader.join(30)
            err = "".join(line for _, line in lines)
            if p.returncode != 0:
                sys.exit(f"error: the cluster run failed: {err[-3000:]}")
            at, said = next(((t, line) for t, line in lines if HEALED.search(line)), (None, None))
            if said is None:
                sys.exit(f"error: the cluster did not heal: {err[-3000:]}")
            m = HEALED.search(said)
            first_layer, last_layer = map(int, LAYERS.search(m.group(1)).groups())
            experts = EXPERTS.search(m.group(1))
            # the cluster's own prompt: its seconds a position, every layer (its first pass)
            prefill = (ended["prefill"][1] / ended["prefill"][0] if ended is not None
                       else 1 / float(PREFILL.search(err).group(2)))
            return {"text": (first + rest).decode(errors="replace"), "heal_s": float(m.group(3)),
                    "loading_s": float(m.group(4)), "rebuilding_s": float(m.group(5)),
                    "noticed_s": at - killed - float(m.group(3)), "rebuilt": int(m.group(2) or 0),
                    "moved": [first_layer, last_layer + 1],
                    "prefill_s_a_position": prefill,
                    "experts": None if experts is None else [int(experts.group(1)), int(experts.group(2)) + 1],
                    "placement": [line.rstrip() for _, line in lines[lines.index((at, said)) + 1:]
                                  if line.startswith("  ") and " needs " in line]}
        finally:
            cluster.stop()


def bound(args, moved: list[int], experts: list[int] | None = None) -> dict:
    """The moved layers loaded alone (spread by experts, with the moved share of every MoE layer's
    routed experts), their share of the context re-read; and the layers before them re-read
    (what healing also pays, computing their output for the moved layers)."""
    def one(first: int, stop: int, share: list[int] | None = None) -> dict:
        r = subprocess.run([sys.executable, "-c", BOUND, args.model, str(first), str(stop), str(args.context),
                            str(time.time()), *map(str, share or ())],
                           capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            sys.exit(f"error: the bound's run failed: {r.stderr[-3000:]}")
        return json.loads(r.stdout.splitlines()[-1])
    own = one(*moved, experts)
    before = one(0, moved[0])["reread_s"] if moved[0] > 0 else 0.0
    return {"load_s": own["load_s"], "started_s": own["started_s"], "reread_s": own["reread_s"],
            "first_reread_s": own["first_reread_s"], "before_s": before}


def share(run: dict, first: int, stop: int) -> float:
    """Seconds the cluster's own prefill rate gives layers [first, stop) for the positions rebuilt."""
    return run["prefill_s_a_position"] * run["rebuilt"] * (stop - first) / run["layers"]


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--node-memory", default="8000000000", help="bytes each node offers ds2")
    ap.add_argument("--node-cpus", type=int, default=os.cpu_count())
    ap.add_argument("--lose", type=int, default=1, help="the node killed, 0-based in the order they joined")
    ap.add_argument("--context", type=int, default=200, help="about this many prompt tokens")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--kill-after", type=float, default=8.0, help="seconds after the reply's first byte")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--spread", choices=["layers", "experts"], default="layers", help="as --ray-spread")
    ap.add_argument("--serve", action="store_true", help="a stream from `ds2 serve --ray` instead of generate")
    args = ap.parse_args()
    if Path(args.model).exists():          # the cluster's driver runs in a scratch folder
        args.model = str(Path(args.model).resolve())
    from ds2cli.weights.source import open_model
    layers = open_model(args.model).config.num_hidden_layers
    reference = reference_text(args)
    runs = []
    for k in range(args.runs):
        run = cluster_run(args)
        run["same_text"] = run.pop("text") == reference
        run["layers"] = layers
        run.update(bound(args, run["moved"], run["experts"]))
        runs.append(run)
        print(f"run {k + 1}: " + json.dumps(run), file=sys.stderr)
    print("\n".join(runs[0]["placement"]))
    print(f"{args.runs} runs{' (ds2 serve, a stream)' if args.serve else ''}, {args.nodes} nodes spread by {args.spread}, node {args.lose} killed {args.kill_after:.0f} s into a "
          f"{args.tokens}-token reply to about {args.context} tokens; seconds min / median / max")
    print(f"healing (loss met to the pass run again): {spread([r['heal_s'] for r in runs])}; of which the moved "
          f"shares planned and loaded {spread([r['loading_s'] for r in runs])}, the caches rebuilt "
          f"{spread([r['rebuilding_s'] for r in runs])}")
    print(f"  bound: the moved layers loaded {spread([r['load_s'] for r in runs])} (a new process started, "
          f"ds2 imported and they loaded: {spread([r['started_s'] for r in runs])}) + their share of the context "
          f"re-read {spread([r['reread_s'] for r in runs])} = {spread([r['load_s'] + r['reread_s'] for r in runs])} "
          f"({spread([r['started_s'] + r['reread_s'] for r in runs])})")
    print(f"  at the cluster's own prefill rate (its prompt's, first pass, every stage): the moved layers' share of "
          f"the positions rebuilt {spread([share(r, *r['moved']) for r in runs])}, the layers before them "
          f"{spread([share(r, 0, r['moved'][0]) for r in runs])}; load + moved share "
          f"{spread([r['load_s'] + share(r, *r['moved']) for r in runs])}, + before "
          f"{spread([r['load_s'] + share(r, 0, r['moved'][1]) for r in runs])}")
    print(f"  the same re-read as a fresh process's first pass: {spread([r['first_reread_s'] for r in runs])}; "
          f"load + first re-read {spread([r['load_s'] + r['first_reread_s'] for r in runs])}")
    print(f"  the layers before them re-read (healing's input for them only where the stage before did not keep "
          f"it): {spread([r['before_s'] for r in runs])}")
    print(f"noticed (kill to healing begun): {spread([r['noticed_s'] for r in runs])}")
    print(f"positions rebuilt {[r['rebuilt'] for r in runs]}; text as one process's: "
          f"{all(r['same_text'] for r in runs)}")


if __name__ == "__main__":
    main()
