"""The ds2 command line: click commands that parse, call the library, and render.
No math here. stdout carries only generated text (or JSON); everything else goes to stderr."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import click
import numpy as np

from ds2cli import __version__
from ds2cli.cli import console
from ds2cli.weights.gguf import file as gguf_file
from ds2cli.weights import checkpoint, memory
from ds2cli.weights.hub import resolve_headers
from ds2cli.cli.bench import bench
from ds2cli.generation.conversation import ChatSession, read_messages
from ds2cli.cli.console import quiet_broken_pipe, write_out
from ds2cli.cli.inspect_report import describe
from ds2cli.errors import ContextFullError, Ds2Error
from ds2cli.text import fim
from ds2cli.cli.inspect_gguf import describe_gguf
from ds2cli.weights.source import bundled_model_dir, check_model_dir
from ds2cli.cli.options import (argument_text, budget_size, chat_template_option, check_ctx, cluster_plan, draft_option,
                            generation_options, load_model, max_new_tokens_for, memory_options, model_from_env,
                            model_option, naming_ds2_model, open_source, prompt_bytes_limit, ray_option,
                            ray_spread_option, check_spread,
                            reasoning_options, sampler_for, stats_option, thread_limits, threads_option, tokenizer_of, unescape)
from ds2cli.weights.quantize import quantize_checkpoint
from ds2cli.cli.chat_loop import CHAT_HELP, Repl
from ds2cli.cli.serve import serve
from ds2cli.cli.inspect_tables import render
from ds2cli.wording import plural
from ds2cli.cli.saved_state import check_prompt_cache, hold_session, leaving_on_signals, save_on_leaving
from ds2cli.cli.generate_run import (check_fill_options, model_name, prompt_ids, read_prompt, read_suffix,
                                    run_generate)

DEFAULT_CHAT_CTX = 4096  # chat keeps one cache for the whole conversation; cap its default size
PIPE_CLOSED_EXIT = 0     # every command, when the reader of stdout goes away (`| head`)


class Ds2Group(click.Group):
    """Turns every ds2 error into one red line on stderr and exit code 1, and click's usage
    errors (three lines ending in "Error: ...") into one line too, with exit code 2, naming the
    command's --help. A bare `ds2` prints the help as click does (stderr, exit code 2)."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        console.utf8_streams()
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as e:
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            console.error(e.format_message() + hint)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            console.error(e.format_message())
            sys.exit(e.exit_code)
        except click.Abort:             # Ctrl-C or EOF at one of click's own prompts
            console.info("")
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """A bare `ds2` prints the help on stderr with exit code 2, click 8.2's rule, whatever click
        is installed (8.1 printed it on stdout with 0; 8.2 raises it as a usage error, which main
        would squash into one line)."""
        if not args and not ctx.resilient_parsing:
            click.echo(ctx.get_help(), err=True, color=ctx.color)
            ctx.exit(2)
        return super().parse_args(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command's first sentence in full (click would cut it at the terminal's width)."""
        commands = [(name, self.get_command(ctx, name)) for name in self.list_commands(ctx)]
        rows = [(name, cmd.get_short_help_str(limit=1000)) for name, cmd in commands
                if cmd is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:  # Ctrl-C while the options are parsed: as quiet as in a command
            console.info("")
            sys.exit(130)

    def invoke(self, ctx: click.Context):
        try:
            # NaN/Inf reaching the logits is reported once, as a GenerationError (generate.check_logits);
            # numpy's own floating-point RuntimeWarnings would only add lines to stderr.
            with np.errstate(all="ignore"):
                return super().invoke(ctx)
        except click.UsageError as e:
            # click's parser raises "Option '--x' requires an argument." without a context: give it
            # the subcommand's, so that main names that command's --help as for every usage error
            name = ctx.invoked_subcommand
            command = self.get_command(ctx, name) if e.ctx is None and name else None
            if command is not None:
                e.ctx = click.Context(command, info_name=name, parent=ctx)
            raise
        except Ds2Error as e:
            console.error(str(e))
            ctx.exit(1)
        except KeyboardInterrupt:  # Ctrl-C outside a generation loop (e.g. while loading)
            console.info("")
            ctx.exit(130)
        except BrokenPipeError:    # `ds2 ... | head`: the reader left, which is not an error
            quiet_broken_pipe()
            ctx.exit(PIPE_CLOSED_EXIT)
        except MemoryError as e:  # numpy says how much it could not allocate, e.g. for a huge --ctx
            console.error(f"out of memory: {e}")
            ctx.exit(1)
        except OSError as e:      # a file or the system failed where no ds2 error names it: still one line
            where = f" ({e.filename})" if getattr(e, "filename", None) else ""
            console.error(f"{e.strerror or type(e).__name__}{where}")
            ctx.exit(1)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise                 # click's own exits and errors: main prints them
        except Exception as e:    # noqa: BLE001 - a bug's or a library's error: one line still (the traceback on request)
            if os.environ.get("DS2_TRACEBACK"):
                raise
            text = (str(e).strip().splitlines() or [""])[-1][:300]
            console.error(f"internal error: {type(e).__name__}: {text} (a bug in ds2; DS2_TRACEBACK=1 shows where)")
            ctx.exit(1)


@click.group(cls=Ds2Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ds2")
def main():
    """ds2: run DeepSeek-V2 family models on a CPU with a pure-NumPy engine.

    Without -m/--model, a command runs the bundled demo model ds2-tiny (bench: a synthetic
    DeepSeek-V2-Lite slice)."""


GENERATE_CTX_HELP = ("Cache capacity in tokens; more than the model's max_position_embeddings is refused "
                     "(default: prompt + max-new-tokens, at most the model's max_position_embeddings).")


@main.command()
@click.argument("prompt", required=False)
@model_option
@click.option("-p", "--prompt", "prompt_option", metavar="TEXT", help="The prompt (instead of the PROMPT argument).")
@click.option("-f", "--prompt-file", "--file", "prompt_file", type=click.Path(path_type=Path, allow_dash=True),
              help="Read the prompt from FILE (- for stdin).")
@click.option("--encoding", default="utf-8", metavar="NAME",
              help="Encoding of the prompt file or stdin, and of the prompt and --system arguments where "
                   "they are not UTF-8 (default: utf-8).")
@click.option("--chat", is_flag=True, help="Wrap the prompt as one user turn of the chat template.")
@click.option("--system", help="A system message (implies --chat).")
@chat_template_option(" (implies --chat)")
@click.option("--from-bos", is_flag=True,
              help="Accept an empty prompt: generate from the bos token alone (raw completion only).")
@click.option("--suffix", metavar="TEXT",
              help="Fill in the middle: generate what goes between the prompt and TEXT (a DeepSeek-Coder "
                   "model's FIM tokens; the prompt may then be empty).")
@click.option("--suffix-file", type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
              help="Fill in the middle, the suffix read from FILE.")
@generation_options(GENERATE_CTX_HELP)
@click.option("--ignore-eos", is_flag=True, help="Do not stop at eos tokens (only -n, --ctx or --stop end).")
@draft_option
@threads_option
@memory_options
@click.option("--prompt-cache", "prompt_cache", type=click.Path(path_type=Path), metavar="FILE",
              help="Reuse the part of the prompt that FILE holds (its latent cache) and save this prompt's "
                   "to it: a long document is read once across runs (llama-cli's option).")
@click.option("--verbose-prompt", is_flag=True, help="Print the prompt as the model sees it, and its token ids, on stderr.")
@stats_option
@reasoning_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
def generate(prompt, prompt_option, model_dir, prompt_file, encoding, chat, system, chat_template, from_bos,
             suffix, suffix_file, ignore_eos, verbose_prompt, prompt_cache, as_json, quantize, no_memory_check,
             **opts):
    """Generate a completion of PROMPT (or of stdin when PROMPT is omitted or "-").

    An empty prompt is refused unless --from-bos asks to start from the bos token alone.
    With --suffix (or --suffix-file), PROMPT is the code before the hole and the model writes what
    goes between it and the suffix (fill-in-the-middle; docs/cli.md).
    A reply's reasoning (<think>...</think>) goes to stderr and its answer to stdout.
    Ctrl-C stops generating (exit 130; with --json, the object says finish_reason "interrupted")."""
    if prompt is not None and prompt_option is not None:
        raise click.UsageError("give the prompt as an argument or with -p/--prompt, not both")
    check_reasoning_options(opts)
    check_spread(opts["ray"], opts["ray_spread"])
    system = argument_text(system, "--system argument", encoding)
    chat = chat or system is not None or chat_template is not None
    if from_bos and chat:
        raise click.UsageError("--from-bos is for raw completion: a chat prompt is never empty")
    fill = check_fill_options(suffix, suffix_file, chat, from_bos)
    source = open_source(model_dir)
    config = source.config
    check_ctx(config, opts["ctx"])
    check_prompt_cache(prompt_cache, config)
    limit_bytes = prompt_bytes_limit(config, opts["max_prompt_bytes"])
    fim_tokens = fim.FimTokens.of(tokenizer_of(source), model_name(source)) if fill else None
    text = read_prompt(prompt if prompt_option is None else prompt_option, prompt_file, encoding, limit_bytes)
    if not text and not from_bos and not fill:
        raise Ds2Error("the prompt is empty: give some text, or pass --from-bos to generate "
                       "from the bos token alone")
    if fill:
        suffix = read_suffix(suffix, suffix_file, encoding, limit_bytes)
    with thread_limits(opts["threads"]):
        # the prompt's ids and the context they need, before any weight loads: a prompt longer
        # than the context is refused here, and the memory check counts prompt + -n tokens
        max_positions = config.max_position_embeddings
        limit = opts["ctx"] or max_positions
        tokenizer = tokenizer_of(source, chat_template)
        at_least = tokenizer.count_at_least(text, limit + 1) + (
            tokenizer.count_at_least(suffix, limit + 1) if fill else 0)    # slices, stopping past the context
        if at_least > limit:
            what = "--ctx" if opts["ctx"] else "the model's max_position_embeddings"
            raise ContextFullError(f"the prompt is at least {at_least} tokens, more than the context of "
                                   f"{limit} tokens ({what})")
        if fill:
            ids, opts["opened"] = fim.fim_ids(tokenizer, fim_tokens, text, suffix), False
        else:
            ids, opts["opened"] = prompt_ids(tokenizer, text, chat, system)
        if len(ids) > limit:
            what = "--ctx" if opts["ctx"] else "the model's max_position_embeddings"
            raise ContextFullError(f"the prompt is {len(ids)} tokens, more than the context of {limit} tokens "
                                   f"({what})" + (f"; the model allows up to {max_positions}"
                                                  if opts["ctx"] and len(ids) <= max_positions else ""))
        context = opts["ctx"] or min(len(ids) + max_new_tokens_for(source.generation_config, opts["max_new_tokens"]),
                                     limit)
        model, load_s = load_model(source, quantize, context, not no_memory_check, opts["ray"], opts["memory_budget"],
                                   opts["ray_spread"], opts["threads"],
                                       not opts["no_heal"])
        run_generate(model, load_s, ids, ignore_eos, verbose_prompt, as_json, chat, opts, prompt_cache,
                     ends=fim_tokens.ends if fill else ())


def check_reasoning_options(opts: dict) -> None:
    if opts["hide_reasoning"] and opts["reasoning_format"] == "none":
        raise click.UsageError("--hide-reasoning hides the reasoning that --reasoning-format deepseek sets "
                               "apart; with none the reply is shown as generated")


CHAT_CTX_HELP = (f"Cache capacity in tokens, for the whole conversation; more than the model's "
                 f"max_position_embeddings is refused (default: min(max_position_embeddings, {DEFAULT_CHAT_CTX})).")


@main.command(epilog="\b\n" + CHAT_HELP)
@model_option
@click.option("--system", help="A system message.")
@chat_template_option()
@click.option("--load", "load_path", type=click.Path(path_type=Path),
              help="Resume a conversation saved with /save (its transcript: it is read again).")
@click.option("--session", "session_path", type=click.Path(path_type=Path), metavar="FILE",
              help="Keep the conversation in FILE: resumed from it at start without reading it again "
                   "(its latent cache is in the file), saved to it on leaving.")
@generation_options(CHAT_CTX_HELP)
@draft_option
@threads_option
@memory_options
@stats_option
@reasoning_options
def chat(model_dir, system, load_path, session_path, chat_template, quantize, no_memory_check, **opts):
    """Chat with the model in a REPL.

    On a terminal: line editing and history, multi-line messages between two lines of \""",
    Ctrl-C stops a reply or clears the line, Ctrl-D or /exit leaves. Otherwise it reads one
    message per line from stdin, writes only the replies to stdout, and exits 1 if every turn
    failed. A reply's reasoning (<think>...</think>) is shown dimmed on stderr, apart from
    its answer, and kept in the conversation (/save, --session) but never sent back to the model."""
    check_reasoning_options(opts)
    check_spread(opts["ray"], opts["ray_spread"])
    system = argument_text(system, "--system argument")
    source = open_source(model_dir)
    check_ctx(source.config, opts["ctx"])
    if load_path is not None and session_path is not None:
        raise click.UsageError("--load rereads a transcript and --session resumes a saved session: give one")
    lock, saved = None, True
    if session_path is not None:
        lock = hold_session(session_path, source.config)
    try:
        messages = None if load_path is None else \
            read_messages(load_path, prompt_bytes_limit(source.config, opts["max_prompt_bytes"]))
        with thread_limits(opts["threads"]), leaving_on_signals() as left:
            tokenizer_of(source, chat_template)
            # the cache the memory check (and --memory-budget's) counts is the one the chat keeps
            capacity = opts["ctx"] or min(source.config.max_position_embeddings, DEFAULT_CHAT_CTX)
            model, load_s = load_model(source, quantize, capacity, not no_memory_check, opts["ray"],
                                       opts["memory_budget"], opts["ray_spread"], opts["threads"],
                                       not opts["no_heal"])
            session = ChatSession(model, capacity, warn=console.warn,
                                  split_reasoning=opts["reasoning_format"] != "none", special=opts["special"])
            repl = Repl(session, sampler_for(model, opts), max_new_tokens_for(model, opts["max_new_tokens"]),
                        [unescape(argument_text(s, "--stop argument")) for s in opts["stop"]], opts["stats"],
                        opts["draft"], opts["hide_reasoning"])
            if messages is not None:
                repl.resume(messages, load_path)
            if session_path is not None and session_path.exists():
                foreign = session.resume_session(session_path)
                if foreign:
                    console.warn(f"{foreign}: its {plural(len(session.messages), 'message')} are read again "
                                 f"by this model at the next turn")
                repl.show_resumed(session.messages, session_path, len(session.cached_ids))
            repl.session_file = session_path
            if system:
                session.set_system(system)
            if opts["stats"]:
                console.info(f"[load {load_s:.2f}s]")
            try:
                failed_everything = repl.run()
            finally:
                if session_path is not None:
                    saved = save_on_leaving(session, session_path)
        if left:
            sys.exit(128 + left[0])
    finally:
        if lock is not None:
            lock.release()
    if failed_everything or not saved:      # a session that could not be saved at the end is a failure
        sys.exit(1)


