"""The ds2 command line: click commands that parse, call the library, and render.
No math here. stdout carries only generated text (or JSON); everything else goes to stderr."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

import click
import numpy as np
from click.core import ParameterSource
from rich.console import Console

from ds2cli import __version__, console, memory
from ds2cli.chat import ChatSession, read_messages
from ds2cli.config import DeepseekV2Config
from ds2cli.errors import ContextFullError, Ds2Error
from ds2cli.generate import Chunk, lstrip_reply, stream_generate
from ds2cli.describe import describe, plural, render
from ds2cli.loader import bundled_model_dir, check_model_dir, load
from ds2cli.model import Model
from ds2cli.repl import PROMPT, LineEditor, MessageReader, history_path
from ds2cli.sampling import SamplingParams, make_sampler

DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_CHAT_CTX = 4096  # chat keeps one cache for the whole conversation; cap its default size
PIPE_CLOSED_EXIT = 0     # every command, when the reader of stdout goes away (`| head`)


class Ds2Group(click.Group):
    """Turns every ds2 error into one red line on stderr and exit code 1."""

    def main(self, *args, **kwargs):
        console.utf8_streams()
        return super().main(*args, **kwargs)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command's first sentence in full (click would cut it at the terminal's width)."""
        commands = [(name, self.get_command(ctx, name)) for name in self.list_commands(ctx)]
        rows = [(name, cmd.get_short_help_str(limit=1000)) for name, cmd in commands
                if cmd is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

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
        except BrokenPipeError:    # `ds2 ... | head`: the reader left, which is not an error
            quiet_broken_pipe()
            ctx.exit(PIPE_CLOSED_EXIT)
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
                        help="Checkpoint directory (Hugging Face layout) or Hugging Face id (org/name[@rev]); "
                             "the environment variable DS2_MODEL sets it too. Default: the bundled ds2-tiny.")(f)


def chat_template_option(extra: str = ""):
    return click.option("--chat-template", "chat_template", type=click.Path(path_type=Path, dir_okay=False),
                        help=f"A Jinja chat template file to use instead of the checkpoint's{extra}.")


def threads_option(f):
    return click.option("--threads", type=click.IntRange(min=1),
                        help="Threads for the matrix products (BLAS and the low-bit kernels). Default: "
                             "what the BLAS library picks (usually one per core).")(f)


def sampling_options(ctx_help: str):
    """The options generate and chat share. Values are range-checked by click, before any load."""
    gen = "Default: generation_config.json's, else"
    options = [
        click.option("--temperature", "--temp", type=click.FloatRange(min=0),
                     help=f"Sampling temperature; 0 = greedy. {gen} 0.7."),
        click.option("--top-k", type=click.IntRange(min=0), help=f"Keep the k most likely tokens. {gen} 0 (off)."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True),
                     help=f"Nucleus sampling: keep the most likely tokens up to this total probability. {gen} 1 (off)."),
        click.option("--min-p", type=click.FloatRange(0, 1),
                     help="Drop tokens below min-p x the top probability. Default: 0 (off)."),
        click.option("--repetition-penalty", type=click.FloatRange(min=0, min_open=True),
                     help=f"Penalise tokens already seen. {gen} 1 (off)."),
        click.option("--seed", type=int, help="Random seed: the same seed gives the same output. Default: random."),
        click.option("-n", "--max-new-tokens", type=click.IntRange(min=1),
                     help=f"Most tokens to generate. Default: generation_config.json's max_new_tokens, "
                          f"else {DEFAULT_MAX_NEW_TOKENS}."),
        click.option("--stop", multiple=True,
                     help="Stop at this string (repeatable; not printed). Understands the escapes "
                          "\\n \\t \\r \\\\ \\\" \\' and \\xNN, as llama-cli does."),
        click.option("--ctx", type=click.IntRange(min=1), help=ctx_help),
        click.option("--stats", is_flag=True, help="Print timings and cache use on stderr."),
    ]

    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return threads_option(f)
    return decorate


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
        raise type(e)(f"{e} (the model directory was set by DS2_MODEL)") from None


