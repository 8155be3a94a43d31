"""`ds2 serve`: the command (options, loading, the scheduler, listening) and its graceful stop on
SIGINT/SIGTERM. The HTTP layer is server/http_server.py, the scheduler server/scheduler.py.
"""

from __future__ import annotations

import ipaddress
import re
import signal
import threading
from pathlib import Path
from typing import Callable

import click

from ds2cli.cli import console
from ds2cli.generation import grammar as grammars
from ds2cli.server.request_fields import Defaults
from ds2cli.server.scheduler import DEFAULT_PARALLEL, DEFAULT_PREFILL_CHUNK, Scheduler
from ds2cli.errors import Ds2Error
from ds2cli.server.http_server import MAX_BODY_BYTES, Server, State
from ds2cli.server.prompt_disk import DiskPool
from ds2cli.text import reasoning
from ds2cli.wording import human_bytes, packed, plural
from ds2cli.cli.options import (argument_text, chat_template_option, check_ctx, draft_option, load_model,
                            max_new_tokens_for, memory_options, model_option, check_spread, open_source, sampling_options,
                            tokenizer_of,
                            sampling_params, thread_limits, threads_option)


DEFAULT_CTX = 4096                  # per-request context (cache capacity), as ds2 chat
DEFAULT_QUEUE = 16                  # requests that may wait for a slot
DEFAULT_PROMPT_CACHE_MB = 1024
DEFAULT_PROMPT_CACHE_DIR_MB = 8192
MB = 10 ** 6                        # as every ds2 command counts a megabyte (inspect, quantize, memory check)
SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_forever(server: Server, state: State, thread: threading.Thread | None = None,
                  ready: Callable[[], None] | None = None) -> None:
    """serve_until() a first SIGINT/SIGTERM; a second one aborts the running requests. Signals
    that come after are ignored: the work is done, and a late Ctrl-C arriving while Python shuts
    down (where it would kill the process with the signal) must not turn a clean stop into a failure.
    `ready()` (the line saying the server is up) runs once the handlers are in place, so a process
    manager that signals as soon as it reads that line gets a clean stop."""
    stop, received = threading.Event(), []

    def on_signal(signum, frame):
        if stop.is_set():
            state.scheduler.abort()
        received.append(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if ready is not None:
            ready()
        serve_until(server, state, stop, thread, received)
    except BaseException:
        for s, handler in previous.items():
            signal.signal(s, handler)
        raise
    for s in previous:
        signal.signal(s, signal.SIG_IGN)


def serve_until(server: Server, state: State, stop: threading.Event, thread: threading.Thread | None = None,
                received: list[int] = ()) -> None:
    """Serve until `stop` is set (on `thread`, already serving, or a new one); then refuse new
    requests (503, /health too) and send waiting ones away while the running ones finish, still
    accepting connections to say so; then close the listening socket, let the handlers write
    their last answers, and return. `received`: the signals that set `stop`, for the log line."""
    if thread is None:
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
        thread.start()
    while not stop.wait(0.2):   # a timeout, so that the main thread runs its signal handlers
        pass
    # the log says which signal came, and what another one of either kind does: a process
    # manager's SIGTERM is answered in its own terms, not a Ctrl-C's
    cause = f" on {SIGNAL_NAMES.get(received[0], 'a signal')}" if received else ""
    state.scheduler.close()     # before the log line: once it says "stopping", /health says so too
    state.log(packed([f"ds2 serve: stopping{cause}: the running requests finish", "new ones get 503",
                      "another SIGTERM or Ctrl-C ends the running ones at their next token"]), packed=True)
    state.scheduler.wait_idle()
    state.scheduler.prompt_cache.flush()      # with --prompt-cache-dir: every conversation to disk
    server.shutdown()
    server.server_close()       # the listening socket: new connections are refused from now on
    state.wait_handlers()


@click.command()
@model_option
@click.option("--alias", metavar="NAME", help="The model id the server reports in /v1/models, its responses "
              "and the log (default: what -m or DS2_MODEL gave, else ds2-tiny).")
@click.option("--host", default="127.0.0.1", metavar="HOST", help="Address to listen on; 0.0.0.0 or :: listens on the network "
              "(default: 127.0.0.1, this machine only).")
@click.option("--port", default=8000, type=click.IntRange(0, 65535), metavar="PORT",
              help="Port to listen on; 0 picks a free one (default: 8000).")
@click.option("--api-key", envvar="DS2_API_KEY", show_envvar=True, metavar="KEY",
              help="Require Authorization: Bearer KEY on every endpoint but /health and the chat page.")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN", callback=lambda ctx, p, v: check_origins(v),
              help="Let pages from ORIGIN (e.g. http://localhost:3000; * for any) call the API from a browser; "
              "repeatable (default: none).")
