"""The options the commands share, defined once and validated once, and the model loading
that follows them: generate, chat and serve take the same model, sampling and thread options
(bench the model and thread options). Everything here is checked before any weight is loaded:
a bad value is a usage error (exit 2), named by its option."""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from pathlib import Path

import click
from click.core import ParameterSource

from ds2cli.cli import console
from ds2cli.weights import memory
from ds2cli.generation.draft import MAX_DRAFT
from ds2cli.generation.generate import check_stops
from ds2cli.model.config import DeepseekV2Config
from ds2cli.errors import Ds2Error
from ds2cli.wording import plural
from ds2cli.user_files import read_bounded
from ds2cli.execution.factory import load
from ds2cli.weights.source import Source, open_model
from ds2cli.model.transformer import Model
from ds2cli.text.reasoning import FORMATS
from ds2cli.generation.sampling import SamplingParams, make_sampler

DEFAULT_MAX_NEW_TOKENS = 256


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that refuses nan and inf (click's own lets `nan` through every bound)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class Seed(click.IntRange):
    """A seed: an integer >= 0, or -1 for a random one (as llama.cpp and API clients mean it).
    An IntRange, so that --help shows the range."""

    def __init__(self):
        super().__init__(min=-1)

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            seed = value
        else:
            try:
                seed = int(str(value).strip(), 10)
            except ValueError:
                self.fail(f"{value!r} is not a valid integer.", param, ctx)
        if seed < -1:
            self.fail(f"{seed} is not a seed: give an integer >= 0, or -1 for a random one.", param, ctx)
        return None if seed == -1 else seed

    def __repr__(self) -> str:
        return "SEED"


def model_option(f, default: str = "the bundled ds2-tiny"):
    return click.option("-m", "--model", "model_dir", envvar="DS2_MODEL", show_envvar=True,
                        type=click.Path(path_type=Path),
                        help="The model: a checkpoint directory (Hugging Face layout), a GGUF file, or a "
                             f"Hugging Face id, org/name[@rev] (default: {default}).")(f)


def chat_template_option(extra: str = ""):
    return click.option("--chat-template", "chat_template", type=click.Path(path_type=Path),
                        help=f"A Jinja chat template file to use instead of the checkpoint's{extra}.")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Threads(click.IntRange):
    """--threads: an integer >= 1, capped at the cores this process may use with a one-line note.
    Capped rather than refused because llama.cpp takes any -t and runs that many threads, so its
    users pass generous values; more threads than cores only slow BLAS down, and a huge value
    would overflow threadpoolctl's C int. `cores`: what to cap at (default: usable_cores())."""

    def __init__(self, cores: int | None = None):
        super().__init__(min=1)
        self.cores = cores

    def convert(self, value, param, ctx):
        n = super().convert(value, param, ctx)
        cores = self.cores or usable_cores()
        if n > cores:
            console.info(f"(--threads {n}: this process may use {plural(cores, 'core')}, so {cores} threads)")
            return cores
        return n


def threads_option(f):
    return click.option("-t", "--threads", type=Threads(), metavar="N",
                        help="Threads for the matrix products, BLAS's and the low-bit kernels': a bound, not a "
                             "count, as each forward pass uses the cores other programs leave free, at most N "
                             "(--stats and ds2 bench say how many each figure had); more than the cores this "
                             "process may use is capped at them, with a note (default: what the BLAS library "
                             "picks, usually one per core; the kernels one per core, at most 8, fewer while "
                             "other programs keep cores busy).")(f)


def sampling_options(f):
    """The sampling options of generate, chat and serve (serve: the defaults of requests that do
    not say), with -n. Values are range-checked by click, before any load. A default is said as
    "(default: X)" at the end of the help, in every command (tests/cli/test_help.py)."""
    gen = "(default: generation_config.json's, else"
    options = [
        click.option("--temperature", "--temp", type=FiniteFloatRange(min=0),
                     help=f"Sampling temperature; 0 = greedy {gen} 0.7; a do_sample false there "
                          f"means 0)."),
        click.option("--top-k", type=click.IntRange(min=0),
                     help=f"Keep only the k most likely tokens; 0 = off {gen} 0)."),
        click.option("--top-p", type=FiniteFloatRange(0, 1, min_open=True),
                     help=f"Nucleus sampling: keep the most likely tokens up to this total probability; "
                          f"1 = off {gen} 1)."),
        click.option("--min-p", type=FiniteFloatRange(0, 1),
                     help="Drop tokens below min-p x the most likely token's probability; 0 = off (default: 0)."),
        click.option("--repetition-penalty", type=FiniteFloatRange(min=0, min_open=True),
                     help=f"Penalise tokens already in the prompt or the reply (Hugging Face's "
                          f"multiplicative penalty); 1 = off {gen} 1)."),
        click.option("-s", "--seed", type=Seed(), help="Random seed: the same seed gives the same output; "
                                                 "-1 = random (default: random)."),
        click.option("-n", "--max-new-tokens", "--n-predict", "--max-tokens", type=click.IntRange(min=1), metavar="N",
                     help=f"Most tokens to generate (default: generation_config.json's max_new_tokens, "
                          f"else {DEFAULT_MAX_NEW_TOKENS})."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


draft_option = click.option(
    "--draft", type=click.IntRange(0, MAX_DRAFT), default=0, metavar="N",
    help="Speculative decoding: draft up to N tokens by prompt lookup (copied from where the text's last "
         "tokens occurred before) and verify them in one pass; the output is the same as without; "
         "0 = off (default: 0).")

stats_option = click.option("--stats", is_flag=True, help="Print timings and cache use on stderr.")


def reasoning_options(f):
    """How a reply's reasoning (`<think>`...`</think>`, R1 and V3.1) is shown: text/reasoning.py."""
    f = click.option("--hide-reasoning", is_flag=True,
                     help="Do not show a reply's reasoning (<think>...</think>), only its answer.")(f)
    return click.option("--reasoning-format", type=click.Choice(FORMATS), default="deepseek",
                        help="deepseek: a reply's <think>...</think> is shown apart from the answer, on stderr "
                             "(dimmed on a terminal); none: all of the reply as generated, on stdout "
                             "(default: deepseek).")(f)


def checked_stops(stops: tuple[str, ...]) -> tuple[str, ...]:
    fault = check_stops(stops)
    if fault is not None:
        raise click.BadParameter(fault, param_hint="'--stop'")
    return stops


max_prompt_bytes_option = click.option(
    "--max-prompt-bytes", type=click.IntRange(min=1), metavar="N",
    help="Refuse a prompt, a transcript (--load) or stdin larger than this, measured before it is read "
         "(default: 32 bytes a position of the model's context, at least 1 MiB).")


def prompt_bytes_limit(config: DeepseekV2Config, requested: int | None) -> int:
    """--max-prompt-bytes, else what the model's context could hold: no tokenizer turns more
    than a few bytes into a token, so 32 a position refuses only what could never fit."""
    return requested if requested is not None else max(1 << 20, 32 * config.max_position_embeddings)


def generation_options(ctx_help: str):
    """generate's and chat's: the sampling options and -n, then --stop and --ctx. The commands
    place --draft, --threads, the memory options and --stats after them, in that order."""
    options = [
        click.option("--stop", multiple=True, callback=lambda ctx, param, value: checked_stops(value),
                     help="Stop at this string (repeatable; not printed). Understands the escapes "
                          "\\n \\t \\r \\0 \\\\ \\\" \\' and \\xNN, as llama-cli does."),
        click.option("-c", "--ctx", "--ctx-size", type=click.IntRange(min=1), metavar="N", help=ctx_help),
        click.option("--special", is_flag=True,
                     help="Print the special tokens (bos, eos, pad) the model writes, as llama-cli's "
                          "--special does; without it their text is left out."),
        max_prompt_bytes_option,
    ]

    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return sampling_options(f)
    return decorate


SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")


def sampling_params(model: Model, opts: dict) -> SamplingParams:
    """The options given, over generation_config.json's defaults."""
    return SamplingParams.from_generation_config(model.generation_config, **{k: opts[k] for k in SAMPLING})


def model_from_env() -> bool:
    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source("model_dir") == ParameterSource.ENVIRONMENT


@contextlib.contextmanager
def naming_ds2_model():
    """An error about the model directory says so when its path came from DS2_MODEL."""
    try:
        yield
    except Ds2Error as e:
        if not model_from_env():
            raise
        raise type(e)(f"{e} (the model path was set by DS2_MODEL)") from None


def open_source(model_dir: Path | None) -> Source:
    """The model opened (source.open_model: its config read, nothing loaded), so that options
    can be checked against it before a long load; the same object is loaded later."""
    with naming_ds2_model():
        return open_model(model_dir)


TEMPLATE_LIMIT = 1 << 20      # a chat template: kilobytes in every real model


def tokenizer_of(source: Source, chat_template: Path | None = None):
    """The model's tokenizer (read once), with --chat-template's file in place of its own."""
    with naming_ds2_model():
        tokenizer = source.tokenizer
    if chat_template is not None:
        text = read_text_file(chat_template, "chat template", TEMPLATE_LIMIT)
        tokenizer.set_chat_template(text, str(chat_template))
    return tokenizer


def check_ctx(config: DeepseekV2Config, ctx: int | None) -> None:
    limit = config.max_position_embeddings
    if ctx is not None and ctx > limit:
        raise click.BadParameter(f"{ctx} is larger than the model's max_position_embeddings ({limit}); "
                                 f"refusing rather than running positions the model was never trained on",
                                 param_hint="'--ctx'")


def thread_limits(n: int | None):
    """Limit the BLAS pool for the command's lifetime (threadpoolctl works after numpy's import,
    where OMP_NUM_THREADS / OPENBLAS_NUM_THREADS would be read too late)."""
    if n is None:
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits   # imported when used: it costs 30 ms
    stack = contextlib.ExitStack()
    stack.enter_context(threadpool_limits(limits=n, user_api="blas"))
    return stack     # the low-bit kernels' own threads: load_model's `threads`, the model's machine


def memory_options(f):
    options = [
        click.option("--quantize", type=click.Choice(["8", "4", "auto", "exact"]),
                     help="Quantize a float checkpoint as it loads, with the recipe of ds2 quantize "
                          "--bits 8 or --bits 4; auto: float32 if it fits in memory, else the most precise "
                          "format that does; exact: a Q8_0 GGUF's own blocks, bit for bit, which is how "
                          "such a file loads without this option (8 loads it into the 8-bit recipe)."),
        click.option("--no-memory-check", is_flag=True,
                     help="Load even when the model looks too big for the memory available."),
        ray_option,
        ray_spread_option,
        click.option("--no-heal", "no_heal", is_flag=True,
                     help="With --ray: a node lost mid-run ends the request with an error, as llama.cpp's RPC "
                          "backend does, instead of its layers moving to the nodes left; no spare process waits on "
                          "each node for them (docs/cluster.md)."),
        click.option("--memory-budget", "memory_budget", metavar="SIZE", callback=budget_size,
                     help="Run a low-bit checkpoint or a Q8_0 GGUF larger than memory: everything but the routed experts "
                          "stays resident, the experts are read from disk into a cache that fills the rest of "
                          "SIZE (8G, 8GiB or bytes), reading ahead what the next layer will likely need "
                          "(docs/performance.md)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def cluster_plan(path: Path, ray: str, ctx: int | None, spread: str = "layers",
                 memory_budget: int | None = None) -> tuple[list, list[str]]:
    """`inspect --ray`: the placement over the cluster as JSON and as lines, loading nothing
    (the checkpoint's headers here, and each node's probe); with `memory_budget`, every node
    streaming its experts within it, as generate's --memory-budget with --ray."""
    from ds2cli.cluster import driver
    source = open_source(path)
    check_ctx(source.config, ctx)
    placement = driver.plan(source, ray, None, ctx, spread=spread, memory_budget=memory_budget)[1]
    return placement.to_json(), driver.describe(source, placement)


def budget_size(ctx, param, value):
    if value is None:
        return None
    try:
        size = memory.parse_size(value)
    except Ds2Error as e:
        raise click.BadParameter(str(e).replace(memory.ENV, "the budget")) from None
    if size <= 0:
        raise click.BadParameter("the budget must be more than 0 bytes")
    return size


ray_spread_option = click.option(
    "--ray-spread", "ray_spread", type=click.Choice(["layers", "experts"]), default=None,
    help="With --ray, how the model is spread: layers gives each node a range of layers, and a "
         "token visits the nodes in turn; experts also gives each node a share of every MoE layer's "
         "routed experts, computed at once on the nodes holding them, docs/cluster.md (default: layers).")

ray_option = click.option(
    "--ray", "ray", metavar="ADDRESS",
    help="Spread the model over the nodes of a Ray cluster by ranges of layers: the head's HOST:PORT "
         "(as `ray start --head` prints it), or auto to read RAY_ADDRESS. Each node reads its layers from "
         "the same path on its own disk; the placement is printed before anything loads (docs/cluster.md).")


def check_spread(ray: str | None, spread: str | None) -> str:
    """--ray-spread's value ("layers" unless given), refused without --ray."""
    if spread is not None and ray is None:
        raise click.UsageError("--ray-spread says how a model spreads over a Ray cluster: give --ray too")
    return spread or "layers"


def load_model(source: Source, quantize: str | None = None, context: int | None = None,
               memory_check: bool = True, ray: str | None = None,
               memory_budget: int | None = None, spread: str | None = None,
               threads: int | None = None, heal: bool = True) -> tuple[Model, float]:
    """Load the opened model with a progress bar; `quantize` as --quantize gives it ("8", "4",
    "auto", "exact" or None). A command reads its tokenizer and prompt from `source` first
    (tokenizer_of), so it can refuse a prompt too long for its context and name the context the
    memory check counts before any weight loads. `ray`: --ray's address, the model placed over
    that cluster's nodes (the placement printed first) instead of loaded here; `spread`:
    --ray-spread's "layers" or "experts"; `threads`: --threads, the cores the model's kernels use.
    Every combination loads (execution/factory.py composes it)."""
    t0 = time.perf_counter()
    spread = check_spread(ray, spread)
    if not heal and ray is None:
        raise click.UsageError("--no-heal says what a cluster does when it loses a node: give --ray too")
    bits = quantize if quantize in (None, "auto", "exact") else int(quantize)
    if ray is not None:
        with naming_ds2_model():
            model = load(source, quantize=bits, context=context, memory_check=memory_check, ray=ray,
                         spread=spread, show=console.info, memory_budget=memory_budget, heal=heal)
        return model, time.perf_counter() - t0
    progress = console.LoadProgress()
    try:
        with naming_ds2_model():
            model = load(source, progress=progress, quantize=bits, context=context, memory_check=memory_check,
                         memory_budget=memory_budget, threads=threads)
    finally:
        progress.close()
    if quantize == "auto":
        console.info(f"--quantize auto: loaded as {memory.label(model.quantization)}")
    return model, time.perf_counter() - t0


def read_text_file(path: Path, what: str, limit: int, option: str = "") -> str:
    """A UTF-8 text file of at most `limit` bytes, measured before it is read (user_files)."""
    try:
        return strip_bom(read_bounded(path, limit, what, option).decode("utf-8"))
    except UnicodeDecodeError as e:
        raise Ds2Error(f"{what} {path} is not valid UTF-8 (byte {e.start})") from None


def strip_bom(text: str) -> str:
    """A UTF-8 byte-order mark (Windows editors write one) is not part of the prompt."""
    return text[1:] if text.startswith("\ufeff") else text


ENCODING_HINT = "pass --encoding to read it (e.g. --encoding latin-1), or use --prompt-file"


def argument_text(value: str | None, what: str, encoding: str = "utf-8", hint: str = ENCODING_HINT) -> str | None:
    """A command-line argument as text. Python hands over bytes that are not valid UTF-8 as lone
    surrogates; they are re-read in `encoding` (--encoding), the way prompt files and stdin are."""
    if value is None:
        return None
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        pass
    try:
        return os.fsencode(value).decode(encoding)
    except (UnicodeError, LookupError) as e:
        byte = f" (byte {e.start})" if isinstance(e, UnicodeDecodeError) else ""
        raise Ds2Error(f"the {what} is not valid {encoding}{byte}; {hint}") from None


ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|[nrt0\\\\\"'])")
ESCAPED = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", '"': '"', "'": "'"}


def unescape(text: str) -> str:
    """`--stop '\\n\\n'` means two newlines: the escapes llama-cli understands."""
    return ESCAPE.sub(lambda m: chr(int(m[1][1:], 16)) if m[1][0] == "x" else ESCAPED[m[1]], text)


def sampler_for(model: Model, opts: dict):
    return make_sampler(sampling_params(model, opts))


def max_new_tokens_for(model: Model | dict, requested: int | None) -> int:
    """-n, else generation_config.json's max_new_tokens (of a model, or the dict itself), else ds2's default."""
    if requested is not None:
        return requested
    gen = model if isinstance(model, dict) else model.generation_config
    configured = gen.get("max_new_tokens")
    return configured if isinstance(configured, int) and configured > 0 else DEFAULT_MAX_NEW_TOKENS