def model_config(model_dir: Path | None) -> tuple[Path, DeepseekV2Config]:
    """The model directory and its config.json, read before any weight (it costs nothing), so
    that options can be checked against the model before a long load."""
    with naming_ds2_model():
        path = check_model_dir(model_dir or bundled_model_dir())
        return path, DeepseekV2Config.from_file(path / "config.json")


def check_ctx(config: DeepseekV2Config, ctx: int | None) -> None:
    limit = config.max_position_embeddings
    if ctx is not None and ctx > limit:
        raise click.BadParameter(f"{ctx} is larger than the model's max_position_embeddings ({limit}); "
                                 f"refusing rather than running positions the model was never trained on",
                                 param_hint="'--ctx'")


def blas_threads(n: int | None):
    """Limit the BLAS pool for the command's lifetime (threadpoolctl works after numpy's import,
    where OMP_NUM_THREADS / OPENBLAS_NUM_THREADS would be read too late)."""
    if n is None:
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits
    from ds2cli.cores import kernel_threads
    stack = contextlib.ExitStack()
    stack.enter_context(threadpool_limits(limits=n, user_api="blas"))
    stack.enter_context(kernel_threads(n))   # the low-bit kernels' own threads
    return stack


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
               memory_check: bool = True, chat_template: Path | None = None) -> tuple[Model, float]:
    """Load with a progress bar; `quantize` as --quantize gives it ("8", "4", "auto" or None)."""
    t0 = time.perf_counter()
    progress = console.LoadProgress()
    bits = quantize if quantize in (None, "auto") else int(quantize)
    try:
        with naming_ds2_model():
            model = load(model_dir, progress=progress, quantize=bits, context=context, memory_check=memory_check)
    finally:
        progress.close()
    if quantize == "auto":
        console.info(f"--quantize auto: loaded as {memory.label(model.quantization)}")
    if chat_template is not None:
        model.tokenizer.set_chat_template(read_text_file(chat_template, "chat template"))
    return model, time.perf_counter() - t0


