"""Two source trees side by side: step_times.py run in each, alternately (A B, then B A, ...), as
separate processes, `--pairs` times; prints each figure's min / median / max for both and the
median and range of the per-pair ratios B / A (above 1: B takes longer). The trees are two
checkouts of ds2 (say the commit before a change and after it), given as paths; the model and
step_times.py's options follow `--`.

    python bench/ab.py A_TREE B_TREE [--pairs 5] [--prefix 'nice -n 0'] -- MODEL [options]
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(tree: str, args: list[str], prefix: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    r = subprocess.run([*prefix, sys.executable, str(HERE / "step_times.py"), *args], env=env,
                       capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"error: {tree}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{min(values):.4f} / {statistics.median(values):.4f} / {max(values):.4f}"


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--prefix", default="", help="a command the runs go through (a cgroup's, say)")
    args = ap.parse_args(argv)
    prefix = shlex.split(args.prefix)
    got = {"a": [], "b": []}
    for k in range(args.pairs):
        order = ("a", "b") if k % 2 == 0 else ("b", "a")
        for side in order:
            got[side].append(run(getattr(args, side), rest, prefix))
            print(f"pair {k + 1} {side}: {got[side][-1]}", file=sys.stderr)
    print(f"{args.pairs} pairs, A = {args.a}, B = {args.b}: seconds min / median / max; B / A per pair")
    for key in got["a"][0]:
        a = [r[key] for r in got["a"]]
        b = [r[key] for r in got["b"]]
        ratios = [y / x for x, y in zip(a, b)]
        print(f"{key:>16}  A {spread(a)}  B {spread(b)}  B/A median {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
