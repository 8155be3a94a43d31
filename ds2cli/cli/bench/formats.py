"""`ds2 bench --formats`: float32 and ds2 quantize copies compared, in rounds of fresh `ds2 bench`
processes (load, memory and every figure), then side by side in one process that holds every
format (the speed ratios); and the ratios taken within each round."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from ds2cli.cli import console
from ds2cli.weights import memory
from ds2cli.cli.bench.measure import fill_cache
from ds2cli.cli.bench.settings import BenchError, cache_tokens
from ds2cli.cli.bench.timing import seconds, summary
from ds2cli.model.config import DeepseekV2Config
from ds2cli.execution.factory import load
from ds2cli.execution.machine import Machine
from ds2cli.weights.source import read_quant_config
from ds2cli.weights.quantize import quantize_checkpoint


def quantized_copy(path: Path, bench_dir: Path, bits: int) -> Path:
    """`ds2 quantize` of `path`, made once into the bench directory and reused after."""
    target = bench_dir / f"{path.name}-q{bits}"
    if (target / "config.json").is_file():
        return target
    console.info(f"quantizing {path} to {bits} bits into {target} (once)")
    progress = console.LoadProgress(delay=0, label="quantizing", then="the embeddings and lm_head")
    try:
        quantize_checkpoint(path, target, bits, force=True, progress=progress)
    finally:
        progress.close()
    return target


def compare_formats(path: Path, bench_dir: Path, formats: list[int | None], repeats: int,
                    prompt_lengths: list[int], contexts: list[int], steps: int, threads: int | None = None) -> dict:
    """Each format benchmarked by fresh `ds2 bench --json -r 1` processes, so that each has its
    own peak RSS, in rounds: every round runs each format once, in turn. A shared machine's speed
    drifts over minutes, so a ratio is taken within each round, between runs made a minute or
    two apart, and the rounds' median is reported, rather than comparing one format's runs made
    now with another's made ten minutes later."""
    targets = {"f32" if bits is None else f"q{bits}": path if bits is None else quantized_copy(path, bench_dir, bits)
               for bits in formats}
    settings = ["-p", ",".join(map(str, prompt_lengths)), "-c", ",".join(map(str, contexts)), "-n", str(steps),
                *(["--threads", str(threads)] if threads else [])]
    runs: dict[str, list[dict]] = {name: [] for name in targets}
    for k in range(repeats):
        for name, target in targets.items():
            console.info(f"== round {k + 1} of {repeats}, {name}: {target}")
            child = subprocess.run([sys.executable, "-m", "ds2cli", "bench", "-m", str(target), "--json",
                                    "-r", "1", *settings], stdout=subprocess.PIPE, text=True)
            if child.returncode != 0:
                raise BenchError(f"the {name} benchmark failed (exit {child.returncode}); its error is above")
            runs[name].append(json.loads(child.stdout))
    return {"formats": runs, "comparison": format_ratios(runs),
            "side_by_side": side_by_side(targets, repeats, prompt_lengths, contexts, steps, threads=threads)}


