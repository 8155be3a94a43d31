"""The ds2 command line: click commands that parse, call the library, and render.
No math here. stdout carries only generated text (or JSON); everything else goes to stderr."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click
import numpy as np
from rich.console import Console

from ds2cli import __version__, console, memory
from ds2cli.chat import ChatSession, read_messages
from ds2cli.errors import ContextFullError, Ds2Error
from ds2cli.generate import Chunk, lstrip_reply, stream_generate
from ds2cli.describe import describe, plural, render
from ds2cli.model import Model, bundled_model_dir, check_model_dir, load
from ds2cli.sampling import SamplingParams, make_sampler

DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_CHAT_CTX = 4096  # chat keeps one cache for the whole conversation; cap its default size


class Ds2Group(click.Group):
    """Turns every ds2 error into one red line on stderr and exit code 1."""

    def invoke(self, ctx: click.Context):
        try:
            # NaN/Inf reaching the logits is reported once, as a GenerationError (generate.check_logits);
            # numpy's own floating-point RuntimeWarnings would only add lines to stderr.
            with np.errstate(all="ignore"):
                return super().invoke(ctx)
        except Ds2Error as e:
            console.error(str(e))
            ctx.exit(1)
        except KeyboardInterrupt:  # Ctrl-C outside a generation loop (e.g. while loading)
            console.info("")
            ctx.exit(130)
        except MemoryError as e:  # numpy says how much it could not allocate, e.g. for a huge --ctx
            console.error(f"out of memory: {e}")
            ctx.exit(1)


@click.group(cls=Ds2Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ds2")
def main():
    """ds2: run DeepSeek-V2 family models on a CPU with a pure-NumPy engine.

    Without --model, ds2 runs the bundled demo model ds2-tiny."""


def model_option(f):
    return click.option("-m", "--model", "model_dir", envvar="DS2_MODEL", type=click.Path(path_type=Path),
                        help="Checkpoint directory (Hugging Face layout) or Hugging Face id (org/name[@rev]). "
                        "Default: the bundled ds2-tiny.")(f)


def sampling_options(f):
    options = [
        click.option("--temperature", type=float, help="0 = greedy. Default: generation_config.json, else 0.7."),
        click.option("--top-k", type=int, help="Keep the k most likely tokens (0 = off)."),
        click.option("--top-p", type=float, help="Nucleus sampling threshold (1 = off)."),
        click.option("--min-p", type=float, help="Drop tokens below min-p x the top probability."),
        click.option("--repetition-penalty", type=float, help="Penalise tokens already seen (1 = off)."),
        click.option("--seed", type=int, help="Random seed: the same seed gives the same output."),
        click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), help="Most tokens to generate."),
        click.option("--stop", multiple=True, help="Stop at this string (repeatable; not printed)."),
        click.option("--ctx", type=click.IntRange(min=1), help="Cache capacity in tokens."),
        click.option("--stats", is_flag=True, help="Print timings and cache use on stderr."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def memory_options(f):
    options = [
        click.option("--quantize", type=click.Choice(["8", "4", "auto"]),
                     help="Quantize a float checkpoint to 8 or 4 bits as it loads (auto: float32 if it "
                          "fits in memory, else the most precise format that does)."),
        click.option("--no-memory-check", is_flag=True,
                     help="Load even when the model looks too big for the memory available."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def load_model(model_dir: Path | None, quantize: str | None = None, context: int | None = None,
               memory_check: bool = True) -> tuple[Model, float]:
    """Load with a progress bar; `quantize` as --quantize gives it ("8", "4", "auto" or None)."""
    t0 = time.perf_counter()
    progress = console.LoadProgress()
    bits = quantize if quantize in (None, "auto") else int(quantize)
    try:
        model = load(model_dir, progress=progress, quantize=bits, context=context, memory_check=memory_check)
    finally:
        progress.close()
    if quantize == "auto":
        console.info(f"--quantize auto: loaded as {memory.label(model.quantization)}")
    return model, time.perf_counter() - t0


def sampler_for(model: Model, opts: dict):
    params = SamplingParams.from_generation_config(
        model.generation_config, temperature=opts["temperature"], top_k=opts["top_k"],
        top_p=opts["top_p"], min_p=opts["min_p"], repetition_penalty=opts["repetition_penalty"],
        seed=opts["seed"])
    return make_sampler(params)


def max_new_tokens_for(model: Model, requested: int | None) -> int:
    if requested is not None:
        return requested
    configured = model.generation_config.get("max_new_tokens")
    return configured if isinstance(configured, int) and configured > 0 else DEFAULT_MAX_NEW_TOKENS


def check_ctx(model: Model, ctx: int | None) -> None:
    limit = model.config.max_position_embeddings
    if ctx is not None and ctx > limit:
        raise Ds2Error(f"--ctx {ctx} is larger than the model's max_position_embeddings ({limit}); "
                       f"refusing rather than running positions the model was never trained on")


def read_prompt(prompt: str | None, prompt_file: Path | None, encoding: str) -> str:
    if prompt_file is not None and prompt not in (None, "-"):
        raise click.UsageError("give the prompt as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        try:
            return prompt_file.read_bytes().decode(encoding)
        except OSError as e:
            raise Ds2Error(f"cannot read prompt file {prompt_file}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise Ds2Error(f"prompt file {prompt_file} is not valid {encoding} (byte {e.start}); "
                           f"pass --encoding to read it") from None
        except LookupError:
            raise click.BadParameter(f"unknown encoding {encoding!r}", param_hint="--encoding") from None
    if prompt in (None, "-"):
        stdin = sys.stdin.buffer
        if prompt is None and stdin.isatty():
            raise click.UsageError("no prompt: pass one as an argument, with --prompt-file, or on stdin")
        try:
            return stdin.read().decode(encoding)
        except UnicodeDecodeError as e:
            raise Ds2Error(f"the prompt on stdin is not valid {encoding} (byte {e.start}); "
                           f"pass --encoding to read it") from None
    return prompt


def write_out(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def quiet_broken_pipe() -> None:
    """The reader went away (`| head`): stop writing, and keep Python from complaining at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


