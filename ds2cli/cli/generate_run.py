"""`ds2 generate` below its click command: the prompt (the argument, a file or stdin; a fill's
suffix) read within --max-prompt-bytes and made ids, then the run, streamed or as --json, with
--prompt-cache, --stats (the cores prefill and decode used among them) and an interrupted run's
report."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from ds2cli.cli import console
from ds2cli.cli.console import write_out
from ds2cli.cli.cores_used import CoresUsed, cores_text
from ds2cli.cli.options import argument_text, max_new_tokens_for, sampler_for, strip_bom, unescape
from ds2cli.cli.saved_state import save_prompt_cache
from ds2cli.errors import Ds2Error
from ds2cli.generation import saved_cache
from ds2cli.generation.generate import Chunk, lstrip_reply, stream_generate
from ds2cli.generation.sampling import CountingSampler
from ds2cli.model.transformer import Model
from ds2cli.text import reasoning
from ds2cli.user_files import read_bounded
from ds2cli.wording import plural

def read_prompt(prompt: str | None, prompt_file: Path | None, encoding: str, limit: int) -> str:
    """The prompt argument, or the file (`-` is stdin), or stdin; without a byte-order mark. A
    file or stdin is measured against `limit` (--max-prompt-bytes) before it is read."""
    if prompt_file is not None and prompt not in (None, "-"):
        raise click.UsageError("give the prompt as an argument or with --prompt-file, not both")
    try:
        "".encode(encoding)
    except LookupError:
        raise click.BadParameter(f"unknown encoding {encoding!r}", param_hint="--encoding") from None
    if prompt_file is not None and str(prompt_file) != "-":
        try:
            return strip_bom(read_bounded(prompt_file, limit, "prompt file", "--max-prompt-bytes").decode(encoding))
        except UnicodeDecodeError as e:
            raise Ds2Error(f"prompt file {prompt_file} is not valid {encoding} (byte {e.start}); "
                           f"pass --encoding to read it") from None
    if prompt_file is not None or prompt in (None, "-"):
        if prompt is None and prompt_file is None and sys.stdin.isatty():
            raise click.UsageError("no prompt: pass one as an argument, with -p, --prompt-file, or on stdin")
        try:
            return strip_bom(read_bounded("-", limit, "the prompt on stdin", "--max-prompt-bytes").decode(encoding))
        except UnicodeDecodeError as e:
            raise Ds2Error(f"the prompt on stdin is not valid {encoding} (byte {e.start}); "
                           f"pass --encoding to read it") from None
    return strip_bom(argument_text(prompt, "prompt argument", encoding))


def check_fill_options(suffix: str | None, suffix_file: Path | None, chat: bool, from_bos: bool) -> bool:
    """Whether generate fills in the middle; the options that cannot go with it are usage errors."""
    if suffix is not None and suffix_file is not None:
        raise click.UsageError("give the suffix with --suffix or --suffix-file, not both")
    fill = suffix is not None or suffix_file is not None
    option = "--suffix" if suffix is not None else "--suffix-file"
    if fill and chat:
        raise click.UsageError(f"{option} fills in the middle of raw text: it cannot be combined with --chat, "
                               f"--system or --chat-template")
    if fill and from_bos:
        raise click.UsageError(f"{option} needs no --from-bos: a fill's prompt is never empty")
    return fill


def read_suffix(suffix: str | None, suffix_file: Path | None, encoding: str, limit: int) -> str:
    """--suffix's text, or --suffix-file's, measured against --max-prompt-bytes before it is read."""
    if suffix_file is None:
        return argument_text(suffix, "--suffix argument", encoding)
    try:
        return strip_bom(read_bounded(suffix_file, limit, "suffix file", "--max-prompt-bytes").decode(encoding))
    except UnicodeDecodeError as e:
        raise Ds2Error(f"suffix file {suffix_file} is not valid {encoding} (byte {e.start}); "
                       f"pass --encoding to read it") from None


def model_name(source) -> str:
    """How an error names the model: its directory's or file's name (ds2-tiny for the bundled one)."""
    return source.path.name or str(source.path)


def prompt_ids(tok, text: str, chat: bool, system: str | None) -> tuple[list[int], bool]:
    """The prompt's ids, and whether it opened <think> (R1's template does: the reply starts
    inside its reasoning). With `chat` the text (and `system`) is a message, whose special-token
    text stays text; a raw prompt's special-token text is the token, as llama.cpp reads it."""
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        text = tok.render_chat(messages, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(text)
    if not ids:
        raise Ds2Error("the prompt is empty and the tokenizer adds no bos token: nothing to condition on")
    return ids, reasoning.opens_reasoning(text)


def run_generate(model: Model, load_s: float, ids: list[int], ignore_eos: bool, verbose_prompt: bool,
                 as_json: bool, chat: bool, opts: dict, prompt_cache: Path | None = None,
                 ends: tuple[int, ...] = ()) -> None:
    """Generate from `ids` and print; eos ends the text (and `ends`: a fill's FIM tokens) unless
    --ignore-eos."""
    tok = model.tokenizer
    if verbose_prompt:
        show_prompt(tok, ids)
    max_new = max_new_tokens_for(model, opts["max_new_tokens"])
    limit = opts["ctx"] or model.config.max_position_embeddings
    capacity = opts["ctx"] or min(len(ids) + max_new, limit)
    cache, keep = model.new_cache(capacity), 0
    if prompt_cache is not None and prompt_cache.exists():
        try:
            cache, kept, _ = saved_cache.load(prompt_cache, model, capacity, match=ids)
            keep = len(kept)
            console.info(f"(prompt cache {prompt_cache}: {keep} of the prompt's {plural(len(ids), 'token')} "
                         f"already read)")
        except saved_cache.ForeignCacheError as e:       # llama-cli's behaviour: a cache, rebuilt
            console.warn(f"{e}; rebuilding it")
    room = cache.capacity - len(ids) + 1          # the last sampled token is never fed back
    if max_new > room:
        console.warn(f"the context of {cache.capacity} tokens leaves room for {room} of the {max_new} "
                     f"new tokens asked for (-n): generation stops there")
    sampler = CountingSampler(sampler_for(model, opts))      # what ran, for an interrupted --json
    stops = [unescape(argument_text(s, "--stop argument")) for s in opts["stop"]]
    reading = console.PrefillProgress(len(ids) - keep)
    eos_ids = () if ignore_eos else (*model.eos_token_ids, *ends) if ends else None
    chunks = stream_generate(model, ids[keep:], cache, sampler, max_new, stops, eos_ids=eos_ids,
                             context=ids[:keep], draft=opts["draft"], progress=reading, special=opts["special"])
    if chat:
        chunks = lstrip_reply(chunks)
    used = {"prefill": CoresUsed(model), "decode": CoresUsed(model)}
    chunks = counting_cores(chunks, **used)
    pieces: list[Chunk] = []
    split = opts["reasoning_format"] != "none"
    writer = console.ReplyWriter(split, opts["opened"], opts["hide_reasoning"])
    try:
        last = run_generation(chunks, as_json, pieces, reading, writer)
    except KeyboardInterrupt:
        chunks.close()
        reading.close()
        if prompt_cache is not None and cache.length > keep:   # what was read of the prompt: keep it
            save_prompt_cache(prompt_cache, model, cache, ids[:cache.length])
        # the timings of what ran: the prefill, and the decode steps up to the last chunk shown
        ran = pieces[-1] if pieces else Chunk("", prompt_tokens=len(ids))
        interrupted = dataclasses.replace(ran, text="".join(c.text for c in pieces), finish_reason="interrupted")
        if as_json:   # every token sampled counts, those held back (a partial stop string) too
            out = {**generation_json(interrupted, load_s, opts["draft"], split, opts["opened"]),
                   "completion_tokens": sampler.count}
            write_out(json.dumps(out, ensure_ascii=False) + "\n")
        else:
            writer.close()
            write_out("\n")
        if not pieces and reading.done:
            console.info(reading.summary())
        elif opts["stats"]:
            console.info(console.stats_line(load_s, interrupted, cache, model.executor.stats(),
                                            cores_of(used, interrupted)))
        sys.exit(130)
    if prompt_cache is not None:
        save_prompt_cache(prompt_cache, model, cache, ids)
    if as_json:
        write_out(json.dumps(generation_json(last, load_s, opts["draft"], split, opts["opened"]),
                             ensure_ascii=False) + "\n")
    if opts["stats"]:
        console.info(console.stats_line(load_s, last, cache, model.executor.stats(), cores_of(used, last)))


def counting_cores(chunks, prefill: CoresUsed, decode: CoresUsed):
    """The chunks as they come, the cores counted over the prompt (up to the first generated
    token's chunk, which its logits gave) and over the decode steps after it; closing this
    closes `chunks`."""
    prefill.start()
    try:
        for chunk in chunks:
            if decode.started is None and prefill.started is not None:
                prefill.after_pass()
                prefill.stop()
                decode.start()
            else:
                decode.after_pass()
            yield chunk
    finally:
        prefill.stop()
        decode.stop()
        chunks.close()


def cores_of(used: dict[str, CoresUsed], last: Chunk) -> str | None:
    """--stats' cores part: prefill's, and decode's once it made a step."""
    return cores_text({name: u.report() for name, u in used.items() if name == "prefill" or last.generated_tokens > 1})


def show_prompt(tok, ids: list[int]) -> None:
    """--verbose-prompt: the text the model is conditioned on (special tokens included), its ids,
    then which of them are control tokens (position: id text): the template's markup, bos, the
    special tokens a raw prompt spells; a chat message's own special-token text is never one."""
    console.info(f"prompt ({plural(len(ids), 'token')}):")
    console.info(tok.decode(ids))
    console.info("token ids: " + " ".join(map(str, ids)))
    controls = [f"{at}: {i} {tok.control_text(i)}" for at, i in enumerate(ids) if tok.control_text(i) is not None]
    console.info("control tokens: " + ("; ".join(controls) if controls else "none"))


def run_generation(chunks, as_json: bool, pieces: list[Chunk], reading=None,
                   writer: console.ReplyWriter | None = None) -> Chunk:
    """Stream (or collect, for --json) the chunks into `pieces`, through `writer` (the answer on
    stdout, the reasoning on stderr); return the last one with the full text in it. `reading`,
    the prompt's progress line, goes away at the first chunk."""
    writer = writer or console.ReplyWriter(split=False)
    for chunk in chunks:
        if reading is not None and not pieces:
            reading.close()
        pieces.append(chunk)
        if not as_json:
            writer.write(chunk.text)
    if not as_json:
        writer.close()
    text = "".join(c.text for c in pieces)
    if not as_json and writer.answer and not writer.answer.endswith("\n"):
        write_out("\n")
    return dataclasses.replace(chunk, text=text)


def generation_json(last: Chunk, load_s: float, draft: int = 0, split: bool = True, opened: bool = False) -> dict:
    """`text` is the reply as generated; `content` its answer and `reasoning_content` its
    reasoning (null when it had none, or with --reasoning-format none)."""
    thought, answer = reasoning.split(last.text, opened) if split else (None, last.text)
    out = {"text": last.text, "content": answer, "reasoning_content": thought, "prompt_tokens": last.prompt_tokens,
           "completion_tokens": last.generated_tokens, "finish_reason": last.finish_reason,
           "timings": {"load_s": round(load_s, 4), "prefill_tok_per_s": round(last.prefill_tok_per_s, 2),
                       "decode_tok_per_s": round(last.decode_tok_per_s, 2)}}
    if draft:
        out.update(drafted_tokens=last.drafted, accepted_tokens=last.accepted)
    return out