def read_text_file(path: Path, what: str) -> str:
    try:
        return strip_bom(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise Ds2Error(f"cannot read {what} {path}: {e.strerror}") from None
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


def read_prompt(prompt: str | None, prompt_file: Path | None, encoding: str) -> str:
    """The prompt argument, or the file (`-` is stdin), or stdin; without a byte-order mark."""
    if prompt_file is not None and prompt not in (None, "-"):
        raise click.UsageError("give the prompt as an argument or with --prompt-file, not both")
    try:
        "".encode(encoding)
    except LookupError:
        raise click.BadParameter(f"unknown encoding {encoding!r}", param_hint="--encoding") from None
    if prompt_file is not None and str(prompt_file) != "-":
        try:
            return strip_bom(prompt_file.read_bytes().decode(encoding))
        except OSError as e:
            raise Ds2Error(f"cannot read prompt file {prompt_file}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise Ds2Error(f"prompt file {prompt_file} is not valid {encoding} (byte {e.start}); "
                           f"pass --encoding to read it") from None
    if prompt_file is not None or prompt in (None, "-"):
        stdin = sys.stdin.buffer
        if prompt is None and prompt_file is None and stdin.isatty():
            raise click.UsageError("no prompt: pass one as an argument, with -p, --prompt-file, or on stdin")
        try:
            return strip_bom(stdin.read().decode(encoding))
        except UnicodeDecodeError as e:
            raise Ds2Error(f"the prompt on stdin is not valid {encoding} (byte {e.start}); "
                           f"pass --encoding to read it") from None
    return strip_bom(argument_text(prompt, "prompt argument", encoding))


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


GENERATE_CTX_HELP = ("Cache capacity in tokens. Default: prompt + max-new-tokens, at most the model's "
                     "max_position_embeddings; a larger value is refused.")


@main.command()
@click.argument("prompt", required=False)
@click.option("-p", "--prompt", "prompt_option", metavar="TEXT", help="The prompt (instead of the PROMPT argument).")
@model_option
@click.option("--prompt-file", type=click.Path(path_type=Path, dir_okay=False, allow_dash=True),
              help="Read the prompt from a file (- for stdin).")
@click.option("--encoding", default="utf-8", show_default=True,
              help="Encoding of the prompt file or stdin (and of arguments that are not UTF-8).")
@click.option("--chat", is_flag=True, help="Wrap the prompt as one user turn of the chat template.")
@click.option("--system", help="A system message (implies --chat).")
@chat_template_option(" (implies --chat)")
@click.option("--from-bos", is_flag=True,
              help="Accept an empty prompt: generate from the bos token alone (raw completion only).")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at eos tokens (only -n, --ctx or --stop end).")
@click.option("--verbose-prompt", is_flag=True, help="Print the prompt as the model sees it, and its token ids, on stderr.")
@sampling_options(GENERATE_CTX_HELP)
@memory_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
def generate(prompt, prompt_option, model_dir, prompt_file, encoding, chat, system, chat_template, from_bos,
             ignore_eos, verbose_prompt, as_json, quantize, no_memory_check, **opts):
    """Generate a completion of PROMPT (or of stdin when PROMPT is omitted or "-").

    An empty prompt is refused unless --from-bos asks to start from the bos token alone.
    Ctrl-C stops generating (exit 130; with --json, the object says finish_reason "interrupted")."""
    if prompt is not None and prompt_option is not None:
        raise click.UsageError("give the prompt as an argument or with -p/--prompt, not both")
    system = argument_text(system, "--system argument", encoding)
    chat = chat or system is not None or chat_template is not None
    if from_bos and chat:
        raise click.UsageError("--from-bos is for raw completion: a chat prompt is never empty")
    model_dir, config = model_config(model_dir)
    check_ctx(config, opts["ctx"])
    text = read_prompt(prompt if prompt_option is None else prompt_option, prompt_file, encoding)
    if not text and not from_bos:
        raise Ds2Error("the prompt is empty: give some text, or pass --from-bos to generate "
                       "from the bos token alone")
    with blas_threads(opts["threads"]):
        model, load_s = load_model(model_dir, quantize, opts["ctx"], not no_memory_check, chat_template)
        run_generate(model, load_s, text, chat, system, ignore_eos, verbose_prompt, as_json, opts)


def run_generate(model: Model, load_s: float, text: str, chat: bool, system: str | None,
                 ignore_eos: bool, verbose_prompt: bool, as_json: bool, opts: dict) -> None:
    tok = model.tokenizer
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = tok.encode_chat(messages, add_generation_prompt=True)
    else:
        ids = tok.encode(text)
    if not ids:
        raise Ds2Error("the prompt is empty and the tokenizer adds no bos token: nothing to condition on")
    if verbose_prompt:
        show_prompt(tok, ids)
    max_new = max_new_tokens_for(model, opts["max_new_tokens"])
    limit = opts["ctx"] or model.config.max_position_embeddings
    if len(ids) > limit:
        raise ContextFullError(f"the prompt is {len(ids)} tokens, more than the context of {limit} tokens")
    cache = model.new_cache(opts["ctx"] or min(len(ids) + max_new, limit))
    room = cache.capacity - len(ids) + 1          # the last sampled token is never fed back
    if max_new > room:
        console.warn(f"the context of {cache.capacity} tokens leaves room for {room} of the {max_new} "
                     f"new tokens asked for (-n): generation stops there")
    sampled = []                                  # one entry per token sampled, for an interrupted --json

    def sampler(logits, history, sample=sampler_for(model, opts)):
        token = sample(logits, history)
        sampled.append(token)
        return token
    stops = [unescape(argument_text(s, "--stop argument")) for s in opts["stop"]]
    chunks = stream_generate(model, ids, cache, sampler, max_new, stops, eos_ids=() if ignore_eos else None)
    if chat:
        chunks = lstrip_reply(chunks)
    pieces: list[str] = []
    try:
        last = run_generation(chunks, as_json, pieces)
    except KeyboardInterrupt:
        chunks.close()
        if as_json:
            interrupted = Chunk("".join(pieces), None, "interrupted", len(ids), len(sampled))
            write_out(json.dumps(generation_json(interrupted, load_s), ensure_ascii=False) + "\n")
        else:
            write_out("\n")
        sys.exit(130)
    if as_json:
        write_out(json.dumps(generation_json(last, load_s), ensure_ascii=False) + "\n")
    if opts["stats"]:
        console.info(console.stats_line(load_s, last, cache))


def show_prompt(tok, ids: list[int]) -> None:
    """--verbose-prompt: the text the model is conditioned on (special tokens included), then its ids."""
    console.info(f"prompt ({plural(len(ids), 'token')}):")
    console.info(tok.decode(ids))
    console.info("token ids: " + " ".join(map(str, ids)))


def run_generation(chunks, as_json: bool, pieces: list[str]) -> Chunk:
    """Stream (or collect, for --json) the chunks into `pieces`; return the last one with the
    full text in it."""
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
  /system [TEXT] set the system message (without TEXT: show it)
  /save PATH     save the conversation as JSON (ds2 chat --load PATH resumes it)
  /help          this help
  /exit, /quit   leave (Ctrl-D too; Ctrl-C clears the line or stops a reply)
input:
  a line holding only \""" starts a multi-line message; the next such line sends it
  a bracketed paste (most terminals) arrives as one message, newlines kept
  on a terminal: line editing, and Up/Down for the history kept in
  $XDG_DATA_HOME/ds2/chat_history (default ~/.local/share/ds2/chat_history)"""

CHAT_CTX_HELP = (f"Cache capacity in tokens, for the whole conversation. Default: "
                 f"min(max_position_embeddings, {DEFAULT_CHAT_CTX}); a larger value is refused.")


@main.command(epilog="\b\n" + CHAT_HELP)
@model_option
@click.option("--system", help="A system message.")
@click.option("--load", "load_path", type=click.Path(path_type=Path, dir_okay=False),
              help="Resume a conversation saved with /save.")
@chat_template_option()
@sampling_options(CHAT_CTX_HELP)
@memory_options
def chat(model_dir, system, load_path, chat_template, quantize, no_memory_check, **opts):
    """Chat with the model in a REPL.

    On a terminal: line editing and history, multi-line messages between two lines of \""",
    Ctrl-C stops a reply or clears the line, Ctrl-D or /exit leaves. Otherwise it reads one
    message per line from stdin, writes only the replies to stdout, and exits 1 if every turn
    failed."""
    system = argument_text(system, "--system argument")
    model_dir, config = model_config(model_dir)
    check_ctx(config, opts["ctx"])
    messages = read_messages(load_path) if load_path is not None else None
    with blas_threads(opts["threads"]):
        model, load_s = load_model(model_dir, quantize, opts["ctx"] or DEFAULT_CHAT_CTX, not no_memory_check,
                                   chat_template)
        capacity = opts["ctx"] or min(model.config.max_position_embeddings, DEFAULT_CHAT_CTX)
        session = ChatSession(model, capacity, warn=console.warn)
        repl = Repl(session, sampler_for(model, opts), max_new_tokens_for(model, opts["max_new_tokens"]),
                    [unescape(argument_text(s, "--stop argument")) for s in opts["stop"]], opts["stats"])
        if messages is not None:
            repl.resume(messages, load_path)
        if system:
            session.set_system(system)
        if opts["stats"]:
            console.info(f"[load {load_s:.2f}s]")
        failed_everything = repl.run()
    if failed_everything:
        sys.exit(1)


class Repl:
    """The chat loop: messages in, replies out, /commands, and the bookkeeping for leaving."""

    def __init__(self, session: ChatSession, sampler, max_new: int, stop: list[str], stats: bool):
        self.session, self.sampler, self.max_new, self.stop, self.stats = session, sampler, max_new, stop, stats
        self.interactive = sys.stdin.isatty()
        self.unsaved = False          # the conversation has turns no /save or --load holds
        self.turns = self.failed = 0

    def resume(self, messages: list[dict], path: Path) -> None:
        self.session.load(messages)
        console.info(f"(resumed {plural(len(messages), 'message')} from {path})")
        last_user = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), None)
        if last_user is not None:
            for m in messages[last_user:]:
                console.info((PROMPT if m["role"] == "user" else "") + m["content"])

    def run(self) -> bool:
        """Read and answer until /exit or end of input; True when every turn (of a piped chat) failed."""
        if hasattr(sys.stdin, "reconfigure"):
            # messages are UTF-8 as prompts are (whatever PYTHONIOENCODING or the locale say);
            # bytes that are not are reported per message, not raised
            sys.stdin.reconfigure(encoding="utf-8", errors="surrogateescape")
        editor = LineEditor(self.interactive, history_path())
        if self.interactive:
            console.info("ds2 chat: /help for commands, \"\"\" for a multi-line message, Ctrl-D to leave")
        try:
            for text in MessageReader(editor, on_interrupt=lambda: console.info("")):
                try:
                    if not self.handle(text):
                        break
                except KeyboardInterrupt:   # Ctrl-C between a reply and the prompt: keep going
                    console.info("")
        finally:
            editor.close()
        if self.interactive and self.unsaved:
            console.info("(leaving with unsaved turns: /save PATH keeps a conversation)")
        return not self.interactive and self.turns > 0 and self.failed == self.turns

    def handle(self, text: str) -> bool:
        """One message or /command; False to leave."""
        if text.startswith("/"):
            return self.command(text)
        if not text.strip():
            return True
        self.turns += 1
        try:
            text = argument_text(text, "message", hint="it was not sent")
            last = chat_turn(self.session, text, self.sampler, self.max_new, self.stop)
        except Ds2Error as e:
            console.error(str(e))
            self.failed += 1
            return True
        self.unsaved = True
        if last is not None and self.stats:
            console.info(console.stats_line(None, last, self.session.cache))
        return True

    def command(self, line: str) -> bool:
        """Handle a /command; return False to leave the REPL."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit") and not arg:
            return False
        if name == "/clear" and not arg:
            self.session.clear()
            self.unsaved = False
            console.info("(new conversation)")
        elif name == "/system" and arg:
            self.session.set_system(arg)
            console.info("(system message set)")
        elif name == "/system":
            current = next((m["content"] for m in self.session.messages if m["role"] == "system"), None)
            console.info(f"(system message: {current})" if current is not None else "(no system message)")
        elif name == "/save" and arg:
            try:
                self.session.save(Path(arg).expanduser())
                self.unsaved = False
                console.info(f"(saved {plural(len(self.session.messages), 'message')} to {arg})")
            except Ds2Error as e:
                console.error(str(e))
        elif name == "/save":
            console.info("usage: /save PATH   (writes the conversation as JSON; ds2 chat --load PATH resumes it)")
        elif name == "/help" and not arg:
            console.info(CHAT_HELP)
        else:
            console.error(f"unknown or incomplete command {line!r}; /help lists the commands")
        return True


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


class StdoutConsole(Console):
    """rich exits 1 by itself on a closed pipe; ds2 ends every command the same way instead."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


@main.command()
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@model_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--check", is_flag=True, help="Also scan every weight for NaN/Inf (reads all the data).")
def inspect(directory, model_dir, as_json, check):
    """Summarise a checkpoint from its headers: architecture, parameters, memory, cache economics."""
    with naming_ds2_model() if directory is None else contextlib.nullcontext():
        report = describe(check_model_dir(directory or model_dir or bundled_model_dir()), check=check)
    if as_json:
        write_out(json.dumps(report, ensure_ascii=False) + "\n")
    else:
        render(report, StdoutConsole())
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