def side_by_side(targets: dict[str, Path], repeats: int, prompt_lengths: list[int], contexts: list[int],
                 steps: int, loader=load, available_bytes=memory.available_bytes, threads: int | None = None) -> dict | None:
    """Speed ratios measured in one process that holds every format, their samples interleaved:
    for each point, sample k of every format runs in turn, seconds apart, on the same token ids,
    and the ratio is taken within each k. A shared machine's speed moves by 10-30% between the
    rounds' processes, minutes apart, and this pairs measurements made seconds apart instead.
    None (said on stderr) if the formats do not fit in memory together, and for one format.
    `loader` loads each (ds2cli.load), `available_bytes()` says the memory there is; `threads`:
    --threads, the most cores the one machine they share uses."""
    if len(targets) < 2:
        return None
    cfgs = {name: DeepseekV2Config.from_file(t / "config.json") for name, t in targets.items()}
    context = cache_tokens(prompt_lengths, contexts, steps)
    need = sum(memory.required(cfgs[name], read_quant_config(t), context)["total"] for name, t in targets.items())
    available = available_bytes()
    if available is not None and need > available:
        console.info(f"side by side: skipped, the formats need {memory.gb(need)} together and "
                     f"{memory.gb(available)} is available")
        return None
    console.info("== side by side: every format in this process, samples interleaved")
    # one machine for them all: each low-bit load forks its decode helpers anew, so the last
    # ones know every model here (one helper a core, not one a model)
    machine, models = Machine(threads), {}
    for name, t in targets.items():
        progress = console.LoadProgress()
        try:
            models[name] = loader(t, progress=progress, context=context, memory_check=False, machine=machine)
        finally:
            progress.close()
    rng = np.random.default_rng(0)
    vocab = min(m.config.vocab_size for m in models.values())
    samples: dict[str, dict[str, list[float]]] = {}
    for tokens in prompt_lengths:
        console.info(f"side by side: prefill {tokens} tokens x {repeats}")
        row = samples[f"pp{tokens} tok/s"] = {name: [] for name in models}
        for k in range(repeats + 1):            # the first, untimed, warms every format up
            ids = rng.integers(vocab, size=tokens)
            for name, m in models.items():
                took = seconds(lambda: m.forward(ids, m.new_cache(tokens)))
                if k:
                    row[name].append(tokens / took)
    prompt = rng.integers(vocab, size=max(contexts))
    caches = {name: m.new_cache(max(contexts) + steps) for name, m in models.items()}
    for context in sorted(contexts):
        console.info(f"side by side: decode {steps} x {repeats} at {context} tokens")
        row = samples[f"tg @ {context} tok/s"] = {name: [] for name in models}
        for name, m in models.items():
            fill_cache(m, caches[name], prompt[:context])
        for _ in range(repeats):
            ids = rng.integers(vocab, size=steps)
            for name, m in models.items():
                caches[name].truncate(context)
                took = seconds(lambda: [m.forward(t[None], caches[name]) for t in ids])
                row[name].append(steps / took)
                caches[name].truncate(context)
    models.clear()
    caches.clear()
    machine.stop_helpers()         # a helper's copy of this process would keep the models alive
    gc.collect()
    first = next(iter(targets))
    out = {}
    for row, by_name in samples.items():
        out[row] = {}
        for name, values in by_name.items():
            ratios = [v / b for v, b in zip(values, by_name[first])]
            out[row][name] = {"tok_per_s": summary(values), "ratio": float(np.median(ratios)),
                              "ratio_range": [min(ratios), max(ratios)], "ratios": ratios}
    return {"samples": repeats, "rows": out}


def comparison_figures(report: dict) -> dict[str, float]:
    """The figures a format comparison puts side by side, by row name."""
    rows = {"load s": report["load_s"]["median"]}
    rows.update({f"pp{r['tokens']} tok/s": r["tok_per_s"]["median"] for r in report["prefill"]})
    rows.update({f"tg @ {r['context']} tok/s": r["tok_per_s"]["median"] for r in report["decode"]})
    rows["peak RSS GB"] = report["memory"]["peak_rss_bytes"] / 1e9
    rows["weights GB"] = report["model"]["weight_bytes"] / 1e9
    return rows


def format_ratios(runs: dict[str, list[dict]]) -> dict:
    """Per format and figure: the median over the rounds, and the median over the rounds of the
    ratio to the first format's figure in the same round, with its min and max (speed: higher is
    better; load, RSS and weights: lower is better); plus the highest peak RSS against the
    float32 weight bytes."""
    figures = {name: [comparison_figures(r) for r in reports] for name, reports in runs.items()}
    base = next(iter(figures.values()))
    out = {}
    for name, rounds in figures.items():
        rows = rounds[0].keys()
        ratios = {row: [f[row] / b[row] for f, b in zip(rounds, base) if b[row]] for row in rows}
        out[name] = {"figures": {row: float(np.median([f[row] for f in rounds])) for row in rows},
                     "ratios": {row: float(np.median(r)) if r else None for row, r in ratios.items()},
                     "ratio_range": {row: [min(r), max(r)] if r else None for row, r in ratios.items()},
                     "rounds": len(rounds),
                     "rss_vs_float32_weights": max(r["memory"]["peak_rss_bytes"] / r["model"]["float32_weight_bytes"]
                                                   for r in runs[name])}
    return out