@main.command()
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@model_option
@click.option("--check", is_flag=True, help="Also scan every weight for NaN/Inf (reads all the data: a Hugging "
                                            "Face id's shards are downloaded first, as generate does).")
@click.option("--verify", is_flag=True, help="Also check every tensor's bytes against the checksums `ds2 quantize` "
                                             "records (a routed expert's each on its own): a tensor or expert that "
                                             "differs is a problem; reads all the data, by memory map.")
@ray_option
@ray_spread_option
@click.option("--ctx", type=click.IntRange(min=1), metavar="N",
              help="With --ray: the context each node's part of the cache is counted at (default: the model's, "
                   "at most 4096).")
@click.option("--memory-budget", "memory_budget", metavar="SIZE", callback=budget_size,
              help="Size the expert cache that --memory-budget SIZE would hold (with --ray: the placement "
                   "with every node streaming its experts within SIZE); the report always gives the "
                   "least budget that runs the model (default: the memory available now).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def inspect(directory, model_dir, as_json, check, verify, ray, ray_spread, ctx, memory_budget):
    """Summarise a checkpoint from its headers: architecture, parameters, memory, cache economics.

    A Hugging Face id whose shards are not cached is read without them: its small files are
    downloaded, its shards' headers read over HTTP."""
    if directory is not None and model_dir is not None and not model_from_env():
        raise click.UsageError("give the checkpoint as DIRECTORY or with -m/--model, not both")
    spread = check_spread(ray, ray_spread)
    with naming_ds2_model() if directory is None else contextlib.nullcontext():
        target = directory or model_dir or bundled_model_dir()
        # headers only, unless --check or --verify, which read every weight (and so download a Hub id whole)
        path, shards = (target, None) if check or verify else resolve_headers(target, checkpoint.MAX_HEADER_BYTES)
        path = check_model_dir(path)
        gguf = gguf_file.find(path) is not None
        if verify and gguf:
            raise Ds2Error(f"--verify checks the checksums `ds2 quantize` records in a checkpoint's index; "
                           f"the GGUF file {path} has none")
        # a GGUF's report is built from its metadata (gguf_inspect, on describe's sections)
        report = (describe_gguf(path.absolute(), memory_budget) if gguf
                  else describe(path, check=check, shards=shards, budget=memory_budget, verify=verify))
    if shards is not None:
        console.info("(the shards are not downloaded: their headers were read from the Hub; "
                     "generate and chat download them)")
    if check and report.get("format") == "gguf":
        report["warnings"].append("--check scans a safetensors checkpoint's values; this GGUF file's were not read")
    placement = None if ray is None else cluster_plan(path, ray, ctx, spread, memory_budget)  # (JSON, lines), nothing loaded
    if placement is not None:
        report["placement"] = placement[0]
    if as_json:
        write_out(json.dumps(report, ensure_ascii=False) + "\n")
    else:
        render(report, console.stdout_console())
        write_out("".join(line + "\n" for line in placement[1]) if placement else "")
    for warning in report.get("warnings", []):
        console.warn(warning)
    if verify and not report["verify"]["failed"]:
        v = report["verify"]
        experts = f", each of {plural(v['experts_verified'], 'routed expert')} on its own," if v["experts_verified"] else ""
        console.info(f"verified {plural(v['tensors_verified'], 'tensor')}{experts} against their checksums")
    if report["problems"]:
        problems = report["problems"]
        raise Ds2Error(f"the checkpoint has {plural(len(problems), 'problem')} (listed above); first: {problems[0]}")


@main.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--bits", type=click.Choice(["8", "4"]), required=True,
              help="The recipe. 8: the routed and shared experts and lm_head q8 (8-bit); the embedding, "
                   "attention and dense MLP bfloat16. 4: the routed experts q4 (4-bit), every other "
                   "matrix q8. Both keep the router gate and w_uk/w_uv bfloat16, the norms float32.")
