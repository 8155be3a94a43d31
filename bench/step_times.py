"""One process's speed figures for a model, as JSON on stdout: the decode step after a prompt of
--context tokens, a prefill of --prefill tokens, a pass of --pass-tokens tokens (a draft's
verification), each the median of --repeats after one untimed run. ab.py runs it alternately in
two source trees (PYTHONPATH) to compare them side by side.

    python bench/step_times.py MODEL [--context 128] [--steps 16] [--prefill 512]
        [--pass-tokens 4] [--repeats 5] [--memory-budget BYTES] [--quantize 8] [--ray ADDRESS]
"""

import argparse
import json
import statistics
import sys
import time

import numpy as np

import ds2cli


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cluster_model(path, address: str, context: int):
    """The model over the cluster at `address`, through whichever API this tree has (ds2cli.load's
    `ray=` since the execution parts; cluster.driver.load before)."""
    try:
        return ds2cli.load(path, context=context, ray=address)
    except TypeError:
        from ds2cli.cluster import driver
        from ds2cli.weights.source import open_model
        return driver.load(open_model(path), address, context=context)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="a checkpoint (default: ds2-tiny)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed")
    ap.add_argument("--prefill", type=int, default=512, help="0: no prefill figure")
    ap.add_argument("--pass-tokens", type=int, default=4, help="0: no few-token pass figure")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--memory-budget", type=int, default=None)
    ap.add_argument("--quantize", type=int, choices=(4, 8), default=None, help="quantize as it loads")
    ap.add_argument("--ray", default=None, metavar="ADDRESS", help="the model over this Ray cluster")
    args = ap.parse_args()
    kwargs = {} if args.memory_budget is None else {"memory_budget": args.memory_budget}
    if args.quantize:
        kwargs["quantize"] = args.quantize
    context = args.context + args.steps + max(args.prefill, 64)
    model = cluster_model(args.model, args.ray, context) if args.ray else ds2cli.load(args.model, context=context, **kwargs)
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    out = {}
    cache = model.new_cache(args.context + args.steps + 1)
    model.forward(rng.integers(V, size=args.context), cache)
    model.forward(rng.integers(V, size=1), cache)                     # untimed
    steps = [timed(lambda: model.forward(rng.integers(V, size=1), cache)) for _ in range(args.steps)]
    out["decode_step_s"] = statistics.median(steps)
    if args.prefill:
        runs = [timed(lambda: model.forward(rng.integers(V, size=args.prefill), model.new_cache(args.prefill)))
                for _ in range(args.repeats + 1)][1:]
        out[f"pp{args.prefill}_s"] = statistics.median(runs)
    if args.pass_tokens:
        base = model.new_cache(args.context + args.pass_tokens)
        model.forward(rng.integers(V, size=args.context), base)
        runs = []
        for _ in range(args.repeats + 1):
            base.truncate(args.context)
            runs.append(timed(lambda: model.forward(rng.integers(V, size=args.pass_tokens), base, all_logits=True)))
        out[f"pass{args.pass_tokens}_s"] = statistics.median(runs[1:])
    model.executor.stop()
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
