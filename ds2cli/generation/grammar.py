"""Constrained output: a grammar (JSON, a JSON Schema, or a Lark grammar) and, per sequence, the
token mask it allows next.

    grammar = json_schema_grammar(schema)          # GrammarError names what is wrong; at parse time
    constraint = Constraint(grammar, vocabulary(tokenizer, vocab_size, eos_ids))  # one per sequence
    constraint.allowed_mask()  -> (V,) bool         # what may come next (eos only where it accepts)
    constraint.apply(logits)   -> logits, disallowed -> -inf
    constraint.advance(token); constraint.rollback(n); constraint.is_accepting(); constraint.done
    constraint.valid_prefix(draft)  -> how many drafted tokens the grammar would take

The library is llguidance (an optional extra: `pip install 'ds2cli[grammar]'`, or `'.[grammar]'` from a clone), chosen by
measurement against outlines-core (xgrammar is out: it needs torch; the figures, with
examples/grammar_masks.py: docs/performance.md, "Why the constants are what they are").
Both masks cost far less than a decode step, so the step time does not decide. What does:
outlines-core compiles every schema into a DFA over the whole vocabulary, paid by every request
with a new schema before its first token; free-form JSON is beyond a regular language, so its
`{"type": "object"}` regex is depth-limited (it rejects {"a":{"b":{"c":{"d":1}}}}) and slow to
compile even on a small vocabulary; and tool calls need a grammar around a schema. llguidance
compiles lazily, parses any depth, has a Lark front end with `%json{schema}` for exactly that,
and names special tokens (`<[id]>`), which DeepSeek's tool-call markers are.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import threading
from typing import Any, Sequence

import numpy as np

from ds2cli.errors import Ds2Error
from ds2cli.wording import install_hint

INSTALL_HINT = f"constrained output needs llguidance: {install_hint('grammar', 'llguidance')}"


class GrammarError(Ds2Error):
    """A schema or grammar that cannot be compiled; the message says what is wrong."""


class GrammarUnavailable(Ds2Error):
    """llguidance is not installed."""


def _llg():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the bitmask helpers)
    except ImportError:
        raise GrammarUnavailable(INSTALL_HINT) from None
    return llguidance


def available() -> bool:
    try:
        _llg()
    except GrammarUnavailable:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A checked grammar in llguidance's serialised form (what LLMatcher compiles)."""
    source: str
    kind: str           # "json_object" | "json_schema" | "lark": for logs and errors


def _checked(source: str, kind: str) -> Grammar:
    llg = _llg()
    is_error, messages = _library(llg.LLMatcher.validate_grammar_with_warnings, source)
    if is_error:
        raise GrammarError(_first_line(messages[0]) if messages else "the grammar is invalid")
    return Grammar(source, kind)


# JSON without the optional whitespace between tokens: a model's first free choice after `{` is
# otherwise often a newline, and ds2-tiny can fill max_tokens with them.
_JSON_OPTIONS = {"whitespace_flexible": False}


def json_schema_grammar(schema: Any) -> Grammar:
    """Output that parses as JSON and validates against `schema` (a JSON Schema object)."""
    if not isinstance(schema, dict):
        raise GrammarError(f"the schema must be a JSON object, not {type(schema).__name__}")
    llg = _llg()
    source = _library(llg.LLMatcher.grammar_from_json_schema, schema, defaults=_JSON_OPTIONS)
    return _checked(source, "json_schema")


