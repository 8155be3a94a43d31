"""Greedy decode of one model one way, with what it cost: STEPS greedy decode steps after a short
prompt ("Once upon a time there was a": 9 tokens with ds2-tiny's tokenizer, which the synthetic
V2-Lite shape ships), each step timed, written to OUT as JSON and summed up in one line on stdout.
TARGET says where the model runs:

    ADDRESS       over the Ray cluster there (`--ray ADDRESS`): each stage's resident and peak
                  resident bytes (VmRSS, VmHWM) asked of it after the steps
    local         this process, the model memory-mapped as ds2 generate runs it
    budget:SIZE   this process, the routed experts streamed from disk within SIZE
                  (`--memory-budget SIZE`): the bytes read a token and the seconds of reading,
                  and the disk's own rate for expert reads, measured after the steps

    python bench/cluster_target.py MODEL TARGET STEPS OUT

OUT's keys: `target`, `prompt_tokens`, `ids` (the tokens fed to the steps, each the greedy choice
of the pass before: two runs gave the same text when these are the same), `prefill_s`,
`step_s` (every step), `step_median_s` (the first step after the prompt left out),
`peak_rss_bytes` (this process's VmHWM and its helper processes' own pages), and `stages` (a
cluster) or `stream` (a budget). bench/stream_one.sh runs it in a memory cgroup; a memory-mapped
run over a limit the memory check refuses needs DS2_MEMORY_AVAILABLE set past the model.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import ds2cli
from ds2cli.weights import memory

PROMPT = "Once upon a time there was a"


def load(model: str, target: str, context: int):
    if target == "local":
        return ds2cli.load(model, context=context)
    if target.startswith("budget:"):
        return ds2cli.load(model, context=context, memory_budget=memory.parse_size(target.removeprefix("budget:")))
    return ds2cli.load(model, context=context, ray=target)


def own_peak_bytes() -> int:
    """This process's peak resident bytes (VmHWM), 0 where /proc is not there."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0


def decode(model, steps: int) -> tuple[dict, dict]:
    """The prompt in one pass, then `steps` greedy decode steps, each timed; and the executor's
    counts as the steps began (a streamed run's reads so far)."""
    prompt = model.tokenizer.encode(PROMPT)
    cache = model.new_cache(len(prompt) + steps)
    t0 = time.perf_counter()
    logits = model.forward(prompt, cache)
    prefill_s = time.perf_counter() - t0
    ids, step_s, counts = [], [], model.executor.stats()
    for _ in range(steps):
        ids.append(int(np.argmax(logits)))
        t0 = time.perf_counter()
        logits = model.forward([ids[-1]], cache)
        step_s.append(time.perf_counter() - t0)
    return {"prompt_tokens": len(prompt), "ids": ids, "prefill_s": prefill_s, "step_s": step_s,
            "step_median_s": statistics.median(step_s[1:] or step_s)}, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("target", help="a Ray cluster's ADDRESS, local, or budget:SIZE")
    ap.add_argument("steps", type=int)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    on_cluster = args.target != "local" and not args.target.startswith("budget:")
    # the prompt's tokens are at most its characters and a bos
    model = load(args.model, args.target, context=len(PROMPT) + 1 + args.steps)
    ex = model.executor
    try:
        figures, before = decode(model, args.steps)
        out = {"target": args.target, **figures}
        if on_cluster:
            out["stages"] = ex.passes.each("memory")
        elif "bytes_read" in before:
            after = ex.stats()
            out["stream"] = {"slots": after["slots"],
                             "bytes_read_per_token": (after["bytes_read"] - before["bytes_read"]) / args.steps,
                             "read_seconds_per_token": (after["read_seconds"] - before["read_seconds"]) / args.steps,
                             "disk_gb_per_s": ex.experts_part.disk_rate() / 1e9}
        out["peak_rss_bytes"] = own_peak_bytes() + ex.compute.helper_bytes()
    finally:
        ex.stop()
    args.out.write_text(json.dumps(out) + "\n")
    print(f"{args.target}: {len(out['ids'])} steps after {out['prompt_tokens']} tokens, step median "
          f"{out['step_median_s']:.3f} s (min {min(out['step_s']):.3f}, max {max(out['step_s']):.3f}), "
          f"peak RSS {out['peak_rss_bytes'] / 1e9:.2f} GB"
          + (f", {out['stream']['bytes_read_per_token'] / 1e6:.0f} MB read a token, the disk "
             f"{out['stream']['disk_gb_per_s']:.2f} GB/s" if "stream" in out else ""))


if __name__ == "__main__":
    main()
