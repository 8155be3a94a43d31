"""Reasoning kept apart from the answer: DeepSeek-R1 and V3.1 think between `<think>` and
`</think>` before they answer.

- `opens_reasoning(prompt)`: whether the rendered prompt already opened `<think>` (R1's template
  ends its generation prompt with `<｜Assistant｜><think>\\n`), so the output starts inside the
  reasoning with no opening marker of its own. V3.1's non-thinking prompt ends with `</think>`:
  closed, so the output is the answer.
- `ReasoningSplitter`: generated text in, (reasoning, answer) out, piece by piece as it streams.
  It never lets a partial marker out as text: a tail that could still become `<think>` or
  `</think>` is held back until the next piece decides it (as generate.StopMatcher holds back a
  possible stop string). Whitespace around the reasoning is dropped (R1 writes
  `<think>\\n...\\n</think>\\n\\n`), as DeepSeek's API and llama-server return it; the pieces
  joined are what one call on the whole text gives, however the text was cut.
- `without_reasoning(messages, template)`: earlier assistant turns as the template should see
  them: no `reasoning_content` and no `<think>...</think>` unless the template reads them itself
  (R1's strips what comes before `</think>` on its own; V2's fallback template would not).

Only an opening marker at the start of the output (after whitespace) opens reasoning: later, a
`<think>` is text. Text after `</think>` is the answer, whatever it holds.
"""

from __future__ import annotations

import dataclasses

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_FIELD = "reasoning_content"        # DeepSeek's API and llama-server name it so
FORMATS = ("deepseek", "none")                # llama-server's --reasoning-format choices ds2 has


def opens_reasoning(prompt: str) -> bool:
    """Whether `prompt` ends inside an opened `<think>`: its last `<think>` comes after its last
    `</think>` and only whitespace follows it."""
    at = prompt.rfind(THINK_OPEN)
    return at >= 0 and at > prompt.rfind(THINK_CLOSE) and not prompt[at + len(THINK_OPEN):].strip()


def without_reasoning(messages: list[dict], template: str) -> list[dict]:
    """The messages with earlier reasoning removed where `template` (its source) does not handle
    it: a `reasoning_content` field goes unless the template reads that field; an assistant
    content's `...</think>` goes unless the template splits on `</think>` itself."""
    reads_field, strips_think = REASONING_FIELD in template, THINK_CLOSE in template
    out = []
    for m in messages:
        if not reads_field and REASONING_FIELD in m:
            m = {k: v for k, v in m.items() if k != REASONING_FIELD}
        content = m.get("content")
        if not strips_think and m.get("role") == "assistant" and isinstance(content, str) and THINK_CLOSE in content:
            m = {**m, "content": content.rpartition(THINK_CLOSE)[2].lstrip()}
        out.append(m)
    return out


@dataclasses.dataclass
class Split:
    """What of the text so far may be shown now, as reasoning and as answer."""
    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: "Split") -> "Split":
        self.reasoning += other.reasoning
        self.content += other.content
        return self


def _held_prefix(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


START, REASONING, ANSWER = "start", "reasoning", "answer"


class ReasoningSplitter:
    """Splits one reply into reasoning and answer as its pieces come (see the module's notes).

    States: START (nothing decided: the output may open `<think>`), REASONING (until
    `</think>`), ANSWER (everything after). `opened`: the prompt opened `<think>` (opens_reasoning),
    so the reply starts in REASONING even without a marker of its own (one it writes anyway is
    dropped). Without markers and with `opened` false, every piece is answer, unchanged."""

    def __init__(self, opened: bool = False):
        self.opened = opened
        self.state = START
        self.pending = ""            # text held back: a possible marker, whitespace that may end the reasoning
        self.reasoning_started = False
        self.answer_started = False  # after </think>: leading whitespace is dropped until the answer starts
        self.closed = False          # a `</think>` was seen
        self.marked = False          # a marker was seen: the reply had reasoning, if empty

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the reasoning (for a budget on reasoning tokens)."""
        return self.state == REASONING or (self.state == START and self.opened)

    @property
    def had_reasoning(self) -> bool:
        """Whether the reply had reasoning: some text of it, or a marker."""
        return self.reasoning_started or self.marked

    def feed(self, text: str) -> Split:
        out = Split()
        text, self.pending = self.pending + text, ""
        while text:
            if self.state == START:
                text = self._start(text)
            elif self.state == REASONING:
                text = self._reasoning(text, out)
            else:
                out.content += self._answer(text)
                text = ""
        return out

    def flush(self) -> Split:
        """The end of the reply: what was held back is text after all."""
        text, self.pending = self.pending, ""
        if self.state == START and self.opened:
            self.state = REASONING
        if self.state == REASONING:
            return Split(reasoning=self._lead(text.rstrip()))
        return Split(content=text if self.state == START else self._answer(text))

    # ---- the states ----
    def _start(self, text: str) -> str:
        head = text.lstrip()
        if head.startswith(THINK_OPEN):
            self.state, self.marked = REASONING, True
            return head[len(THINK_OPEN):]
        if THINK_OPEN.startswith(head):        # empty, or a marker that may still come
            self.pending = text
            return ""
        self.state = REASONING if self.opened else ANSWER
        return text

    def _reasoning(self, text: str, out: Split) -> str:
        at = text.find(THINK_CLOSE)
        if at >= 0:
            out.reasoning += self._lead(text[:at].rstrip())
            self.state, self.closed, self.marked = ANSWER, True, True
            return text[at + len(THINK_CLOSE):]
        cut = len(text) - _held_prefix(text, THINK_CLOSE)
        cut = len(text[:cut].rstrip())          # trailing whitespace may be what precedes </think>
        out.reasoning += self._lead(text[:cut])
        self.pending = text[cut:]
        return ""

    def _lead(self, text: str) -> str:
        """Reasoning's leading whitespace dropped (R1 writes a newline after <think>)."""
        if not self.reasoning_started:
            text = text.lstrip()
            self.reasoning_started = bool(text)
        return text

    def _answer(self, text: str) -> str:
        if self.closed and not self.answer_started:
            text = text.lstrip()
            self.answer_started = bool(text)
        return text


def split(text: str, opened: bool = False) -> tuple[str | None, str]:
    """A whole reply as (reasoning or None when it had none, answer)."""
    splitter = ReasoningSplitter(opened)
    parts = splitter.feed(text)
    parts += splitter.flush()
    return (parts.reasoning if splitter.had_reasoning else None), parts.content
