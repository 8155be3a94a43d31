"""A driver the cluster-streams tests run inside the namespace: MODEL (a low-bit checkpoint) over
the cluster at ADDRESS with every node streaming its routed experts within BUDGET bytes, spread
by SPREAD; the ids of IDS.npy fed in one pass, in chunks then decode steps, and as a batched
pass; the logits, the placement's lines and each node's streaming counts written to OUT.npz.
With --truncate FILE: after those passes FILE is cut to its first 4 kB and one more pass runs
on new tokens, whose error (its class and message) is written instead of logits.
Usage: drive_streamed.py [--truncate FILE] ADDRESS OUT MODEL BUDGET SPREAD IDS.npy"""

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import run_split, splits               # noqa: E402  (tests/conftest.py)
from ds2cli.cluster import driver                   # noqa: E402
from ds2cli.errors import Ds2Error                  # noqa: E402
from ds2cli.execution.factory import cluster_model  # noqa: E402
from ds2cli.model.transformer import Step           # noqa: E402
from ds2cli.weights.source import open_model        # noqa: E402


def main(address: str, out: str, path: str, budget: int, spread: str, ids_file: str, truncate: str | None) -> None:
    ids = np.load(ids_file)
    model = cluster_model(open_model(path), address, spread=spread, memory_budget=budget)
    passes = model.executor.passes
    results = {"placement": np.array("\n".join(driver.describe(open_model(path), passes.placement)))}
    for split in ("all_at_once", "two_chunks_then_decode"):
        results[split] = run_split(model, ids, splits(len(ids))[split])
    half = len(ids) // 2
    a, b = model.new_cache(len(ids)), model.new_cache(len(ids))
    results["batch_a"], results["batch_b"] = model.forward_batch([Step(ids[:half], a, "all"), Step(ids, b, "all")])
    results["stats"] = np.array(json.dumps(model.executor.stats()))
    if truncate is not None:
        os.truncate(truncate, 4096)
        try:
            model.forward(ids[::-1].copy(), model.new_cache(len(ids)))
            results["error"] = np.array("none")
        except Ds2Error as e:
            results["error"] = np.array(f"{type(e).__name__}: {e}")
    model.executor.stop()
    np.savez(out, **results)


if __name__ == "__main__":
    args = sys.argv[1:]
    cut = None
    if args[0] == "--truncate":
        cut, args = args[1], args[2:]
    main(args[0], args[1], args[2], int(args[3]), args[4], args[5], cut)
