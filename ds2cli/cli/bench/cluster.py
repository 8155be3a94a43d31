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
                      contexts: list[int], steps: int, quantize: int | None, spread: str = "layers") -> dict:
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    model = cluster_model(source, address, quantize, cache_tokens(prompt_lengths, contexts, steps), show=console.info,
                          spread=spread)
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
        samples, before = [], dict(ex.traffic)
        for _ in range(repeats):
            cache.truncate(context)
            t = time.perf_counter()
            for token in rng.integers(V, size=steps):
                model.forward(token[None], cache)
            samples.append(steps / (time.perf_counter() - t))
        sent = {k: (ex.traffic[k] - before[k]) / (steps * repeats)
                for k in ("calls", "bytes", "seconds", "expert_calls", "expert_bytes", "expert_seconds")}
        decode.append({"context": context, "tok_per_s": summary(samples), "per_token": sent})
    ex.stop()
    cfg = model.config
    return {"model": {"path": str(source.path), "num_hidden_layers": cfg.num_hidden_layers,
                      "format": memory.label(model.quantization)},
            "cluster": {"address": address, "spread": spread, "placement": ex.placement.to_json()},
            "settings": {"repeats": repeats, "prompt_lengths": prompt_lengths, "contexts": contexts,
                         "decode_steps": steps},
            "load_s": load_s, "prefill": prefill, "decode": decode}


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
    for s in stages:
        held = (f"layers {s['first_layer']}-{s['last_layer']}" if s["first_layer"] <= s["last_layer"] else "no layers")
        if s.get("first_expert") is not None:
            held += f", experts {s['first_expert']}-{s['last_expert']}"
        console_.print(f"  {s['address']} ({s['node_id'][:8]}): {held}, "
                       f"{memory.gb(s['total_bytes'])} of {memory.gb(s['available_bytes'] or 0)}")
