"""tokenizer.json (or a converted tiktoken.model) + tokenizer_config.json -> ids, text, chat prompts,
and a streaming detokenizer.

Three jobs, one screen each:
- `Tokenizer.load` reads the Hugging Face files, resolves bos/eos, and compiles the chat template once.
- `Tokenizer.encode` honours `add_bos_token` without ever producing two bos (DeepSeek's own
  tokenizer.json does not add bos; ds2-tiny's post-processor does).
- `StreamDecoder` turns ids into printable text one token at a time without emitting half a UTF-8
  character: byte-level BPE splits characters (an emoji can span two tokens).
"""

from __future__ import annotations

import codecs
import functools
import json
from pathlib import Path
from typing import Any, Iterable

import tokenizers

from ds2cli.json_files import read_json_object
from ds2cli.errors import TokenizerError
from ds2cli.text import literal
from ds2cli.text.chat_template import compile_template, one_line, render
from ds2cli.text.reasoning import THINK_CLOSE, without_reasoning
from ds2cli.text.tiktoken_convert import byte_level_alphabet, has_tiktoken
from ds2cli.text.tiktoken_convert import load_backend as tiktoken_backend

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# DeepSeek's special-token names, used when there is no tokenizer_config.json to name them.
DEEPSEEK_BOS_TOKEN = "<｜begin▁of▁sentence｜>"
DEEPSEEK_EOS_TOKEN = "<｜end▁of▁sentence｜>"

# DeepSeek-V2-Chat's template (as shipped in its tokenizer_config.json), used when a model
# directory carries none: `{bos}[system\n\n]User: {q}\n\nAssistant: {a}{eos}...Assistant:`.
FALLBACK_CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# What a lossy UTF-8 decode writes for bytes that do not (yet) form a character.
REPLACEMENT_CHAR = "\ufffd"



COUNT_SLICE = 1 << 16          # characters a slice of count_at_least