@click.option("--calibration", "calibration_text", metavar="FILE|builtin", default=None,
              help="Choose the scales from the float model's inputs on this text, of at least 256 tokens "
                   "(builtin: a small text shipped with ds2): q8 rows weighted by each input's energy, "
                   "GPTQ error compensation. Slower; the format and speed are the same (default: none, "
                   "the scales fit the weights alone).")
@click.option("--force", is_flag=True, help="Replace DST if it exists and is not empty.")
@click.option("--json", "as_json", is_flag=True, help="Print a summary as one JSON object (instead of the wrote line on stderr).")
def quantize(src, dst, bits, force, calibration_text, as_json):
    """Write a low-bit copy of checkpoint SRC into directory DST, one layer at a time.

    DST is a checkpoint that generate, chat, serve, inspect and bench load (-m DST) as a
    memory map, without converting it. Its weights take 0.26x (--bits 8) or 0.15x (--bits 4) of their float32 bytes for
    DeepSeek-V2-Lite, more for a small model (ds2-tiny: 0.33x and 0.20x)."""
    progress = console.LoadProgress(delay=0, label="quantizing", then="the embeddings and lm_head")
    t0 = time.perf_counter()
    try:
        summary = quantize_checkpoint(src, dst, int(bits), force=force, progress=progress,
                                      calibration_text=calibration_text)
    except KeyboardInterrupt:
        progress.close()
        console.info("interrupted, nothing written")
        sys.exit(130)
    finally:
        progress.close()
    # DST is complete: a Ctrl-C from here to the process's end changes nothing, and must not
    # turn the run into a failure after `wrote` (exit 130), not even while Python shuts down,
    # when its own handler is gone and SIGINT would kill the process: ignored, as serve does
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    summary["quantize_s"] = round(time.perf_counter() - t0, 2)
    if as_json:
        write_out(json.dumps(summary) + "\n")
    else:
        console.info(f"wrote {summary['path']}: {memory.gb(summary['weight_bytes'])} ({bits}-bit, "
                     f"{summary['weight_bytes'] / summary['float32_weight_bytes']:.2f}x the float32 weights) "
                     f"in {summary['quantize_s']:.1f}s")


main.add_command(bench)    # the benchmark: a tool of its own, in bench/
main.add_command(serve)    # the OpenAI-compatible server: serve.py
