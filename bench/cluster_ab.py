"""Two source trees side by side over a two-node Ray cluster: for each run, a fresh cluster of
two nodes on this machine inside a private network namespace (tests/support/ray_local.py: 127.0.0.1
only, ended by process group), every node and the driver importing ds2 from the run's tree, each
node offering --memory to ds2; step_times.py's decode figure over it, the trees alternately
(A B, then B A, ...), `--pairs` times. Prints min / median / max and the B / A ratios. Root only.

    python bench/cluster_ab.py A_TREE B_TREE MODEL [--pairs 5] [--memory 12G] [--steps 8]
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from support.ray_local import ADDRESS, Cluster   # noqa: E402  (the tests' cluster, reused)


def one_run(tree: str, model: str, memory: str, steps: int, context: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ds2-cluster-ab-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            cluster.env.update(PYTHONPATH=str(Path(tree).resolve()), DS2_MEMORY_AVAILABLE=memory)
            cluster.start_head()
            cluster.add_node(memory=memory)
            r = cluster.run([sys.executable, str(HERE / "step_times.py"), model, "--ray", ADDRESS, "--steps", str(steps),
                             "--context", str(context), "--prefill", "0", "--pass-tokens", "0"], timeout=3600,
                            cwd=tmp)    # Ray puts the driver's directory first on its workers' path:
                                        # a checkout's would shadow the tree's PYTHONPATH
            if r.returncode != 0:
                sys.exit(f"error: {tree}: {r.stderr.strip()[-2000:]}")
            return json.loads(r.stdout.strip().splitlines()[-1])
        finally:
            cluster.stop()


def spread(values: list[float]) -> str:
    return f"{min(values):.4f} / {statistics.median(values):.4f} / {max(values):.4f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("model")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--memory", default="12G", help="what each node offers ds2 (DS2_MEMORY_AVAILABLE)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    args = ap.parse_args()
    if Path(args.model).exists():          # the cluster's driver runs in a scratch folder
        args.model = str(Path(args.model).resolve())
    got = {"a": [], "b": []}
    for k in range(args.pairs):
        for side in (("a", "b") if k % 2 == 0 else ("b", "a")):
            got[side].append(one_run(getattr(args, side), args.model, args.memory, args.steps, args.context))
            print(f"pair {k + 1} {side}: {got[side][-1]}", file=sys.stderr)
    a = [r["decode_step_s"] for r in got["a"]]
    b = [r["decode_step_s"] for r in got["b"]]
    ratios = [y / x for x, y in zip(a, b)]
    print(f"{args.pairs} pairs over two nodes, A = {args.a}, B = {args.b}: decode step s min / median / max")
    print(f"A {spread(a)}  B {spread(b)}  B/A median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
