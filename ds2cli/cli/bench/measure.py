"""Timing the model: load, prefill and decode runs with their repeats, and the peak RSS against
what must be resident; run_bench puts them into one report. The probes run once at the start and
again, shorter, beside each measured point, whose ratios are taken against those: a shared
machine's speed drifts mid-run. Each point also says the cores it was given and kept busy
(cli/cores_used.py), so a figure taken beside other work says so."""

from __future__ import annotations

import gc
import resource
import sys
import time
from pathlib import Path

import numpy as np

from ds2cli.cli import console
from ds2cli.cli.cores_used import CoresUsed
from ds2cli.weights import memory
from ds2cli.cli.bench.accounting import (ceiling_tok_per_s, forward_values_by_format, forward_weight_bytes,
                                         prefill_flops, total_params, weight_nbytes)
from ds2cli.cli.bench.compare_hf import compare_hf
from ds2cli.cli.bench.profile import profile_decode
from ds2cli.cli.bench.probes import machine_info, probe_beside, probe_machine
from ds2cli.cli.bench.settings import cache_tokens
from ds2cli.cli.bench.timing import seconds, summary
from ds2cli.execution.factory import load
from ds2cli.model.transformer import Model

FILL_CHUNK = 512            # the decode cache is filled by prefilling this many real tokens at a time
REAL_FILL = 2048            # ... up to this many; later positions repeat their latents (fill_cache)


def time_load(path: Path, repeats: int, quantize: int | None = None, context: int | None = None,
              memory_budget: int | None = None, threads: int | None = None) -> tuple[Model, dict]:
    samples, model = [], None
    for r in range(repeats):
        model = None  # free the previous copy first: two might not fit side by side
        gc.collect()
        console.info(f"load {r + 1}/{repeats}")
        progress = console.LoadProgress()
        try:
            t0 = time.perf_counter()
            model = load(path, progress=progress, quantize=quantize, context=context, memory_budget=memory_budget,
                         threads=threads)
            samples.append(time.perf_counter() - t0)
        finally:
            progress.close()
    return model, summary(samples)


def bench_prefill(model: Model, tokens: int, repeats: int, rng) -> dict:
    """Prompt processing: `tokens` random ids into a fresh cache. Held against the GEMM probe
    (FLOPs) and, since a short prompt is bound by reading the experts its tokens picked, the
    matvec probe (bytes)."""
    console.info(f"prefill {tokens} tokens x {repeats}")
    probes = outside_peak(probe_beside)
    samples, routes, used = [], [], CoresUsed(model)
    with used.span():
        for _ in range(repeats):
            ids = rng.integers(model.config.vocab_size, size=tokens)
            cache = model.new_cache(tokens)
            samples.append(tokens / seconds(lambda: model.forward(ids, cache, trace=routes)))
            used.after_pass()
    routed = sum(len(np.unique(idx)) for idx in routes) / repeats
    weight_bytes = forward_weight_bytes(model, routed, tokens)
    tok_per_s, gflop = summary(samples), prefill_flops(model, tokens) / 1e9
    gflop_per_s = summary([gflop * s / tokens for s in samples])
    gb_per_s = weight_bytes * tok_per_s["median"] / tokens / 1e9
    return {"tokens": tokens, "tok_per_s": tok_per_s, "gflop": gflop, "gflop_per_s": gflop_per_s,
            "routed_experts": routed, "weight_bytes": weight_bytes, "weight_gb_per_s": gb_per_s,
            "probes": probes, "gemm_ratio": gflop_per_s["median"] / probes["gemm_gflop_per_s"]["median"],
            "matvec_ratio": gb_per_s / probes["matvec_gb_per_s"]["median"], "cores": used.report()}


def fill_cache(model: Model, cache, ids: np.ndarray) -> None:
    """Fill the cache up to len(ids) positions: a real prefill of the first REAL_FILL ids,
    FILL_CHUNK tokens at a time, then those positions' latents repeated to the length asked.
    A decode step's cost does not depend on the values it attends to, and a real 32k-token fill
    would be a prefill of half an hour before the first decode step is timed."""
    real = min(len(ids), REAL_FILL)
    while cache.length < real:
        model.forward(ids[cache.length:min(cache.length + FILL_CHUNK, real)], cache)
    for at in range(max(cache.length, real), len(ids), real):
        n = min(real, len(ids) - at)
        cache.repeat(n, at)
    cache.length = max(cache.length, len(ids))


def bench_decode(model: Model, contexts: list[int], steps: int, repeats: int, rng,
                 ceiling: dict[str, float] | None = None) -> list[dict]:
    """Token generation at each context: one cache is filled context by context (fill_cache: real
    random-id tokens, so the latents attended to are what a model produces, repeated past REAL_FILL).
    `ceiling`: the run's first ceiling rates by format, kept with the best of every probe since."""
    cache = model.new_cache(max(contexts) + steps)
    prompt = rng.integers(model.config.vocab_size, size=max(contexts))
    points = []
    for context in sorted(contexts):
        console.info(f"fill the cache to {context} tokens, then decode {steps} x {repeats}")
        fill_cache(model, cache, prompt[:context])
        points.append(decode_point(model, cache, context, steps, repeats, rng, ceiling))
    return points