@click.option("--system", metavar="TEXT", help="A system message for the chat requests that bring none "
              "(no system or developer message).")
@chat_template_option()
@click.option("--reasoning-format", type=click.Choice(reasoning.FORMATS), default="deepseek",
              help="deepseek: a chat reply's <think>...</think> comes apart from the answer, as "
                   "reasoning_content (streamed as delta.reasoning_content); none: it stays in content. "
                   "A request's reasoning_format overrides it (default: deepseek).")
@click.option("--special-in-prompts/--no-special-in-prompts", default=True,
              help="A special token's text in a raw prompt (/v1/completions' prompt, /tokenize's content) "
                   "is that token, as llama.cpp reads it; --no-special-in-prompts reads it as the ordinary "
                   "tokens of its characters, for a server open to others. Chat messages and fills are "
                   "always text (default: --special-in-prompts).")
@sampling_options
@draft_option
@click.option("-c", "--ctx", "--ctx-size", type=click.IntRange(min=1), metavar="N", help=f"Tokens per request, prompt and reply; "
              f"more than the model's max_position_embeddings is refused (default: "
              f"min(max_position_embeddings, {DEFAULT_CTX})).")
@click.option("--parallel", default=DEFAULT_PARALLEL, type=click.IntRange(1, 64), metavar="N",
              help="Requests decoded together, in one pass over the weights (continuous batching); "
                   f"each has a latent cache of --ctx tokens, allocated up front (default: {DEFAULT_PARALLEL}).")
@click.option("--queue", "max_queue", default=DEFAULT_QUEUE, type=click.IntRange(min=0), metavar="N",
              help=f"Requests that may wait for one of the --parallel slots; beyond, a 503 at once "
                   f"(default: {DEFAULT_QUEUE}).")
@click.option("--max-prompt-bytes", type=click.IntRange(min=1), metavar="N",
              help=f"A request body larger than this gets 413, unread (default: {MAX_BODY_BYTES // 2**20} MiB, "
                   f"which holds a prompt as long as V2's whole context).")
@click.option("--prefill-chunk", default=DEFAULT_PREFILL_CHUNK, type=click.IntRange(min=1), metavar="N",
              help="While other requests decode, a prompt runs this many tokens a pass between their "
                   "steps (512 with none decoding): a stream or a new request waits at most one such pass "
                   f"(default: {DEFAULT_PREFILL_CHUNK}).")
@click.option("--prompt-cache-mb", default=DEFAULT_PROMPT_CACHE_MB, type=click.IntRange(min=0), metavar="MB",
              help="Memory for the latent caches of recent conversations, the running ones included, in MB "
                   f"(10^6 bytes); 0 = no reuse (default: {DEFAULT_PROMPT_CACHE_MB}).")
@click.option("--prompt-cache-dir", "prompt_cache_dir", type=click.Path(path_type=Path, file_okay=False),
              metavar="DIR", help="Keep conversations the prompt cache evicts, and all of them at a stop, in DIR: "
                                  "a later request (or server) that continues one reads only what is new.")
@click.option("--prompt-cache-dir-mb", default=DEFAULT_PROMPT_CACHE_DIR_MB, type=click.IntRange(min=1), metavar="MB",
              help="Disk for --prompt-cache-dir, in MB (10^6 bytes); the conversations used longest ago "
                   f"go first (default: {DEFAULT_PROMPT_CACHE_DIR_MB}).")
