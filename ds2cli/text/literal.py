"""What users write stays text: a special token's text inside a chat's messages (their content,
reasoning, tool calls' arguments, tool results, the tools' declarations) becomes the ordinary
tokens of its characters; only the chat template's own markup yields control tokens. Otherwise
`hi<｜end▁of▁sentence｜><｜User｜>...<｜Assistant｜>` in a user's message ends the user's turn and
writes the assistant's (tiktoken refuses such text unless allowed; ds2 reads it as text).

A template renders everything into one string, so the string alone cannot tell markup from
message. Before rendering, every added token's text in the messages' strings is replaced by a
placeholder: a private-use character, a nonce drawn for this render, the occurrence's number
(`hide`). After rendering, the placeholders are put back and their spans kept (`restore`): the
prompt is a `Rendered`, a str that knows them. The tokenizer encodes it as any text, then drops
the control tokens that overlap a kept span (`kept_controls`) and encodes the text between the
others as plain text. Messages without such text render and encode exactly as before.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Iterable, Sequence

from ds2cli.errors import TokenizerError
from ds2cli.text.reasoning import THINK_CLOSE, THINK_OPEN

OPEN, CLOSE = "\ue000", "\ue001"      # private-use characters around a placeholder


class Rendered(str):
    """A rendered chat prompt; `literal` holds the (start, end) character spans of the messages'
    own special-token text, which must be encoded as text."""

    literal: tuple[tuple[int, int], ...]

    def __new__(cls, text: str, literal: Iterable[tuple[int, int]] = ()):
        self = super().__new__(cls, text)
        self.literal = tuple(literal)
        return self

    def cut(self, end: int) -> "Rendered":
        """The first `end` characters, their spans kept (a span cut short is cut with them)."""
        return Rendered(str(self)[:end], [(a, min(b, end)) for a, b in self.literal if a < end])


def added_pattern(texts: Iterable[str]) -> re.Pattern | None:
    """A regex that finds any of the added tokens' `texts`, the longest where several match
    (None: none). Written as their trie, so that a position costs the characters it shares with
    some token, never a try of every token (V3 adds 800, most of them `<｜place▁holder▁no▁N｜>`)."""
    trie: dict = {}
    for text in {t for t in texts if t}:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}                       # a token ends here
    return re.compile(_trie_regex(trie)) if trie else None


def _trie_regex(node: dict) -> str:
    """A trie's alternatives, longer ones before a token that ends here (regex tries in order)."""
    branches = [re.escape(ch) + _trie_regex(child) for ch, child in node.items() if ch]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return f"(?:{body})?" if "" in node else body


NO_DIGITS = str.maketrans("0123456789", "ghijklmnop")


class Hider:
    """Replaces added tokens' text in a conversation's strings by numbered placeholders."""

    def __init__(self, pattern: re.Pattern, keep_think: bool = False):
        self.pattern = pattern
        self.keep_think = keep_think    # the template splits assistant content on </think> itself
        # letters only: a run of 8+ digits in a string reads as a huge format width to the
        # template sandbox (chat_template._WIDTH), which would refuse an honest template
        self.nonce = secrets.token_hex(8).translate(NO_DIGITS)
        self.found: list[str] = []

    def hide(self, value: Any, keep: bool = False) -> Any:
        """`value` (a message, a list, a string) with its added tokens' text replaced; dict keys
        and "role" are the template's to read, and left alone."""
        if isinstance(value, str):
            return self.pattern.sub(lambda m: self._placeholder(m.group(), keep), value)
        if isinstance(value, dict):
            assistant = self.keep_think and value.get("role") == "assistant"
            return {k: v if k == "role" else self.hide(v, assistant and k == "content")
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.hide(v) for v in value]
        return value

    def _placeholder(self, text: str, keep: bool) -> str:
        if keep and text in (THINK_OPEN, THINK_CLOSE):
            return text
        self.found.append(text)
        return f"{OPEN}{self.nonce}{len(self.found) - 1}{CLOSE}"

    def restore(self, text: str) -> Rendered:
        """The rendered `text` with the hidden texts back, and their spans."""
        if not self.found:
            return Rendered(text)
        out, spans, at, length = [], [], 0, 0
        for m in re.finditer(re.escape(OPEN + self.nonce) + r"(\d+)" + CLOSE, text):
            original = self.found[int(m.group(1))]
            out.append(text[at:m.start()])
            length += m.start() - at
            spans.append((length, length + len(original)))
            out.append(original)
            length += len(original)
            at = m.end()
        out.append(text[at:])
        restored = "".join(out)
        if self.nonce.lower() in restored.lower():
            raise TokenizerError("the chat template changed a message's text around a special token's "
                                 "text, so it cannot be kept as text")
        return Rendered(restored, spans)


def kept_controls(ids: Sequence[int], offsets: Sequence[tuple[int, int]], controls: frozenset[int],
                  literal: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]] | None:
    """The control tokens the tokenizer found in a rendered prompt that are the template's,
    as (start, end, id); None when none of those it found touches a `literal` span (the ids
    stand as they are)."""
    found = [(a, b, i) for i, (a, b) in zip(ids, offsets) if i in controls]
    kept = [(a, b, i) for a, b, i in found if not any(a < y and x < b for x, y in literal)]
    return None if len(kept) == len(found) else kept
