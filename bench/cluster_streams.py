"""A cluster whose nodes stream their experts, against one process streaming the same model, side
by side (issue 59's targets). Each cluster run is a fresh Ray cluster on this machine inside a
private network namespace (tests/support/ray_local.py: 127.0.0.1 only, ended by process group):
a head that holds nothing (no CPU) and --nodes worker nodes, each in a cgroup-v1 memory cgroup
of its own held to --node-memory (page cache counted), offering ds2 what its cgroup admits and
--node-cpus CPUs (default: this machine's, as the one process has: each node stands for a
machine of its own, and by layers the nodes compute one after the other); the driver runs `ds2
generate --ray ... --json --stats` outside them (it holds no weights). Each one-process
run is `ds2 generate --memory-budget --one-budget --stats` in one cgroup of --one-limit. Runs
alternate (cluster, one; then one, cluster; ...) --pairs times, the page cache dropped before
each. First, the reference: one process, no limit, no budget, the same greedy text expected of
every run. Prints each run's decode tok/s (ds2's own figure, --json's), the cgroups' peaks and
oom_kill counts, the placement the cluster printed, and min / median / max with the ratio.

Root only (cgroups, unshare, drop_caches; DROP_CACHES=0 keeps the page cache). Ray's memory monitor is turned off on the nodes
(RAY_memory_monitor_refresh_ms=0): it kills a worker at 95% of its node's memory, and a streaming
stage fills what its node offers by design (docs/cluster.md). Object stores are 200 MB a node:
a pass moves hidden states of a few kB.

    python bench/cluster_streams.py MODEL [--nodes 2] [--node-memory 6G] [--one-limit 12G]
        [--one-budget 11G] [--tokens 16] [--pairs 3] [--spread layers] [--prompt TEXT]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from support.ray_local import ADDRESS, Cluster   # noqa: E402  (the tests' cluster, reused)

CGROUPS = Path("/sys/fs/cgroup/memory")
DS2 = [sys.executable, "-m", "ds2cli"]


def drop_caches() -> None:
    """The page cache dropped before a run (DROP_CACHES=0 keeps it: a test, or others measuring)."""
    if os.environ.get("DROP_CACHES", "1") == "0":
        return
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


class Group:
    """A v1 memory cgroup held to `limit` bytes, its peak and oom_kill count read after."""

    def __init__(self, name: str, limit: str):
        self.path = CGROUPS / f"ds2-bench-{name}-{os.getpid()}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(limit)

    def report(self) -> dict:
        oom = re.search(r"^oom_kill (\d+)", (self.path / "memory.oom_control").read_text(), re.M)
        return {"peak_bytes": int((self.path / "memory.max_usage_in_bytes").read_text()),
                "oom_kill": int(oom.group(1)) if oom else None}

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def result(r) -> tuple[str, float]:
    """The text and decode tok/s of a `ds2 generate --json` run."""
    try:
        out = json.loads(r.stdout)
    except ValueError:
        sys.exit(f"error: no JSON from ds2 generate: {r.stdout[-500:]} {r.stderr[-2000:]}")
    return out["text"], out["timings"]["decode_tok_per_s"]


def generate(args, *more: str) -> list[str]:
    return [*DS2, "generate", "-m", args.model, args.prompt, "-n", str(args.tokens), "--temperature", "0",
            "--ignore-eos", "--json", "--stats", *more]


def cluster_run(args) -> dict:
    drop_caches()
    with tempfile.TemporaryDirectory(prefix="ds2-cluster-streams-") as tmp:
        cluster = Cluster(Path(tmp))
        groups = [Group(f"node{i}", args.node_memory) for i in range(args.nodes)]
        try:
            cluster.env.update(RAY_memory_monitor_refresh_ms="0")
            cluster.start_head(cpus=0)
            for g in groups:
                cluster.add_node(memory=None, cgroup=str(g.path), extra=("--object-store-memory", "200000000"),
                                 cpus=args.node_cpus)
            r = cluster.run(generate(args, "--ray", ADDRESS, "--ray-spread", args.spread), timeout=3600, cwd=tmp)
            if r.returncode != 0:
                sys.exit(f"error: the cluster run failed: {r.stderr.strip()[-3000:]}")
            lines = r.stderr.splitlines()
            at = next(i for i, line in enumerate(lines) if line.startswith("placement of"))
            placement = [lines[at]] + [line for line in lines[at + 1:at + 1 + args.nodes] if line.startswith("  ")]
            text, rate = result(r)
            return {"text": text, "tok_per_s": rate, "placement": placement,
                    "stats": [line for line in r.stderr.splitlines() if "slots" in line],
                    "nodes": [g.report() for g in groups]}
        finally:
            cluster.stop()
            for g in groups:
                g.remove()


def one_run(args) -> dict:
    drop_caches()
    g = Group("one", args.one_limit)
    try:
        r = subprocess.run(["sh", "-c", f'echo $$ > {g.path}/cgroup.procs && exec "$@"', "sh",
                            *generate(args, "--memory-budget", args.one_budget)],
                           capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            sys.exit(f"error: the one-process run failed: {r.stderr.strip()[-3000:]}")
        text, rate = result(r)
        return {"text": text, "tok_per_s": rate, "one": g.report()}
    finally:
        g.remove()


def spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--node-memory", default="6G", help="each node's memory cgroup limit")
    ap.add_argument("--node-cpus", type=int, default=os.cpu_count(), help="the CPUs each node offers")
    ap.add_argument("--one-limit", default="12G", help="the one process's memory cgroup limit")
    ap.add_argument("--one-budget", default="11G", help="the one process's --memory-budget")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--spread", choices=("layers", "experts"), default="layers")
    ap.add_argument("--prompt", default="The capital of France is")
    args = ap.parse_args()
    if Path(args.model).exists():          # the cluster's driver runs in a scratch folder
        args.model = str(Path(args.model).resolve())
    reference = subprocess.run(generate(args), capture_output=True, text=True, timeout=3600)
    if reference.returncode != 0:
        sys.exit(f"error: the reference run failed: {reference.stderr.strip()[-3000:]}")
    reference_text = result(reference)[0]
    print(f"reference (one process, no limit): {reference_text!r}", file=sys.stderr)
    got = {"cluster": [], "one": []}
    for k in range(args.pairs):
        for side in (("cluster", "one") if k % 2 == 0 else ("one", "cluster")):
            run = cluster_run(args) if side == "cluster" else one_run(args)
            run["same_text"] = run["text"] == reference_text
            got[side].append(run)
            print(f"pair {k + 1} {side}: " + json.dumps({key: v for key, v in run.items() if key != "text"}),
                  file=sys.stderr)
    c = [r["tok_per_s"] for r in got["cluster"]]
    o = [r["tok_per_s"] for r in got["one"]]
    ratios = [x / y for x, y in zip(c, o)]
    print("\n".join(got["cluster"][0]["placement"]))
    print(f"{args.pairs} pairs, {args.tokens} greedy tokens: decode tok/s min / median / max")
    print(f"cluster of {args.nodes} x {args.node_memory} bytes, {args.node_cpus} CPUs each: {spread(c)}")
    print(f"one process, --memory-budget {args.one_budget} in {args.one_limit}: {spread(o)}")
    print(f"cluster / one: median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    print(f"text as the reference: cluster {all(r['same_text'] for r in got['cluster'])}, "
          f"one {all(r['same_text'] for r in got['one'])}; nodes' oom_kill "
          f"{[n['oom_kill'] for r in got['cluster'] for n in r['nodes']]}, peaks GB "
          f"{[round(n['peak_bytes'] / 1e9, 2) for r in got['cluster'] for n in r['nodes']]}")


if __name__ == "__main__":
    main()