def decode_point(model: Model, cache, context: int, steps: int, repeats: int, rng,
                 best: dict[str, float] | None = None) -> dict:
    """Decode after `context` tokens, held against the memory probe run beside it and against
    NumPy's ceiling: the best rate of each format that any probe of this run reached (`best`,
    updated here), since a ceiling is what NumPy reaches at best and a probe that a busy
    neighbour slowed would put decode above it."""
    probes = outside_peak(probe_beside)
    best = {} if best is None else best
    for f, rate in probes["ceiling"]["g_weights_per_s"].items():
        best[f] = max(best.get(f, 0.0), rate)
    samples, routes, used = [], [], CoresUsed(model)
    before = model.executor.stats()
    with used.span():
        for _ in range(repeats):
            ids = rng.integers(model.config.vocab_size, size=steps)
            cache.truncate(context)
            t0 = time.perf_counter()
            for token in ids:
                model.forward(token[None], cache, trace=routes)
                used.after_pass()
            samples.append(steps / (time.perf_counter() - t0))
    cache.truncate(context)
    stream = streamed_point(before, model.executor.stats(), steps * repeats, samples, model.executor)
    routed = sum(len(np.unique(idx)) for idx in routes) / (steps * repeats)
    weight_bytes = forward_weight_bytes(model, routed)
    cache_bytes = cache.bytes_per_token * (context + (steps + 1) / 2)  # step j reads context + j + 1
    tok_per_s = summary(samples)
    gb_per_s = (weight_bytes + cache_bytes) * tok_per_s["median"] / 1e9
    values = forward_values_by_format(model, routed)
    ceiling = ceiling_tok_per_s(values, best)
    return {"context": context, "tok_per_s": tok_per_s, "routed_experts_per_step": routed,
            "weights_by_format": values, "ceiling_g_weights_per_s": dict(best), "ceiling_tok_per_s": ceiling,
            "ceiling_share": tok_per_s["median"] / ceiling,
            "weight_bytes_per_token": weight_bytes, "cache_bytes_per_token": cache_bytes,
            "bytes_per_token": weight_bytes + cache_bytes, "gb_per_s": gb_per_s,
            "probes": probes, "matvec_ratio": gb_per_s / probes["matvec_gb_per_s"]["median"],
            "cores": used.report(), **({"stream": stream} if stream else {})}


def streamed_point(before: dict, after: dict, tokens: int, samples: list[float], executor) -> dict | None:
    """A streamed run's (--memory-budget) reads over `tokens` decode steps: bytes from disk a
    token, the time the reads took, the share of experts found in memory, and of the experts
    read ahead, the share a step then used; and the disk's own rate for expert reads, measured
    now (`disk_rate`), with the step held against the time its bytes take at that rate."""
    if "bytes_read" not in after:
        return None
    d = {k: after[k] - before[k] for k in ("hits", "misses", "read_ahead", "read_ahead_used", "bytes_read",
                                              "read_seconds")}
    asked = d["hits"] + d["misses"]
    return {"slots": after["slots"], "bytes_read_per_token": d["bytes_read"] / tokens,
            "read_gb_per_s": d["bytes_read"] / max(d["read_seconds"], 1e-9) / 1e9,
            "read_seconds_per_token": d["read_seconds"] / tokens,
            "hit_rate": d["hits"] / max(1, asked), "read_ahead_used": d["read_ahead_used"] / max(1, d["read_ahead"]),
            **d, **disk_bound(d["bytes_read"] / tokens, samples, executor)}


def disk_bound(bytes_per_token: float, samples: list[float], executor) -> dict:
    """The disk's rate for expert reads (measured now, after the steps) and the decode step
    against the time a token's reads take at that rate: 1.0 would be reads and nothing else."""
    rate = executor.experts_part.disk_rate()
    at_rate = bytes_per_token / rate
    step = 1 / summary(samples)["median"]
    return {"disk_gb_per_s": rate / 1e9, "disk_seconds_per_token": at_rate,
            "step_vs_disk": step / at_rate if at_rate else None}


def bench_passes(model: Model, ks: list[int], context: int, repeats: int, rng) -> list[dict]:
    """Forward passes of k tokens after `context` (what a verification of k - 1 drafts costs),
    each repeat timing a one-token step and every k in turn on the same cache, so that each
    pass's cost in decode steps is a ratio within one repeat; and how many distinct experts a
    pass dequantized (from the trace), with the weight bytes that makes. The cores are counted
    over every pass timed here, the one-token steps too: each point gives the same."""
    if not ks:
        return []
    console.info(f"passes of {','.join(map(str, ks))} tokens after {context}, x {repeats}")
    cache = model.new_cache(context + max(ks))
    fill_cache(model, cache, rng.integers(model.config.vocab_size, size=context))
    times: dict[int, list[float]] = {k: [] for k in [1, *ks]}
    routes: dict[int, list] = {k: [] for k in times}
    used = CoresUsed(model)
    with used.span():
        for _ in range(repeats):
            for k in times:
                ids = rng.integers(model.config.vocab_size, size=k)
                cache.truncate(context)
                times[k].append(seconds(lambda: model.forward(ids, cache, all_logits=k > 1, trace=routes[k])))
                used.after_pass()
    layers = max(1, sum(1 for layer in model.layers if layer.is_moe))
    points = []
    for k in ks:
        routed = sum(len(np.unique(idx)) for idx in routes[k]) / repeats
        ratios = [t / one for t, one in zip(times[k], times[1])]
        points.append({"tokens": k, "context": context, "pass_s": summary(times[k]),
                       "step_ratio": summary(ratios), "routed_experts": routed,
                       "routed_experts_per_layer": routed / layers,
                       "weight_bytes": forward_weight_bytes(model, routed, k), "cores": used.report()})
    return points