class Tokenizer:
    """A `tokenizers.Tokenizer` plus what tokenizer_config.json says about bos/eos and chat."""

    def __init__(self, backend: tokenizers.Tokenizer, bos_token: str | None, eos_token: str | None,
                 add_bos_token: bool, chat_template: str | None):
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template          # as written in the config; None -> fallback
        self._bos_id = _token_id(backend, bos_token, "bos_token")
        self._eos_id = _token_id(backend, eos_token, "eos_token")
        # Whether encode() starts with bos: the config asks for it, or tokenizer.json adds it itself.
        self._add_bos = self._bos_id is not None and (add_bos_token or self._post_processor_adds_bos())
        self._template = compile_template(chat_template or FALLBACK_CHAT_TEMPLATE)
        self._template_name = "chat template"      # what its errors start with
        # bos, eos, pad, <|EOT|>: tokens the tokenizer marks special, which generated text leaves
        # out (as Hugging Face's skip_special_tokens, llama-cli without --special); DeepSeek's
        # tool-call, FIM and <think> tokens are added but not special, so replies keep them
        self.special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        # every added token, special or not: the control tokens only markup may yield
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self.control_ids = frozenset(self._added)
        self._added_re = literal.added_pattern(self._added.values())
        # Byte-level BPE (GPT-2 style, as DeepSeek's): each token is a run of raw bytes.
        self.byte_level = isinstance(backend.decoder, tokenizers.decoders.ByteLevel)
        self._alphabet = byte_level_alphabet() if self.byte_level else {}
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def load(cls, model_dir, vocab_size: int | None = None) -> "Tokenizer":
        """Read `model_dir`/tokenizer.json and (if present) tokenizer_config.json.

        `vocab_size` is the model's embedding size: a tokenizer that can produce ids past it is refused.
        """
        model_dir = Path(model_dir)
        backend = _read_backend(model_dir / TOKENIZER_FILE)
        if vocab_size is not None:
            _check_vocab_size(backend, vocab_size)
        config = _read_config(model_dir / TOKENIZER_CONFIG_FILE)
        bos = _special_token(config, "bos_token", backend, DEEPSEEK_BOS_TOKEN)
        eos = _special_token(config, "eos_token", backend, DEEPSEEK_EOS_TOKEN)
        return cls(backend, bos, eos, config.get("add_bos_token") is True,
                   _select_template(config.get("chat_template")))

    # ---- ids ----
    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's own eos; callers add the ids config.json / generation_config.json name."""
        return () if self._eos_id is None else (self._eos_id,)

    @property
    def adds_bos(self) -> bool:
        """Whether `encode` starts a text with bos."""
        return self._add_bos

    def added_token_id(self, text: str) -> int | None:
        """The id of the added token spelled exactly `text` (a special or control token such as
        "<｜fim▁hole｜>"), or None when the tokenizer has none."""
        for token_id, token in self._backend.get_added_tokens_decoder().items():
            if token.content == text:
                return token_id
        return None

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Text -> ids. With special tokens, the ids start with exactly one bos when the tokenizer wants it.
        `parse_special` (as llama.cpp's) reads a special token's text as that token; without it,
        as the ordinary tokens of its characters. A rendered chat prompt (`render_chat`) keeps
        its messages' own special-token text as text either way (literal.py)."""
        if not parse_special:
            ids = self._plain_ids(text)
        elif isinstance(text, literal.Rendered) and text.literal:
            ids = self._rendered_ids(text)
        else:
            ids = self._ids(text, add_special_tokens)
        if not (add_special_tokens and self._add_bos):
            return ids
        # Prepend bos ourselves (DeepSeek's tokenizer.json doesn't) and drop any the
        # post-processor or a literal "<｜begin▁of▁sentence｜>" in the text already put there.
        first = 0
        while first < len(ids) and ids[first] == self._bos_id:
            first += 1
        return [self._bos_id] + ids[first:]

    def count_at_least(self, text: str, stop: int) -> int:
        """A lower bound on len(encode(text)), found in slices that stop once `stop` is passed, so
        that a prompt far longer than any context is refused without tokenizing all of it (a
        10 MB prompt took 1.7 GB and 12 s to tokenize whole). A text too short to reach `stop`
        even at 4 tokens a character is not looked at (0). Slices end before whitespace; each cut
        may add a token that the whole text would not have, so one a cut is taken off."""
        if 4 * len(text) < stop:
            return 0
        total, at, cuts = 0, 0, 0
        while at < len(text) and total - cuts <= stop:
            end = min(len(text), at + COUNT_SLICE)
            if end < len(text):
                space = max(text.rfind(" ", at + COUNT_SLICE // 2, end), text.rfind("\n", at + COUNT_SLICE // 2, end))
                end = space if space > at else end
                cuts += 1
            total += len(self._ids(text[at:end], add_special_tokens=False))
            at = end
        return max(0, total - cuts)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """The backend's ids for `text`. Through encode_batch, which releases the GIL while it
        runs (encode holds it throughout): a long prompt tokenized on one server thread never
        stops the others, the scheduler's passes included. The ids are encode's."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _plain_ids(self, text: str) -> list[int]:
        """`text`'s ids with no added token matched: a text without any added token's text is
        what the backend gives (DeepSeek's tokenizers have no normalizer to match them through);
        else the backend's parts without its added tokens encode it (_plain_backend)."""
        if self._added_re is None or self._added_re.search(text) is None:
            return self._ids(text, add_special_tokens=False)
        return self._plain_backend.encode_batch([text], add_special_tokens=False)[0].ids

    def _rendered_ids(self, text: literal.Rendered) -> list[int]:
        """A rendered chat prompt's ids: the control tokens the backend finds in its markup, the
        text between them (its literal spans included) as plain text."""
        encoding = self._backend.encode_batch([str(text)], add_special_tokens=False)[0]
        kept = literal.kept_controls(encoding.ids, encoding.offsets, self.control_ids, text.literal)
        if kept is None:
            return encoding.ids
        out, at = [], 0
        for start, end, token in kept:
            out += self._plain_ids(text[at:start])
            out.append(token)
            at = end
        return out + self._plain_ids(text[at:])

    @functools.cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        """The backend without its added tokens: its model, normalizer, pre-tokenizer and
        decoder shared (no copy of the vocabulary), no added vocabulary to match."""
        plain = tokenizers.Tokenizer(self._backend.model)
        for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
            if getattr(self._backend, part) is not None:
                setattr(plain, part, getattr(self._backend, part))
        return plain

    def control_text(self, token_id: int) -> str | None:
        """An added token's text (bos, <｜User｜>, a FIM token), or None for an ordinary token."""
        return self._added.get(token_id)

    @functools.cached_property
    def longest_token(self) -> int:
        """The most characters one token stands for, so that a text of more than ctx x this
        many characters is known to be longer than the context before it is tokenized: a token's
        string is as long as the text it covers or longer (byte-level BPE spells each byte, at
        most one character, as one letter; an added token such as bos is matched as its text)."""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text, special tokens included (callers strip eos themselves)."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """A byte-level token's raw bytes, as the ByteLevel decoder maps them: a token spelled in
        the byte alphabet is those bytes; any other (an added token such as bos) is its UTF-8."""
        cached = self._bytes.get(token_id)
        if cached is None:
            token = self._backend.id_to_token(token_id) or ""    # decode skips unknown ids
            alphabet = self._alphabet
            cached = (bytes(alphabet[c] for c in token) if all(c in alphabet for c in token)
                      else token.encode("utf-8"))
            self._bytes[token_id] = cached
        return cached

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (may be '\\ufffd' where a character spans tokens)."""
        return self.decode([token_id])

    def _post_processor_adds_bos(self) -> bool:
        """ds2-tiny's tokenizer.json prepends bos in its post-processor; DeepSeek's does not."""
        return self._backend.encode("", add_special_tokens=True).ids[:1] == [self._bos_id]

    # ---- chat ----
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """Messages -> the prompt string, exactly as Hugging Face's apply_chat_template renders it
        (`tools`, OpenAI's tool list, is the template's `tools` variable, as in HF). Earlier
        turns' reasoning reaches the template only if it reads it (reasoning.without_reasoning).
        The result is a `literal.Rendered`: it knows where the messages' own special-token text
        lies, which `encode` keeps as text."""
        _check_messages(messages)
        source = self.chat_template or FALLBACK_CHAT_TEMPLATE
        messages = without_reasoning(messages, source)
        hider = literal.Hider(self._added_re, keep_think=THINK_CLOSE in source) if self._added_re else None
        if hider is not None:
            messages, tools = hider.hide(messages), hider.hide(tools)
        variables: dict[str, Any] = {"messages": messages,
                                     "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            variables["tools"] = tools
        # Like HF's special_tokens_map: an unset token is simply undefined (renders as "").
        if self.bos_token is not None:
            variables["bos_token"] = self.bos_token
        if self.eos_token is not None:
            variables["eos_token"] = self.eos_token
        text = render(self._template, variables, self._template_name)
        return hider.restore(text) if hider is not None else literal.Rendered(text)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """Render, then encode without special tokens (the template writes bos itself), the
        messages' own text as text."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)

    def set_chat_template(self, source: str, file: str | None = None) -> None:
        """Replace the checkpoint's chat template (compiled now, so a syntax error shows at once);
        its errors, now and when it renders, name `file` when it came from one."""
        name = "chat template" if file is None else f"chat template {file}"
        self._template = compile_template(source, name)
        self._template_name = name
        self.chat_template = source

    def stream_decoder(self, special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, special)


class StreamDecoder:
    """Ids in, printable text out, never half a character; what it emits always equals `decode`
    of every id so far once that decode is whole.

    Decoding each token alone is wrong: a character split across tokens decodes as '\\ufffd'.
    For byte-level BPE (every DeepSeek tokenizer) each token is a run of bytes, so the bytes go
    through an incremental UTF-8 decoder that holds back at most the 3 bytes of an unfinished
    character (the real limit of UTF-8) and replaces invalid bytes exactly as the tokenizer's
    lossy decode does. Other decoders fall back to decoding a window that starts one step back
    (like TGI / HF's TextStreamer, since some decoders change spacing at a sequence's start),
    emitting the text beyond what that context produced, and waiting while it ends in '\\ufffd'.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self._tokenizer = tokenizer
        self._hidden = frozenset() if special else tokenizer.special_ids     # ids whose text is left out
        self._token_bytes = tokenizer.token_bytes if tokenizer.byte_level else None
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._window: list[int] = []    # fallback: ids from the previous emit's start
        self._read = 0                  # fallback: window[:_read] is context already printed

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly ""): none for a special token
        unless the decoder was made with `special`."""
        if token_id in self._hidden:
            return ""
        if self._token_bytes is not None:
            return self._utf8.decode(self._token_bytes(int(token_id)))
        self._window.append(int(token_id))
        prefix, text = self._decode_window()
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT_CHAR):
            return ""                   # nothing new, or a character still unfinished
        self._advance()
        return text[len(prefix):]

    def flush(self) -> str:
        """Whatever is still held back at the end of generation (incomplete bytes as '\\ufffd')."""
        if self._token_bytes is not None:
            return self._utf8.decode(b"", final=True)
        prefix, text = self._decode_window()
        self._advance()
        return text[len(prefix):]

    def _advance(self) -> None:
        # The just-emitted ids become the next window's context, so the window stays short.
        self._window = self._window[self._read:]
        self._read = len(self._window)

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        return decode(self._window[:self._read]), decode(self._window)


# ---- loading ----
def _read_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file() and has_tiktoken(path.parent):
        # Moonlight and Kimi-K2 ship tiktoken.model plus Python code ds2 never runs: convert it (cached).
        return tiktoken_backend(path.parent)
    if not path.is_file():
        raise TokenizerError(f"{path} not found: the model directory needs a Hugging Face tokenizer.json")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust loader raises a bare Exception for every kind of bad file
        raise TokenizerError(f"{path} is not a valid tokenizer.json: {one_line(str(exc))}") from exc


def _read_config(path: Path) -> dict:
    """tokenizer_config.json as a dict; {} when absent (every field has a default)."""
    if not path.exists():
        return {}
    return read_json_object(path, TokenizerError)


def _special_token(config: dict, field: str, backend: tokenizers.Tokenizer,
                   deepseek_name: str) -> str | None:
    """The config's token (a string or an AddedToken object); without one, DeepSeek's name if the tokenizer has it."""
    if field not in config:
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        return deepseek_name if deepseek_name in added else None
    value = config[field]
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{TOKENIZER_CONFIG_FILE}: {field} must be a string or an AddedToken object,"
                         f" got {one_line(json.dumps(value))}")


def _token_id(backend: tokenizers.Tokenizer, token: str | None, field: str) -> int | None:
    if token is None:
        return None
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise TokenizerError(f"{field} {token!r} is not in {TOKENIZER_FILE}")
    return token_id


def _check_vocab_size(backend: tokenizers.Tokenizer, vocab_size: int) -> None:
    """Refuse a tokenizer that can produce ids the model's embedding has no row for."""
    added_ids = backend.get_added_tokens_decoder().keys()
    n_ids = max([backend.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added_ids)])
    if n_ids > vocab_size:
        raise TokenizerError(f"the tokenizer has {n_ids} token ids but the model's vocab_size is "
                             f"{vocab_size}: tokenizer and checkpoint do not belong together")


# ---- chat templates ----
def _select_template(raw: Any) -> str | None:
    """A template string, or HF's list of {name, template} of which we use "default"."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list) and all(isinstance(t, dict) for t in raw):
        named = {t.get("name"): t.get("template") for t in raw}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise TokenizerError(f"{TOKENIZER_CONFIG_FILE}: chat_template has no 'default' entry "
                             f"(it has {sorted(map(str, named))})")
    raise TokenizerError(f"{TOKENIZER_CONFIG_FILE}: chat_template must be a string or a list "
                         f"of {{name, template}}, not {type(raw).__name__}")


def _check_messages(messages: Any) -> None:
    """A chat is a list of {"role": str, ...} dicts; a bare string is a common mistake."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise TokenizerError(f"chat messages must be a list of {{\"role\", \"content\"}} dicts, "
                             f"not {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TokenizerError(f"chat message {i} must be a dict with a string \"role\", got {one_line(repr(m))[:80]}")