def json_object_grammar() -> Grammar:
    """Any JSON object (OpenAI's response_format json_object)."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(lark: str) -> Grammar:
    return _checked(_library(_llg().LLMatcher.grammar_from_lark, lark), "lark")


def lark_json(schema: dict) -> str:
    """A JSON Schema as a Lark rule body (llguidance's `%json{...}`), for grammars around JSON."""
    schema = {**schema, "x-guidance": {**_JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a Lark string literal is a JSON string


def _first_line(message: str) -> str:
    """The library's own message, when it is one: its first line, without a parser state dump, a
    Rust source path or a panic's backtrace (which say nothing to a client and leak a build)."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    line = line.split("<state>")[0]
    line = re.sub(r"\S*/\S*\.rs\S*", "", line)
    line = " ".join(line.split())
    if not line or len(line) > 200 or "panicked" in line or "NoExtensionBias" in line:
        return "the grammar library cannot use it (a recursive or too large schema or grammar)"
    return line


def _library(call, *args, **kwargs):
    """A call into llguidance, whose failures (exceptions, and Rust panics, which Python sees as a
    BaseException) become a GrammarError of one short line."""
    try:
        return call(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit, GrammarError):
        raise
    except BaseException as e:      # pyo3's PanicException is a BaseException
        raise GrammarError(_first_line(str(e))) from None


# ---- the tokenizer, as llguidance sees it ----
_vocab_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _vocabulary(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    llg = _llg()
    # ds2's Tokenizer wraps a tokenizers.Tokenizer: llguidance reads its JSON (byte-level BPE,
    # added tokens), which is what its Hugging Face adapter does too. `vocab_size` is the model's
    # (DeepSeek pads 100002 tokens to 102400): ids past the tokenizer are never allowed.
    try:
        return llg.LLTokenizer(tokenizer._backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))
    except Exception as e:  # a tokenizer llguidance cannot read: a server-side failure, said in one line
        raise GrammarError(f"llguidance cannot read this tokenizer: {_first_line(str(e))}") from None


def vocabulary(tokenizer, vocab_size: int, eos_ids: Sequence[int]):
    """The llguidance tokenizer for `tokenizer` (built once: 1.5 s for DeepSeek's 100k tokens)."""
    with _vocab_lock:
        return _vocabulary(tokenizer, vocab_size, tuple(sorted(set(eos_ids))))


def warm(tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
    """Build the vocabulary ahead of the first request that needs it (serve runs this in a
    thread); a failure is left for that request to report."""
    try:
        vocabulary(tokenizer, vocab_size, eos_ids)
    except Ds2Error:
        pass


def special_token_id(tokenizer, text: str) -> int | None:
    """The id of `text` when the tokenizer has it as one added (special) token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 and tokenizer.token_text(ids[0]) == text else None


# ---- one sequence ----
class Constraint:
    """The grammar's state for one sequence: it follows the tokens exactly, drafts included
    (advance each token taken, rollback the ones a verification pass then rejected)."""

    def __init__(self, grammar: Grammar, vocab):
        llg = _llg()
        self.grammar, self.vocab_size = grammar, vocab.vocab_size
        self._matcher = _library(llg.LLMatcher, vocab, grammar.source, log_level=0)
        self._check()
        self._bitmask = llg.numpy.allocate_token_bitmask(1, self.vocab_size)   # (1, ceil(V/32)) int32
        self._fill = llg.numpy.fill_next_token_bitmask

    @classmethod
    def for_model(cls, grammar: Grammar, model) -> "Constraint":
        return cls(grammar, vocabulary(model.tokenizer, model.config.vocab_size, model.eos_token_ids))

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(_first_line(self._matcher.get_error()))

    def allowed_mask(self) -> np.ndarray:
        """(V,) bool: the tokens the grammar allows next (eos only where the grammar accepts)."""
        self._fill(self._matcher, self._bitmask)
        self._check()
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")  # (32*ceil(V/32),)
        return bits[:self.vocab_size].astype(bool)                              # (V,)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """Logits with every disallowed token at -inf (a new array; the model's row is kept)."""
        allowed = self.allowed_mask()
        if len(logits) > len(allowed):      # a head wider than the vocabulary: the extra ids are never text
            allowed = np.concatenate([allowed, np.zeros(len(logits) - len(allowed), bool)])
        return np.where(allowed[:len(logits)], logits, -np.inf)

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} is not allowed here by the {self.grammar.kind} grammar: "
                               f"{_first_line(self._matcher.get_error())}")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar would take from here, without taking them: a draft
        can be cut there before its verification pass (the rest would be rejected anyway)."""
        return self._matcher.validate_tokens([int(t) for t in tokens])

    def rollback(self, n_tokens: int) -> None:
        if n_tokens > 0 and not self._matcher.rollback(n_tokens):
            raise GrammarError(f"cannot roll the grammar back {n_tokens} tokens")

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but eos: generation can stop here."""
        return self._matcher.is_stopped()
