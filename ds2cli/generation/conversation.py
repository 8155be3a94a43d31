"""A multi-turn conversation over one persistent latent cache.

Each turn renders the whole history through the chat template, keeps the longest prefix of
tokens the cache already holds, and prefills only what differs (usually just the new turn).
A reply's reasoning (`<think>`...`</think>`) is kept in its message as `reasoning_content`, beside
the answer in `content`, and saved with it; the template never sees it again (unless it reads
that field: Tokenizer.render_chat)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

from ds2cli.json_files import JSON_ERRORS, json_error
from ds2cli.errors import ContextFullError, Ds2Error
from ds2cli.generation.generate import Chunk, lstrip_reply, stream_generate
from ds2cli.model.transformer import Model
from ds2cli.generation import saved_cache
from ds2cli.generation.sampling import Sampler
from ds2cli.model.cache import common_prefix
from ds2cli.text import reasoning
from ds2cli.user_files import read_bounded, write_atomic
from ds2cli.wording import plural

ROLES = ("system", "user", "assistant")
TRANSCRIPT_LIMIT = 64 << 20     # a saved conversation's default limit: far beyond any context


def write_text_atomic(path: Path, text: str) -> None:
    """Write beside `path` (a symlink's target), then rename: a crash never leaves half a file,
    and the file keeps its mode."""
    write_atomic(Path(path), lambda f: f.write(text.encode("utf-8")), clean=False)


def read_messages(path: Path, limit: int = TRANSCRIPT_LIMIT) -> list[dict]:
    """A saved conversation: a JSON list of {role, content} (or an object with "messages"),
    at most `limit` bytes, measured before it is read."""
    if not Path(path).exists():
        raise Ds2Error(f"conversation file {path} does not exist")
    raw = read_bounded(path, limit, "conversation file", "--max-prompt-bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, *JSON_ERRORS) as e:
        raise Ds2Error(f"conversation file {path} is not valid JSON: {json_error(e)}") from None
    return checked_messages(data, path)


def checked_messages(data, path: Path) -> list[dict]:
    messages = data.get("messages") if isinstance(data, dict) else data
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        and isinstance(m.get(reasoning.REASONING_FIELD) or "", str) for m in messages)
    if not ok:
        raise Ds2Error(f"{path} is not a conversation: expected a JSON list of "
                       f"{{\"role\", \"content\"}} messages")
    field = reasoning.REASONING_FIELD
    return [{"role": m["role"], "content": m["content"], **({field: m[field]} if m.get(field) is not None else {})}
            for m in messages]


class ChatSession:
    def __init__(self, model: Model, capacity: int, system: str | None = None,
                 warn: Callable[[str], None] = lambda message: None, split_reasoning: bool = True,
                 special: bool = False):
        self.model = model
        self.split_reasoning = split_reasoning      # False: a reply's <think>...</think> stays in its content
        self.opened = False                         # the last prompt opened <think> (R1's template does)
        self.special = special                      # special tokens' text in replies (chat --special)
        self.cache = model.new_cache(capacity)
        self.cached_ids: list[int] = []      # the tokens whose latents the cache holds
        self.messages: list[dict] = []
        self.warn = warn
        if system:
            self.set_system(system)

    def set_system(self, text: str) -> None:
        self.messages = [m for m in self.messages if m["role"] != "system"]
        self.messages.insert(0, {"role": "system", "content": text})

    def clear(self) -> None:
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self.cache.reset()
        self.cached_ids = []

    def load(self, messages: list[dict]) -> None:
        self.clear()
        self.messages = list(messages)

    def save(self, path: str | Path) -> None:
        try:
            write_text_atomic(Path(path), json.dumps(self.messages, ensure_ascii=False, indent=2) + "\n")
        except OSError as e:
            raise Ds2Error(f"cannot save the conversation to {path}: {e.strerror}") from None

    def save_session(self, path: Path) -> None:
        """The conversation and the latent cache of what it has read (saved_cache.py): resuming it
        reads nothing again."""
        saved_cache.save(path, self.model, self.cache, self.cached_ids, {"messages": self.messages},
                         kind=saved_cache.SESSION, clean=True)     # the chat holds the session's lock

    def resume_session(self, path: Path) -> str | None:
        """The conversation `save_session` wrote, its cache as it was. A session of another model
        or ds2 version keeps its conversation: its messages come back, to be read again by this
        model at the next turn; the reason is returned, to be said (None: resumed as it was)."""
        try:
            cache, ids, state = saved_cache.load(path, self.model, self.cache.capacity, kind=saved_cache.SESSION)
        except saved_cache.ForeignCacheError as e:
            self.load(checked_messages(e.state, path))
            return str(e)
        self.messages = checked_messages(state, path)
        self.cache, self.cached_ids = cache, ids
        return None

    def _fit(self, reserve: int) -> list[int]:
        """Render the history with the generation prompt, dropping the oldest whole turns
        (never the system message) until it leaves `reserve` free positions: room for the reply,
        said in the warning, since a turn dropped at 48 of 100 tokens looks early otherwise."""
        tokenizer = self.model.tokenizer
        while True:
            text = tokenizer.render_chat(self.messages, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) + reserve <= self.cache.capacity:
                self.opened = reasoning.opens_reasoning(text)
                return ids
            first = next(i for i, m in enumerate(self.messages) if m["role"] != "system")
            rest = self.messages[first + 1:]
            # a turn is a user message and the assistant replies that follow it
            nxt = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
            if nxt is None:
                raise ContextFullError(f"this message ({len(ids)} tokens with the history that "
                                       f"cannot be dropped) does not fit in the context of "
                                       f"{self.cache.capacity} tokens with {reserve} kept for the reply")
            dropped = nxt + 1
            self.messages = self.messages[:first] + rest[nxt:]
            self.warn(f"context full: dropped the oldest turn ({plural(dropped, 'message')}): "
                      f"{len(ids)} tokens of history + {reserve} kept for the reply (-n, at most half "
                      f"the context) pass its {self.cache.capacity}")

    def reply(self, text: str, sampler: Sampler, max_new_tokens: int,
              stop: tuple[str, ...] = (), draft: int = 0,
              progress: Callable[[int, int], None] | None = None) -> Iterator[Chunk]:
        """Add a user message and stream the assistant's reply. The reply (even a cut-off one)
        joins the history; the cache keeps every token it processed."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self._fit(reserve=min(max_new_tokens, self.cache.capacity // 2))
        except Ds2Error:  # the context is full or the chat template failed: this turn never happened
            self.messages.pop()
            raise
        self.cut = None     # why the reply stopped short, once it has: for the caller to say
        keep = common_prefix(self.cached_ids, ids)
        keep = min(keep, len(ids) - 1)          # at least one token must run to get logits
        self.cache.truncate(keep)
        self.cached_ids = ids[:keep]
        pieces, generated = [], []
        try:
            for chunk in lstrip_reply(stream_generate(self.model, ids[keep:], self.cache, sampler,
                                                      max_new_tokens, stop, context=ids[:keep], draft=draft,
                                                      progress=progress, special=self.special)):
                pieces.append(chunk.text)
                if chunk.finish_reason:
                    generated = chunk.tokens
                    if chunk.finish_reason == "length" and len(generated) < max_new_tokens:
                        self.cut = (f"the context of {self.cache.capacity} tokens is full: the reply was cut "
                                    f"after {len(generated)} of the {max_new_tokens} tokens allowed (-n); "
                                    f"a larger --ctx leaves more room")
                yield chunk
        finally:
            # Runs on completion, Ctrl-C or an error alike: the history gets what was shown,
            # and cached_ids is whatever the cache really holds.
            fed = ids + generated
            self.cached_ids = fed[:self.cache.length] if generated else ids[:self.cache.length]
            self.messages.append(self.reply_message("".join(pieces)))

    def reply_message(self, text: str) -> dict:
        """The assistant's message for a reply: its answer, and its reasoning apart."""
        thought, answer = reasoning.split(text, self.opened) if self.split_reasoning else (None, text)
        return {"role": "assistant", "content": answer.strip(),
                **({reasoning.REASONING_FIELD: thought} if thought is not None else {})}