@main.command()
@click.argument("prompt", required=False)
@model_option
@click.option("--prompt-file", type=click.Path(path_type=Path, dir_okay=False), help="Read the prompt from a file.")
@click.option("--encoding", default="utf-8", show_default=True, help="Encoding of the prompt file or stdin.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as one user turn of the chat template.")
@click.option("--system", help="A system message (implies --chat).")
@sampling_options
@memory_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
def generate(prompt, model_dir, prompt_file, encoding, chat, system, as_json, quantize, no_memory_check, **opts):
    """Generate a completion of PROMPT (or of stdin when PROMPT is omitted or "-")."""
    text = read_prompt(prompt, prompt_file, encoding)
    model, load_s = load_model(model_dir, quantize, opts["ctx"], not no_memory_check)
    tok = model.tokenizer
    if chat or system:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = tok.encode_chat(messages, add_generation_prompt=True)
    else:
        ids = tok.encode(text)
    if not ids:
        raise Ds2Error("the prompt is empty and the tokenizer adds no bos token: nothing to condition on")
    check_ctx(model, opts["ctx"])
    max_new = max_new_tokens_for(model, opts["max_new_tokens"])
    limit = opts["ctx"] or model.config.max_position_embeddings
    if len(ids) > limit:
        raise ContextFullError(f"the prompt is {len(ids)} tokens, more than the context of {limit} tokens")
    cache = model.new_cache(opts["ctx"] or min(len(ids) + max_new, limit))
    chunks = stream_generate(model, ids, cache, sampler_for(model, opts), max_new, opts["stop"])
    if chat or system:
        chunks = lstrip_reply(chunks)
    try:
        last = run_generation(chunks, as_json)
    except KeyboardInterrupt:
        chunks.close()
        write_out("\n")
        sys.exit(130)
    except BrokenPipeError:
        quiet_broken_pipe()
        sys.exit(0)
    if as_json:
        write_out(json.dumps(generation_json(last, load_s), ensure_ascii=False) + "\n")
    if opts["stats"]:
        console.info(console.stats_line(load_s, last, cache))


def run_generation(chunks, as_json: bool) -> Chunk:
    """Stream (or collect, for --json) the chunks; return the last one with the full text in it."""
    pieces = []
    for chunk in chunks:
        pieces.append(chunk.text)
        if not as_json:
            write_out(chunk.text)
    if not as_json and "".join(pieces) and not "".join(pieces).endswith("\n"):
        write_out("\n")
    chunk.text = "".join(pieces)
    return chunk


def generation_json(last: Chunk, load_s: float) -> dict:
    return {"text": last.text, "prompt_tokens": last.prompt_tokens,
            "generated_tokens": last.generated_tokens, "finish_reason": last.finish_reason,
            "timings": {"load_s": round(load_s, 4), "prefill_tok_per_s": round(last.prefill_tok_per_s, 2),
                        "decode_tok_per_s": round(last.decode_tok_per_s, 2)}}


CHAT_HELP = """commands:
  /clear         start a new conversation (the system message stays)
  /system TEXT   set the system message
  /save PATH     save the conversation as JSON messages
  /help          this help
  /exit, /quit   leave (Ctrl-D too)"""


@main.command()
@model_option
@click.option("--system", help="A system message.")
@click.option("--load", "load_path", type=click.Path(path_type=Path, dir_okay=False),
              help="Resume a conversation saved with /save.")
