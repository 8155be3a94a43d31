"""Two ways of running decode side by side on a machine doing other things (issue 61's busy-machine
and draft targets): `--busy N` programs each keep a core busy (a Python loop; `--nice K` runs
them niced) while `ds2 generate ... --json` runs A, then B, then B, then A, ... for --pairs
pairs; each run's decode tok/s (ds2's own figure) and A / B pair by pair, min / median / max.
A and B are ds2 generate's options, as one string each (default: A none, B `--threads 1`,
so A / B is the default against one thread, the ratio the target names).

    python bench/busy.py [MODEL] [--a ""] [--b "--threads 1"] [--busy 1] [--nice 0] [--pairs 6]
        [--tokens 128] [--prompt TEXT]
"""

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time

DS2 = [sys.executable, "-m", "ds2cli"]


def decode_rate(args, options: str) -> float:
    cmd = [*DS2, "generate", *(["-m", args.model] if args.model else []), args.prompt, "-n", str(args.tokens),
           "--temperature", "0", "--ignore-eos", "--json", *shlex.split(options)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"error: {shlex.join(cmd)} failed: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout)["timings"]["decode_tok_per_s"]


def spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="a checkpoint (default: ds2-tiny)")
    ap.add_argument("--a", default="", help="ds2 generate options of A (default: none)")
    ap.add_argument("--b", default="--threads 1", help="ds2 generate options of B")
    ap.add_argument("--busy", type=int, default=1, help="busy loops beside the runs (0: quiet)")
    ap.add_argument("--nice", type=int, default=0, help="the busy loops' niceness")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", default="Once upon a time")
    args = ap.parse_args()
    loops = [subprocess.Popen(["nice", "-n", str(args.nice), sys.executable, "-c", "while 1: pass"])
             for _ in range(args.busy)]
    try:
        time.sleep(0.5)
        a, b = [], []
        for k in range(args.pairs):
            for side in ("ab" if k % 2 == 0 else "ba"):
                (a if side == "a" else b).append(decode_rate(args, args.a if side == "a" else args.b))
            print(f"pair {k + 1}: A {a[-1]:.2f} tok/s, B {b[-1]:.2f} tok/s, A / B {a[-1] / b[-1]:.3f}", file=sys.stderr)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    ratios = [x / y for x, y in zip(a, b)]
    beside = f"beside {args.busy} busy loop{'s' * (args.busy != 1)}" + (f" (nice {args.nice})" if args.nice else "") \
        if args.busy else "quiet"
    print(f"{args.pairs} pairs, {args.tokens} tokens, {beside}; decode tok/s min / median / max")
    print(f"A ({args.a or 'default'}): {spread(a)}")
    print(f"B ({args.b or 'default'}): {spread(b)}")
    print(f"A / B: median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}); "
          f"pairs {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
