"""The click command `ds2 bench`: parse the options, check them against the model before anything
is synthesised or loaded, call the run (or the format comparison), render its report."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import click
from click.core import ParameterSource

from ds2cli.cli import console
from ds2cli.weights import memory
from ds2cli.cli.bench.formats import compare_formats
from ds2cli.cli.bench.cluster import render_cluster, run_cluster_bench
from ds2cli.cli.bench.measure import run_bench
from ds2cli.cli.bench.report import render, render_formats, stdout_console
from ds2cli.cli.bench.settings import BenchError, cache_tokens, check_settings, clip_counts
from ds2cli.cli.bench.synthetic import DEFAULT_LAYERS, LITE_LAYERS, lite_config, synthetic_model, synthetic_path
from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights.source import bundled_model_dir, open_model
from ds2cli.cli.options import (budget_size, check_spread, model_option, ray_option, ray_spread_option,
                                thread_limits, threads_option)
from ds2cli.weights.qcheckpoint import QuantConfig



def parse_counts(ctx, param, value: str) -> list[int]:
    """click callback: "128,1024,4096" -> [128, 1024, 4096]."""
    try:
        counts = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise click.BadParameter(f"expected comma-separated whole numbers, got {value!r}") from None
    if not counts or counts[0] < 1:
        raise click.BadParameter(f"expected positive token counts, got {value!r}")
    return counts


def parse_formats(ctx, param, value: str | None) -> list[int | None] | None:
    """click callback: "f32,8,4" -> [None, 8, 4]."""
    if value is None:
        return None
    names = {"f32": None, "float32": None, "8": 8, "q8": 8, "4": 4, "q4": 4}
    chosen = [v.strip().lower() for v in value.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in names]
    if unknown or not chosen:
        raise click.BadParameter(f"expected formats among f32, 8, 4 (comma-separated), got {value!r}")
    return list(dict.fromkeys(names[v] for v in chosen))


def fit_defaults(cfg: DeepseekV2Config, prompt_lengths: list[int], contexts: list[int],
                 steps: int) -> tuple[list[int], list[int]]:
    """The default token counts cut to the positions the model holds, said in one line on stderr
    (ds2-tiny holds 1024, the default contexts reach 4096). Counts the user gave stay as given,
    for check_settings to refuse: they asked for that run, not for a smaller one."""
    ctx, limit = click.get_current_context(), cfg.max_position_embeddings
    asked = {"prompt_lengths": (prompt_lengths, limit), "contexts": (contexts, limit - steps)}
    fitted, cuts = {}, []
    for name, (counts, most) in asked.items():
        given = ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
        fitted[name] = counts if given else clip_counts(counts, most)
        if fitted[name] != counts:
            cuts.append(f"--{name.replace('_', '-')} {','.join(map(str, fitted[name]))}")
    if cuts:
        console.info(f"the model holds {limit} positions (max_position_embeddings): the defaults are cut to "
                     + " and ".join(cuts))
    return fitted["prompt_lengths"], fitted["contexts"]


@click.command("bench")
@functools.partial(model_option, default="the bundled ds2-tiny, as every command; --layers: a V2-Lite slice")
@click.option("--layers", type=click.IntRange(1, LITE_LAYERS), metavar="N",
              help=f"Bench a synthetic DeepSeek-V2-Lite slice this many layers deep instead, written once "
                   f"(about 1.1 GB of disk a layer; {DEFAULT_LAYERS} is the slice the docs' figures use); not "
                   f"with -m.")
@click.option("--cache-dir", type=click.Path(path_type=Path, file_okay=False), envvar="DS2_BENCH_DIR",
              show_envvar=True, metavar="DIR", help="Where the synthetic checkpoints and the quantized copies of "
                                                    "--formats are kept (default: ~/.cache/ds2/bench).")
@click.option("--quantize", type=click.Choice(["8", "4"]),
              help="Quantize a float checkpoint as it loads, with the recipe of ds2 quantize --bits 8 or --bits 4.")
@click.option("--formats", callback=parse_formats, metavar="LIST",
              help="Compare formats, e.g. f32,8,4: f32 loads the float checkpoint, 8 and 4 its ds2 quantize "
                   "copies, made once into --cache-dir. -r sets the rounds; each round runs every format "
                   "once, in turn, each in its own process (load, memory and the figures); then, where "
                   "they fit in memory together, one process holds them all and times -r samples of each, "
                   "interleaved, for the speed ratios.")
@click.option("-r", "--repeats", type=click.IntRange(min=1), default=3, metavar="N",
              help="Runs of each measurement; min, median and max are reported (default: 3).")
@click.option("-p", "--prompt-lengths", default="16,512", callback=parse_counts, metavar="LIST",
              help="Prefill sizes in tokens, comma-separated (default: 16,512, cut to the positions the "
                   "model holds).")
@click.option("-c", "--contexts", default="128,1024,4096", callback=parse_counts, metavar="LIST",
              help="Cached tokens to decode after, comma-separated (default: 128,1024,4096, cut to the "
                   "positions the model holds).")
@click.option("-n", "--decode-steps", type=click.IntRange(min=1), default=16, metavar="N",
              help="Single-token steps timed at each context (default: 16).")
@click.option("--passes", default="2,4", callback=parse_counts, metavar="LIST",
              help="Token counts of the forward passes timed after the smallest context, against a "
                   "decode step in the same repeat: what verifying k - 1 drafted tokens costs "
                   "(default: 2,4).")
@click.option("--compare-hf", is_flag=True,
              help="Also time Hugging Face transformers on the same checkpoint (where torch and "
                   "transformers are installed).")
@click.option("--profile", is_flag=True,
              help="Also split a decode step after the smallest context: products by format, attention, "
                   "the router and the Python between them, summed to the step's time.")
@threads_option
@ray_option
@ray_spread_option
@click.option("--memory-budget", "memory_budget", metavar="SIZE", callback=budget_size,
              help="Stream a low-bit checkpoint's routed experts from disk within SIZE (as generate's); "
                   "decode rows then say the bytes read a token, the read rate and the cache's hit rates.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object with every figure instead of the table.")
def bench(model_dir, threads, layers, cache_dir, repeats, prompt_lengths, contexts, decode_steps, passes,
          compare_hf, quantize, formats, profile, ray, ray_spread, memory_budget, as_json):
    """Measure load, prefill and decode speed, and compare them with what this machine's memory
    bandwidth and float32 GEMM can do.

    Without --model it benches the bundled ds2-tiny, as every command runs it. --layers N
    instead synthesises, on its first run, a checkpoint with DeepSeek-V2-Lite's exact layer
    shapes, N layers deep, with random bf16 weights (about 1.1 GB of disk a layer), which later
    runs reuse. Progress goes to stderr; the table (or --json) to stdout."""
    if model_dir is not None and layers is not None:
        raise BenchError("--layers sets the depth of the synthetic checkpoint; it cannot be used with --model")
    if formats and (quantize or compare_hf):
        raise click.UsageError("--formats runs each format itself; it cannot be combined with --quantize or --compare-hf")
    spread = check_spread(ray, ray_spread)
    if ray is not None and (formats or compare_hf or profile):
        raise click.UsageError("--ray times prefill and decode over the cluster; it cannot be combined with "
                               "--formats, --compare-hf or --profile")
    gguf_default = None
    if model_dir is None and layers is None:
        model_dir = bundled_model_dir()     # like every command: a first run writes nothing
    if model_dir is None:
        cfg = DeepseekV2Config.from_dict(lite_config(layers))
    else:
        source = open_model(model_dir)      # its config (a GGUF's from its metadata), nothing loaded
        model_dir, cfg, gguf = source.path, source.config, source.gguf
        if gguf and not quantize and gguf.default_bits:
            # checked as load() will choose, which it then does (a Q8_0 file: its own blocks)
            gguf_default = (gguf.default_bits, gguf.default_recipe)
    prompt_lengths, contexts = fit_defaults(cfg, prompt_lengths, contexts, decode_steps)
    check_settings(cfg, prompt_lengths, contexts, decode_steps)
    bench_dir = (cache_dir or Path("~/.cache/ds2/bench")).expanduser()
    context = cache_tokens(prompt_lengths, contexts, decode_steps)
    # refuse what cannot fit before synthesising or quantizing anything (a cluster: its placement)
    stored = None if model_dir is None else source.stored
    for bits in [] if ray is not None or memory_budget is not None else formats or [int(quantize) if quantize else gguf_default[0] if gguf_default else None]:
        memory.check(cfg, model_dir or synthetic_path(bench_dir, cfg.num_hidden_layers),
                     stored or (QuantConfig.recipe(bits) if bits and formats else None),
                     None if formats else bits, context, recipe=gguf_default[1] if gguf_default and not formats else None)
    path = model_dir or synthetic_model(bench_dir, layers)
    with thread_limits(threads):
        if ray is not None:
            report = run_cluster_bench(source if model_dir is not None else open_model(path), ray, repeats,
                                       prompt_lengths, contexts, decode_steps, int(quantize) if quantize else None,
                                       spread, memory_budget)
        elif formats:
            report = compare_formats(path, bench_dir, formats, repeats, prompt_lengths, contexts, decode_steps,
                                     threads)
        else:
            report = run_bench(path, model_dir is None, repeats, prompt_lengths, contexts, decode_steps, compare_hf,
                               int(quantize) if quantize else None, passes, profile, memory_budget, threads)
    if as_json:
        click.echo(json.dumps(report))
    else:
        (render_cluster if ray is not None else render_formats if formats else render)(report, stdout_console())

