"""Terminal output: stderr helpers (errors, warnings, the stats line, the load progress bar), the
one writer of stdout, which is left to generated text (or JSON), and a reply's writer, which
keeps its reasoning off stdout."""

from __future__ import annotations

import codecs
import os
import sys
import time

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ds2cli.model.cache import LatentCache
from ds2cli.generation.generate import Chunk
from ds2cli.text.reasoning import ReasoningSplitter, Split
from ds2cli.wording import human_bytes, packed


def error(message: str) -> None:
    # one line, whatever the message held: the CLI contract is one line per error
    click.secho("error: " + " ".join(str(message).split()), fg="red", err=True)


def warn(message: str) -> None:
    click.secho("warning: " + " ".join(str(message).split()), fg="yellow", err=True)


def info(message: str) -> None:
    click.echo(message, err=True)


def utf8_streams() -> None:
    """Where stdout/stderr's encoding cannot write every character (PYTHONIOENCODING=ascii, a C
    locale), write UTF-8 anyway rather than fail with a UnicodeEncodeError on the first é."""
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "utf-8"
        try:
            universal = codecs.lookup(encoding).name in ("utf-8", "utf-16", "utf-32")
        except LookupError:
            universal = False
        if not universal and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(encoding="utf-8")
            except (ValueError, OSError):   # a stream that cannot be switched is left as it is
                pass


def stats_line(load_s: float | None, last: Chunk, cache: LatentCache, run: dict | None = None,
               cores: str | None = None) -> str:
    """The --stats line; chat shows the load time once at start, so it passes None. `run`: the
    executor's stats (a streamed run's experts: hits, bytes read, reads ahead used); `cores`:
    the cores prefill and decode kept busy, of those given (cores_used.cores_text)."""
    parts = ([] if load_s is None else [f"load {load_s:.2f}s"]) + [
        f"prefill {last.prompt_tokens} tok, {last.prefill_tok_per_s:.1f} tok/s",
        f"decode {last.generated_tokens} tok, {last.decode_tok_per_s:.1f} tok/s"]
    if last.drafted:
        parts.append(f"draft {last.drafted} tok, {last.accepted} accepted")
    if cores:
        parts.append(cores)
    parts.append(f"cache {cache.length}/{cache.capacity} tok, {human_bytes(cache.length * cache.bytes_per_token)}")
    if run and "hits" in run:
        parts.append(experts_stats(run))
        tokens = max(1, last.prompt_tokens + last.generated_tokens)
        for node in run.get("nodes", []) if len(run.get("nodes", [])) > 1 else ():   # a cluster's, each
            parts.append(f"node {node['node']}: {experts_stats(node)}, {human_bytes(node['bytes_read'] / tokens)} "
                         f"a token")
    return packed([f"[{parts[0]}", *parts[1:-1], f"{parts[-1]}]"])     # within 80 columns


def experts_stats(run: dict) -> str:
    asked = run["hits"] + run["misses"]
    ahead = run["read_ahead"]
    return (f"experts {run['slots']} slots, {100 * run['hits'] / max(1, asked):.0f}% hits, "
            f"{human_bytes(run['bytes_read'])} read in {run['read_seconds']:.1f}s of reads (the readers' summed)"
            + (f", {100 * run['read_ahead_used'] / ahead:.0f}% of {ahead} read ahead used" if ahead else ""))


class LoadProgress:
    """A progress callback for loader.load that shows a bar on stderr only once loading has
    taken more than `delay` seconds, so fast loads stay silent, and only on a terminal (rich
    draws nothing useful into a pipe or a log, only the empty line a transient bar leaves)."""

    def __init__(self, delay: float = 1.0, label: str = "loading", then: str | None = None):
        self.label, self.then = label, then     # then: what runs once every layer is done
        self.start = time.perf_counter()
        self.delay = delay
        self.bar: Progress | None = None
        self.task = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None and time.perf_counter() - self.start > self.delay and sys.stderr.isatty():
            self.bar = Progress(TextColumn(self.label), BarColumn(), TextColumn("{task.fields[what]}"),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("load", total=total, what="")
        if self.bar is not None:
            self.bar.update(self.task, completed=done, what=self.text(done, total))

    def text(self, done: int, total: int) -> str:
        """`3/6 layers`; once all are done, what comes after them, if anything does."""
        return f"{done}/{total} layers" + (f", now {self.then}" if self.then and done == total else "")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


class PrefillProgress:
    """The progress callback of a long prompt's prefill (Model.forward's `progress`): a line on
    stderr with the tokens read, tok/s and the time left, drawn by rich on a terminal only, and
    only for prompts of at least MIN_TOKENS (a short one is read before a bar would help).
    `summary()` says what was read, for a Ctrl-C in the middle."""

    MIN_TOKENS = 512

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.start = time.perf_counter()
        self.bar: Progress | None = None
        self.task = None

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        if self.bar is None and total >= self.MIN_TOKENS and done < total and sys.stderr.isatty():
            self.bar = Progress(TextColumn("reading the prompt"), BarColumn(),
                                TextColumn("{task.completed}/{task.total} tokens, {task.fields[rate]} tok/s"),
                                TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("prefill", total=total, rate="-")
        if self.bar is not None:
            self.bar.update(self.task, completed=done, rate=f"{self.rate():.1f}")

    def rate(self) -> float:
        return self.done / max(time.perf_counter() - self.start, 1e-9)

    def summary(self) -> str:
        return (f"interrupted while reading the prompt: {self.done} of {self.total} tokens in "
                f"{time.perf_counter() - self.start:.1f}s ({self.rate():.1f} tok/s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def write_out(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


class ReplyWriter:
    """A reply as it streams (generate, chat): the answer on stdout, its reasoning
    (`<think>`...`</think>`, text/reasoning.py) on stderr, dimmed on a terminal, its line ended
    before the answer starts; `hide`: the reasoning is not shown. `split` false (--reasoning-format
    none): all of the reply on stdout as generated. `opened`: the prompt opened `<think>`."""

    def __init__(self, split: bool = True, opened: bool = False, hide: bool = False):
        self.splitter = ReasoningSplitter(opened) if split else None
        self.hide = hide
        self.thinking = False           # reasoning is on stderr and its line not yet ended
        self.answer = ""                # what went to stdout

    def write(self, text: str) -> None:
        self.show(self.splitter.feed(text) if self.splitter is not None else Split(content=text))

    def close(self) -> None:
        """The reply's end: what the split held back, and the reasoning's line ended."""
        if self.splitter is not None:
            self.show(self.splitter.flush())
        self.end_reasoning()

    def show(self, part: Split) -> None:
        if part.reasoning and not self.hide:
            click.echo(click.style(part.reasoning, dim=True), err=True, nl=False)   # unstyled off a terminal
            self.thinking = True
        if part.content:
            self.end_reasoning()
            self.answer += part.content
            write_out(part.content)

    def end_reasoning(self) -> None:
        if self.thinking:
            click.echo("", err=True)
            self.thinking = False


def quiet_broken_pipe() -> None:
    """The reader went away (`| head`): stop writing, and keep Python from complaining at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


class StdoutConsole(Console):
    """rich exits 1 by itself on a closed pipe; ds2 ends every command the same way instead."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def stdout_console(piped_width: int | None = None) -> Console:
    """Rich's console for stdout; with `piped_width`, the width it takes when stdout is not a
    terminal (rich would otherwise wrap at 80 columns)."""
    out = StdoutConsole()
    return out if piped_width is None or out.is_terminal else StdoutConsole(width=piped_width)
