"""Two checkpoints' prefill and decode speed, side by side in one process.

A shared, noisy machine moves from minute to minute, so two figures taken apart say little. This
loads both checkpoints (memory-mapped), then alternates them round by round (ABBA order: the one
that goes second in a round goes first in the next), each round a prefill of --prompt random
tokens and --decode single-token steps after it, and reports min / median / max of each model's
tokens a second and of the per-round ratios B / A. The first round warms both and is not counted.

    python examples/side_by_side.py OLD NEW [--rounds 16] [--prompt 128] [--decode 48]

The README's recipe comparisons (old recipe against new, on the 4-layer V2-Lite slice) are this,
with OLD and NEW the two `ds2 quantize` outputs.
"""

import argparse
import statistics
import time

import numpy as np

import ds2cli


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="checkpoint A (the baseline)")
    ap.add_argument("b", help="checkpoint B")
    ap.add_argument("--rounds", type=int, default=16, help="rounds, the first not counted")
    ap.add_argument("--prompt", type=int, default=128, help="prefill tokens a round")
    ap.add_argument("--decode", type=int, default=48, help="decode steps a round, after the prefill")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.rounds < 2 or args.prompt < 1 or args.decode < 1:
        ap.error("--rounds must be at least 2, --prompt and --decode at least 1")
    models = [ds2cli.load(args.a), ds2cli.load(args.b)]
    vocab = min(m.config.vocab_size for m in models)
    rng = np.random.default_rng(args.seed)
    rates = [{"prefill": [], "decode": []} for _ in models]
    for r in range(args.rounds):
        ids = rng.integers(0, vocab, size=args.prompt + args.decode)
        for k in ((0, 1) if r % 2 == 0 else (1, 0)):
            m = models[k]
            cache = m.new_cache(args.prompt + args.decode)
            t = time.perf_counter()
            m.forward(ids[:args.prompt], cache)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            for s in range(args.decode):
                m.forward(ids[args.prompt + s:args.prompt + s + 1], cache)
            decode = time.perf_counter() - t
            if r > 0:
                rates[k]["prefill"].append(args.prompt / prefill)
                rates[k]["decode"].append(args.decode / decode)
    print(f"{args.rounds - 1} rounds, min / median / max (tok/s; ratio B / A of each round)")
    for phase in ("prefill", "decode"):
        a, b = rates[0][phase], rates[1][phase]
        ratios = [y / x for x, y in zip(a, b)]
        print(f"{phase:8s} A {spread(a)}   B {spread(b)}   B/A {spread(ratios)}")


if __name__ == "__main__":
    main()