@sampling_options
@memory_options
def chat(model_dir, system, load_path, quantize, no_memory_check, **opts):
    """Chat with the model in a REPL. Reads lines from stdin when it is not a terminal."""
    model, load_s = load_model(model_dir, quantize, opts["ctx"] or DEFAULT_CHAT_CTX, not no_memory_check)
    check_ctx(model, opts["ctx"])
    capacity = opts["ctx"] or min(model.config.max_position_embeddings, DEFAULT_CHAT_CTX)
    session = ChatSession(model, capacity, warn=console.warn)
    if load_path is not None:
        session.load(read_messages(load_path))
    if system:
        session.set_system(system)
    sampler = sampler_for(model, opts)
    max_new = max_new_tokens_for(model, opts["max_new_tokens"])
    interactive = sys.stdin.isatty()
    if interactive:
        console.info("ds2 chat: /help for commands, Ctrl-D to leave")
    for line in read_lines(interactive):
        if line.startswith("/"):
            if not run_command(session, line):
                break
            continue
        if not line.strip():
            continue
        try:
            last = chat_turn(session, line, sampler, max_new, opts["stop"])
        except ContextFullError as e:
            console.error(str(e))
            continue
        if last is not None and opts["stats"]:
            console.info(console.stats_line(load_s, last, session.cache))


def read_lines(interactive: bool):
    """Prompted lines on a terminal (Ctrl-C or Ctrl-D at the prompt ends), plain lines otherwise."""
    while True:
        try:
            line = input(">>> ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            if interactive:
                console.info("")
            return
        if not interactive and not line:
            return
        yield line.rstrip("\n")


def chat_turn(session: ChatSession, text: str, sampler, max_new: int, stop) -> Chunk | None:
    chunks = session.reply(text, sampler, max_new, stop)
    last = None
    try:
        for chunk in chunks:
            write_out(chunk.text)
            last = chunk
    except KeyboardInterrupt:
        chunks.close()
        write_out("\n")
        console.info("(reply interrupted; the conversation is kept)")
        return None
    write_out("\n")
    return last


def run_command(session: ChatSession, line: str) -> bool:
    """Handle a /command; return False to leave the REPL."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name in ("/exit", "/quit"):
        return False
    if name == "/clear":
        session.clear()
        console.info("(new conversation)")
    elif name == "/system" and arg:
        session.set_system(arg)
        console.info("(system message set)")
    elif name == "/save" and arg:
        try:
            session.save(Path(arg).expanduser())
            console.info(f"(saved {len(session.messages)} messages to {arg})")
        except Ds2Error as e:
            console.error(str(e))
    elif name == "/help":
        console.info(CHAT_HELP)
    else:
        console.error(f"unknown or incomplete command {line!r}; /help lists the commands")
    return True


@main.command()
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@model_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--check", is_flag=True, help="Also scan every weight for NaN/Inf (reads all the data).")
def inspect(directory, model_dir, as_json, check):
    """Summarise a checkpoint from its headers: architecture, parameters, memory, cache economics."""
    path = check_model_dir(directory or model_dir or bundled_model_dir())
    report = describe(path, check=check)
    if as_json:
        write_out(json.dumps(report, ensure_ascii=False) + "\n")
    else:
        render(report, Console())
    for warning in report.get("warnings", []):
        console.warn(warning)
    if report["problems"]:
        problems = report["problems"]
        raise Ds2Error(f"the checkpoint has {plural(len(problems), 'problem')} (listed above); first: {problems[0]}")


@main.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--bits", type=click.Choice(["8", "4"]), required=True,
              help="8: every matrix 8-bit. 4: MLPs and experts 4-bit, attention, embedding and lm_head 8-bit.")
@click.option("--force", is_flag=True, help="Replace DST if it exists and is not empty.")
@click.option("--json", "as_json", is_flag=True, help="Print a summary as one JSON object.")
def quantize(src, dst, bits, force, as_json):
    """Write a low-bit copy of checkpoint SRC into directory DST, one layer at a time.

    DST is a checkpoint every ds2 command loads (-m DST), memory-mapped: it loads in about a
    second and takes about a quarter (--bits 8) or a sixth (--bits 4) of the float32 memory."""
    from ds2cli.quantize import quantize_checkpoint
    progress = console.LoadProgress(delay=0, label="quantizing")
    t0 = time.perf_counter()
    try:
        summary = quantize_checkpoint(src, dst, int(bits), force=force, progress=progress)
    finally:
        progress.close()
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    if as_json:
        write_out(json.dumps(summary) + "\n")
    else:
        console.info(f"wrote {summary['path']}: {memory.gb(summary['bytes'])} ({bits}-bit, "
                     f"{summary['bytes'] / summary['float32_bytes']:.2f}x the float32 weights) "
                     f"in {summary['seconds']:.1f}s")


# The benchmark is a tool of its own (synthesis, probes, accounting): it lives in bench.py.
from ds2cli.bench import bench  # noqa: E402

main.add_command(bench)

# The OpenAI-compatible server (HTTP, queueing, prompt cache) lives in serve.py; it loads as
# generate does, with the same --quantize and --no-memory-check (added here: serve.py cannot
# import this module at import time, since this module imports it).
from ds2cli.serve import serve  # noqa: E402

main.add_command(memory_options(serve))