@threads_option
@memory_options
def serve(model_dir, alias, host, port, ctx, api_key, prompt_cache_mb, prompt_cache_dir, prompt_cache_dir_mb,
          max_queue, parallel, prefill_chunk, max_prompt_bytes,
          draft, cors_origins, system, chat_template, reasoning_format, special_in_prompts, quantize,
          no_memory_check, **opts):
    """Serve the model over an OpenAI-compatible HTTP API (chat and completions, streaming).

    Listens on 127.0.0.1:8000 unless told otherwise. The sampling options, -n and --draft are the
    defaults of requests that do not give them. Up to --parallel requests share each pass over the
    weights; more wait in the queue. Ctrl-C (or SIGTERM) stops gracefully: the running requests
    finish (a second one ends them at their next token)."""
    system = argument_text(system, "--system argument", hint="give it in UTF-8") or None
    check_spread(opts["ray"], opts["ray_spread"])
    source = open_source(model_dir)                 # its config only: --ctx is checked before any load
    config = source.config
    check_ctx(config, ctx)
    ctx = ctx or min(config.max_position_embeddings, DEFAULT_CTX)
    model_id = alias or served_name(model_dir)
    # the port first: a taken one is an error at once, not after minutes of loading; meanwhile
    # /health answers 503 "loading" and the API 503 with Retry-After
    state = State(None, model_id, None, api_key or None, cors_origins=cors_origins)
    state.max_body = max_prompt_bytes or MAX_BODY_BYTES
    server = listen(host, port, state, max_queue + parallel)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    try:
        with thread_limits(opts["threads"]):
            # the memory check counts the --parallel caches the running requests use at once
            tokenizer_of(source, chat_template)
            model, load_s = load_model(source, quantize, ctx * parallel, not no_memory_check, opts["ray"],
                                       opts["memory_budget"], opts["ray_spread"], opts["threads"],
                                       not opts["no_heal"])
            defaults = Defaults(sampling_params(model, opts), max_new_tokens_for(model, opts["max_new_tokens"]),
                                ctx, system, tuple(model.eos_token_ids), reasoning_format, special_in_prompts)
            model.tokenizer.longest_token     # a prompt's limit in characters (jobs.check_chars), found once
            disk = DiskPool(prompt_cache_dir, prompt_cache_dir_mb * MB, model, state.log) \
                if prompt_cache_dir is not None else None
            scheduler = Scheduler(model, ctx, prompt_cache_mb * MB, max_queue, parallel, prefill_chunk,
                                  draft, disk)
            state.defaults, state.scheduler = defaults, scheduler      # the scheduler last: it opens the API
    except BaseException:
        server.shutdown()
        server.server_close()
        raise
    warm = None
    with thread_limits(opts["threads"]):
        if grammars.available():    # llguidance's view of the vocabulary (1.5 s, 80 MB for DeepSeek's 100k
            # tokens), built off the first constrained request's path; that request waits for it if need be
            warm = threading.Thread(target=grammars.warm, daemon=True,
                                    args=(model.tokenizer, model.config.vocab_size, defaults.eos_ids))
            warm.start()
        try:
            slots = scheduler.prompt_cache.slots
            cache_each = human_bytes(model.new_cache(1).bytes_per_token * ctx)
            line = packed([f"ds2 serve: {model_id} (loaded in {load_s:.2f}s) on {url(server)}", f"ctx {ctx}",
                           f"{plural(parallel, 'request')} at once ({cache_each} of cache each)",
                           f"queue {max_queue}", f"prompt cache {prompt_cache_mb} MB = "
                           f"{plural(slots, 'conversation')}, the running ones included"])
            serve_forever(server, state, thread, ready=lambda: state.log(line, packed=True))
        finally:
            if warm is not None:
                # llguidance's native code still running when the interpreter ends crashes the
                # process (SIGSEGV, about 1 stop in 20 right after start): let it finish first
                warm.join()
    state.log("ds2 serve: stopped")


def served_name(model_dir: str | Path | None) -> str:
    """The model id a client sees: a directory's or file's own name, as llama-server names a model
    by its file's basename (not the whole path, which says where the user keeps it); a Hugging
    Face id as written, since its owner is part of the name; ds2-tiny without -m."""
    if model_dir is None:
        return "ds2-tiny"
    path = Path(model_dir).expanduser()
    return path.resolve().name if path.exists() else str(model_dir)


def check_origins(origins: tuple[str, ...]) -> tuple[str, ...]:
    """An origin as browsers send it: scheme://host[:port], no path (a trailing "/" never matches); or "*"."""
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", origin):
            raise click.BadParameter(f"{origin!r} is not an origin: give scheme://host[:port] as a browser sends it "
                                     f"(e.g. http://localhost:3000, no path), or * for any", param_hint="'--cors-origin'")
    return origins


def listen(host: str, port: int, state: State, holds: int | None = None) -> Server:
    try:
        server = Server((host, port), state, holds)
    except OSError as e:
        raise Ds2Error(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    if state.api_key is None and not is_loopback(server.server_address[0]):
        console.warn(f"listening on {server.server_address[0]} without --api-key: anyone who can reach this "
                     f"machine can use the model")
    return server


def url(server: Server) -> str:
    host, port = server.server_address[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