# The peak RSS of the model's work, not of the probes: a probe's 256 MB array, allocated while the
# weights are resident, would count in the high-water mark. Linux lets a process reset its mark
# (/proc/self/clear_refs, "5"), so each probe is bracketed: the mark before it is kept here, and
# the mark restarts from the RSS after it. Elsewhere the peak includes the probes.
_peak_outside_probes = 0


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes
    return max(peak, _peak_outside_probes)


def outside_peak(probe) -> dict:
    """probe(), its arrays left out of the peak RSS where the platform allows."""
    global _peak_outside_probes
    before = peak_rss_bytes()
    probes = probe()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return probes
    _peak_outside_probes = before
    return probes


def memory_section(model: Model, cache_tokens: int) -> dict:
    """Peak RSS so far against what must be resident: the weights as stored (memory-mapped ones
    count once their pages are touched) and the largest cache; and against the float32 weights.
    The peak includes what the decode helper processes hold that this one does not map
    (Compute.helper_bytes), so pages split between the processes count once and in full."""
    weights = weight_nbytes(model)
    cache = cache_tokens * model.new_cache(1).bytes_per_token
    private = model.executor.compute.helper_bytes()
    rss = peak_rss_bytes() + private
    return {"peak_rss_bytes": rss, "helper_private_bytes": private, "weight_bytes": weights, "cache_bytes": cache,
            "float32_weight_bytes": 4 * total_params(model), "rss_ratio": rss / (weights + cache)}


def run_bench(path: Path, synthetic: bool, repeats: int, prompt_lengths: list[int], contexts: list[int],
              steps: int, hf: bool, quantize: int | None = None, passes: list[int] = (),
              profile: bool = False, memory_budget: int | None = None, threads: int | None = None) -> dict:
    rng = np.random.default_rng(0)
    probes = outside_peak(probe_machine)
    model, load_s = time_load(path, repeats, quantize, context=cache_tokens(prompt_lengths, contexts, steps),
                              memory_budget=memory_budget, threads=threads)
    warm = min(prompt_lengths)  # one untimed forward first, as llama-bench does
    model.forward(rng.integers(model.config.vocab_size, size=warm), model.new_cache(warm))
    prefill = [bench_prefill(model, tokens, repeats, rng) for tokens in prompt_lengths]
    decode = bench_decode(model, contexts, steps, repeats, rng, dict(probes["ceiling"]["g_weights_per_s"]))
    pass_points = bench_passes(model, list(passes), min(contexts), repeats, rng)
    profiled = None
    if profile:
        console.info(f"profile {steps * repeats} decode steps after {min(contexts)}")
        cache = model.new_cache(min(contexts) + steps * repeats)
        fill_cache(model, cache, rng.integers(model.config.vocab_size, size=min(contexts)))
        profiled = profile_decode(model, cache, min(contexts), steps * repeats, rng)
        shapes, point = profiled["numpy_at_step_shapes"], decode[0]        # decode[0]: the smallest context
        shapes["probe_g_weights_per_s"] = point["ceiling_g_weights_per_s"]
        shapes["ceiling_tok_per_s"] = 1 / shapes["products_s"]
        shapes["ceiling_share"] = point["tok_per_s"]["median"] * shapes["products_s"]
    cfg = model.config
    report = {
        "model": {"path": str(Path(path).absolute()), "synthetic": synthetic, "num_hidden_layers": cfg.num_hidden_layers,
                  "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                  "params": total_params(model), "format": memory.label(model.quantization),
                  "weight_bytes": weight_nbytes(model), "float32_weight_bytes": 4 * total_params(model)},
        "machine": machine_info(),
        "settings": {"repeats": repeats, "prompt_lengths": prompt_lengths, "contexts": contexts,
                     "decode_steps": steps, "passes": list(passes)},
        "probes": probes, "load_s": load_s, "prefill": prefill, "decode": decode, "passes": pass_points,
        "memory": memory_section(model, cache_tokens(prompt_lengths, contexts, steps)),
    }
    if profiled is not None:
        report["profile"] = profiled
    if hf:
        del model  # transformers' copy must not sit beside ours
        gc.collect()
        report["compare_hf"] = compare_hf(path, prompt_lengths, contexts, steps, repeats)
    return report
