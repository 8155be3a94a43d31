"""A driver the cluster tests run inside the namespace: each reference case over the cluster at
ADDRESS, fed in one pass and in chunks then decode steps and as a
batched pass of two sequences, the logits written to OUT.npz for the test to hold against the
reference; spread by experts (--spread=experts first), also what one decode step's expert calls
were. Usage: drive.py [--spread=experts] ADDRESS OUT CASE_DIR..."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import run_split, splits               # noqa: E402  (tests/conftest.py)
from ds2cli.cluster import driver                   # noqa: E402
from ds2cli.execution.factory import cluster_model  # noqa: E402
from ds2cli.model.transformer import Step           # noqa: E402
from ds2cli.weights.source import open_model        # noqa: E402


def main(address: str, out: str, cases: list[str], spread: str = "layers") -> None:
    results = {}
    for case in cases:
        ids = np.load(Path(case) / "ref.npz")["ids"]
        model = cluster_model(model_source(case), address, spread=spread)
        passes = model.executor.passes                  # the RayPasses part: stages, traffic
        name = Path(case).name
        results[f"{name}/stages"] = np.array(len(passes.stages))
        for split in ("all_at_once", "two_chunks_then_decode"):
            results[f"{name}/{split}"] = run_split(model, ids, splits(len(ids))[split])
        # a batched pass: the first half of ids beside the whole, each in its own cache
        half = len(ids) // 2
        a, b = model.new_cache(len(ids)), model.new_cache(len(ids))
        la, lb = model.forward_batch([Step(ids[:half], a, "all"), Step(ids, b, "all")])
        results[f"{name}/batch_a"], results[f"{name}/batch_b"] = la, lb
        # one more decode step, and the expert calls, bytes and passes it made
        before = dict(passes.traffic)
        model.forward(ids[half:half + 1], a)
        results[f"{name}/step"] = np.array([passes.traffic[k] - before[k]
                                            for k in ("passes", "calls", "expert_calls", "expert_bytes")])
        results[f"{name}/placement"] = np.array("\n".join(driver.describe(model_source(case), passes.placement)))
        model.executor.stop()
    np.savez(out, **results)


def model_source(case: str):
    return open_model(Path(case) / "model" if (Path(case) / "model").is_dir() else
                      case if (Path(case) / "config.json").is_file() else None)


if __name__ == "__main__":
    args = sys.argv[1:]
    spread = args.pop(0).split("=", 1)[1] if args[0].startswith("--spread=") else "layers"
    main(args[0], args[1], args[2:], spread)
