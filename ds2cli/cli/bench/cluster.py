"""`ds2 bench --ray`: prefill and decode over a Ray cluster, with what the passes sent between
the nodes. The single-process probes and per-format accounting need the weights in this
process, which a cluster's driver does not hold: this report is the speeds, the placement and
the traffic."""

from __future__ import annotations

import time

import numpy as np

from ds2cli.cli import console
from ds2cli.cli.bench.measure import fill_cache
from ds2cli.cli.bench.report import bench_table
from ds2cli.cli.bench.settings import cache_tokens
from ds2cli.cli.bench.timing import seconds, summary
from ds2cli.execution.factory import cluster_model
from ds2cli.weights import memory
from ds2cli.weights.source import Source
from ds2cli.wording import plural


def run_cluster_bench(source: Source, address: str, repeats: int, prompt_lengths: list[int],
                      contexts: list[int], steps: int, quantize: int | None, spread: str = "layers",
                      memory_budget: int | None = None) -> dict:
    """Prefill and decode over the cluster at `address`; where nodes stream their routed experts
    (the placement's, or every node within `memory_budget`), each node's reads a decode token."""
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    model = cluster_model(source, address, quantize, cache_tokens(prompt_lengths, contexts, steps), show=console.info,
                          spread=spread, memory_budget=memory_budget)
    load_s = time.perf_counter() - t0
    ex, V = model.executor.passes, model.config.vocab_size
    warm = min(prompt_lengths)      # one untimed pass first, as llama-bench does
    model.forward(rng.integers(V, size=warm), model.new_cache(warm))
    prefill = []
    for tokens in prompt_lengths:
        console.info(f"prefill {tokens} tokens x {repeats}")
        samples = [tokens / seconds(lambda: model.forward(rng.integers(V, size=tokens), model.new_cache(tokens)))
                   for _ in range(repeats)]
        prefill.append({"tokens": tokens, "tok_per_s": summary(samples)})
    cache = model.new_cache(max(contexts) + steps)
    decode = []
    for context in sorted(contexts):
        console.info(f"fill the cache to {context} tokens, then decode {steps} x {repeats}")
        fill_cache(model, cache, rng.integers(V, size=context))
        samples, before, reads = [], dict(ex.traffic), ex.stats()
        for _ in range(repeats):
            cache.truncate(context)
            t = time.perf_counter()
            for token in rng.integers(V, size=steps):
                model.forward(token[None], cache)
            samples.append(steps / (time.perf_counter() - t))
        sent = {k: (ex.traffic[k] - before[k]) / (steps * repeats)
                for k in ("calls", "bytes", "seconds", "expert_calls", "expert_bytes", "expert_seconds")}
        decode.append({"context": context, "tok_per_s": summary(samples), "per_token": sent,
                       **({"streamed": node_reads(reads, ex.stats(), steps * repeats)} if reads else {})})
    ex.stop()
    cfg = model.config
    return {"model": {"path": str(source.path), "num_hidden_layers": cfg.num_hidden_layers,
                      "format": memory.label(model.quantization)},
            "cluster": {"address": address, "spread": spread, "placement": ex.placement.to_json()},
            "settings": {"repeats": repeats, "prompt_lengths": prompt_lengths, "contexts": contexts,
                         "decode_steps": steps},
            "load_s": load_s, "prefill": prefill, "decode": decode}


def node_reads(before: dict, after: dict, tokens: int) -> list[dict]:
    """Each streaming node's reads over `tokens` decode steps: bytes from disk a token, the
    share of its experts found in its slots, the share of its reads ahead a step then used."""
    out = []
    for b, a in zip(before["nodes"], after["nodes"]):
        d = {k: a[k] - b[k] for k in ("hits", "misses", "read_ahead", "read_ahead_used", "bytes_read", "read_seconds")}
        out.append({"node": a["node"], "slots": a["slots"], "bytes_read_per_token": d["bytes_read"] / tokens,
                    "hit_rate": d["hits"] / max(1, d["hits"] + d["misses"]),
                    "read_ahead_used": d["read_ahead_used"] / max(1, d["read_ahead"]),
                    "read_seconds_per_token": d["read_seconds"] / tokens})
    return out


def render_cluster(report: dict, console_) -> None:
    m, stages = report["model"], report["cluster"]["placement"]
    by_experts = report["cluster"].get("spread") == "experts"
    t = bench_table(f"ds2 bench over {plural(len(stages), 'node')}{' by experts' if by_experts else ''}: "
                    f"{plural(m['num_hidden_layers'], 'layer')}, {m['format']}",
                    "per token: the actor calls a decode step makes, the bytes of hidden states and logits "
                    "they move, and the seconds the driver waits for them (the whole step)"
                    + ("; expert calls: the stages' calls for the experts other nodes hold, the bytes of "
                       "hidden rows sent and outputs received, and the seconds the stages waited for them "
                       "after computing their own" if by_experts else ""))
    columns = ["test", "tok/s min", "median", "max", "calls", "bytes", "wait s"]
    columns += ["expert calls", "expert bytes", "expert wait s"] if by_experts else []
    for column in columns:
        t.add_column(column, justify="left" if column == "test" else "right")
    blank = [""] * (len(columns) - 4)
    for p in report["prefill"]:
        s = p["tok_per_s"]
        t.add_row(f"pp{p['tokens']}", f"{s['min']:.1f}", f"{s['median']:.1f}", f"{s['max']:.1f}", *blank)
    for d in report["decode"]:
        s, sent = d["tok_per_s"], d["per_token"]
        experts = [f"{sent['expert_calls']:.1f}", f"{sent['expert_bytes'] / 1e3:.0f} kB",
                   f"{sent['expert_seconds']:.3f}"] if by_experts else []
        t.add_row(f"tg after {d['context']}", f"{s['min']:.2f}", f"{s['median']:.2f}", f"{s['max']:.2f}",
                  f"{sent['calls']:.0f}", f"{sent['bytes'] / 1e3:.0f} kB", f"{sent['seconds']:.3f}", *experts)
    console_.print(t)
    for d in report["decode"]:
        for n in d.get("streamed", []):
            console_.print(f"  tg after {d['context']}, node {n['node']}: {n['slots']} expert slots, "
                           f"{100 * n['hit_rate']:.0f}% hits, {n['bytes_read_per_token'] / 1e6:.1f} MB read a token, "
                           f"{100 * n['read_ahead_used']:.0f}% of reads ahead used")
    for s in stages:
        held = (f"layers {s['first_layer']}-{s['last_layer']}" if s["first_layer"] <= s["last_layer"] else "no layers")
        if s.get("first_expert") is not None:
            held += f", experts {s['first_expert']}-{s['last_expert']}"
        streamed = s.get("streamed")
        needs = (f"streams {streamed['expert_slots']} expert slots within {memory.gb(streamed['budget_bytes'])}"
                 if streamed else memory.gb(s["total_bytes"]))
        console_.print(f"  {s['address']} ({s['node_id'][:8]}): {held}, "
                       f"{needs} of {memory.gb(s['available_bytes'] or 0)}")
