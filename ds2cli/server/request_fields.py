"""A request's fields beside its prompts, each checked: what its choices' jobs are sampled with
(`SamplingParams`, logit_bias), how long they run and what ends them (max_tokens, stop,
ignore_eos), what they report (logprobs) and how they are sent (stream), the grammar they follow
(response_format, a forced tool call); with OpenAI's error (`ApiError`) and the server's
defaults (`Defaults`) that every check reads.

No HTTP here and no prompts (jobs.py reads those and makes the jobs): this module only checks
what a client sent and says, in OpenAI's error format, what is wrong with it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ds2cli.generation import grammar as grammars
from ds2cli.generation.draft import MAX_DRAFT
from ds2cli.generation.generate import check_stops
from ds2cli.generation.logprobs import MAX_TOP
from ds2cli.generation.sampling import SamplingError, SamplingParams
from ds2cli.server import tools as tooling
from ds2cli.server.tools import ToolSet
from ds2cli.text import reasoning
from ds2cli.text.tokenizer import Tokenizer

MAX_STOPS = 16
MAX_CHOICES = 64        # prompts x n in one request: each choice is a sequence of the batch
MAX_LOGIT_BIAS = 1024   # logit_bias entries in one request


class ApiError(Exception):
    """An error a client gets as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What `ds2 serve`'s options and the checkpoint's generation_config say, before the request."""
    params: SamplingParams
    max_tokens: int
    ctx: int
    system: str | None = None   # --system: for chat requests that bring no system message
    eos_ids: tuple[int, ...] = ()   # the model's eos ids (a grammar allows them where it accepts)
    reasoning_format: str = "deepseek"  # --reasoning-format: chat replies' reasoning apart ("none": in content)
    special_in_prompts: bool = True     # raw prompts' special-token text is the token (--no-special-in-prompts: text)


@dataclasses.dataclass(frozen=True)
class Fields:
    """What a request asks beside its prompts, checked: the same for each of its choices."""
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    draft: int | None               # speculative decoding's draft length (None: the server's default)
    logprobs: int | None            # None: off; else how many top alternatives each token reports
    ignore_eos: bool                # llama-server's: only max_tokens, stop or ctx end the reply
    reasoning: bool                 # chat: <think>...</think> goes to reasoning_content
    grammar: grammars.Grammar | None = None     # response_format / a forced tool call
    vocab: Any = None               # the grammar's view of the tokenizer (grammar.vocabulary)


def read_fields(body: dict, chat: bool, echo: bool, tokenizer: Tokenizer, vocab_size: int, defaults: Defaults,
                toolset: ToolSet | None) -> Fields:
    """The request's fields beside its prompts, checked in this order (the first fault is the 400)."""
    stream, include_usage = _stream(body)
    params, max_tokens = _params(body, defaults, vocab_size), _max_tokens(body, defaults, echo)
    stop, draft, logprobs = _stop(body), _draft(body), _logprobs(body, chat)
    ignore_eos = boolean(body, "ignore_eos")
    split = chat and _reasoning_format(body, defaults) != "none"
    grammar = _grammar(body, tokenizer, toolset, max_tokens)
    vocab = None if grammar is None else _vocabulary(grammar, tokenizer, vocab_size, defaults, toolset)
    return Fields(params, max_tokens, stop, stream, include_usage, draft, logprobs, ignore_eos, split,
                  grammar, vocab)


# ---- each field ----
def _number(body: dict, name: str, integer: bool = False) -> float | int | None:
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (not integer and not math.isfinite(value)):
        raise ApiError(400, f"{name} must be {'an integer' if integer else 'a finite number'}, "
                            f"not {shown(value)}", param=name)
    return value


def boolean(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, not {shown(value)}", param=name)
    return bool(value)


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def refuse_unsupported(body: dict) -> None:
    """Refuse what ds2 cannot honour rather than silently ignore it; defaults pass."""
    best_of = _number(body, "best_of", integer=True)
    if best_of is not None and best_of != 1:
        raise ApiError(400, "best_of must be 1", param="best_of")
    if body.get("functions") not in (None, False, [], {}, ""):
        raise ApiError(400, "functions is not supported by ds2", param="functions")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name) not in (None, 0):
            raise ApiError(400, f"{name} is not supported: ds2 applies repetition_penalty (multiplicative,"
                                f" as Hugging Face does; 1 = off) instead", param=name)


def response_format(body: dict) -> grammars.Grammar | None:
    """response_format: {"type": "text"} (free), {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}} (OpenAI's shapes; /v1/completions takes the same
    field as an extension). The schema is compiled here, so a bad one is a 400 before any wait."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    param = "response_format"
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                            "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       param=param)
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return _compile(grammars.json_object_grammar, param)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema must be an object with name and schema", param=param)
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and name):
        raise ApiError(400, "response_format.json_schema.name must be a non-empty string", param=param)
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise ApiError(400, "response_format.json_schema.strict must be true or false", param=param)
    schema = spec.get("schema", {})     # OpenAI: absent means any JSON (an empty schema)
    if not isinstance(schema, dict):
        raise ApiError(400, f"response_format.json_schema.schema must be a JSON Schema object, "
                            f"not {shown(schema)}", param=param)
    return _compile(lambda: grammars.json_schema_grammar(schema), param, "response_format.json_schema.schema")


def _compile(build, param: str, what: str | None = None) -> grammars.Grammar:
    try:
        return build()
    except grammars.GrammarUnavailable as e:
        raise ApiError(400, f"{param}: {e}", param=param, code="grammar_unavailable") from None
    except grammars.GrammarError as e:
        raise ApiError(400, f"{what or param} is not a usable JSON Schema: {e}", param=param) from None


def _reasoning_format(body: dict, defaults: Defaults) -> str:
    """llama-server's per-request reasoning_format over --reasoning-format: "deepseek" puts the
    reply's <think>...</think> in reasoning_content, "none" leaves it in content; "auto" (what
    llama-server's clients send as its default) is deepseek's split."""
    value = body.get("reasoning_format")
    if value is None:
        return defaults.reasoning_format
    if value not in (*reasoning.FORMATS, "auto"):
        raise ApiError(400, f"reasoning_format must be one of {', '.join(reasoning.FORMATS)} or auto, "
                            f"not {shown(value)}", param="reasoning_format")
    return "deepseek" if value == "auto" else value


def n_samples(body: dict) -> int:
    n = _number(body, "n", integer=True)
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n must be in [1, {MAX_CHOICES}], not {n}", param="n")
    return n or 1


def _draft(body: dict) -> int | None:
    """ds2's extension: prompt-lookup speculative decoding with up to `draft` tokens a pass."""
    draft = _number(body, "draft", integer=True)
    if draft is not None and not 0 <= draft <= MAX_DRAFT:
        raise ApiError(400, f"draft must be in [0, {MAX_DRAFT}], not {draft}", param="draft")
    return draft


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"at most {MAX_STOPS} stop strings, got {len(stops)}", param="stop")
    fault = check_stops(stops)
    if fault is not None:
        raise ApiError(400, fault, param="stop")
    return tuple(stops)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top alternatives each token reports, or None when logprobs are off. Chat takes
    `logprobs: true` with `top_logprobs` N; completions also take `logprobs: N` (legacy OpenAI)."""
    value, top = body.get("logprobs"), _number(body, "top_logprobs", integer=True)
    if top is not None and not 0 <= top <= MAX_TOP:
        raise ApiError(400, f"top_logprobs must be in [0, {MAX_TOP}], not {top}", param="top_logprobs")
    if value is None or isinstance(value, bool):
        on, n = bool(value), top
    elif chat:
        raise ApiError(400, f"logprobs must be true or false (the count goes in top_logprobs), not {shown(value)}",
                       param="logprobs")
    elif isinstance(value, int) and 0 <= value <= MAX_TOP:
        if top is not None and top != value:
            raise ApiError(400, f"logprobs = {value} and top_logprobs = {top} disagree: give one", param="top_logprobs")
        on, n = True, value
    else:
        raise ApiError(400, f"logprobs must be true, false or an integer in [0, {MAX_TOP}], not {shown(value)}",
                       param="logprobs")
    if top is not None and not on:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (n or 0) if on else None


def _logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """{"token id": value}: ids in the vocabulary, values in [-100, 100] (OpenAI's range)."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise ApiError(400, "logit_bias must be an object mapping token ids to numbers", param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:      # counted before any entry is read
        raise ApiError(400, f"logit_bias has {len(bias)} entries, more than the limit of {MAX_LOGIT_BIAS}",
                       param="logit_bias")
    out = []
    for key, value in bias.items():
        # one spelling an id ("12", never " 12", "012" or "+12"), so no id is biased twice
        if not (key.isascii() and key.isdigit() and key == str(int(key))) or int(key) >= vocab_size:
            raise ApiError(400, f"logit_bias: {shown(key)} is not a token id in [0, {vocab_size}) written as "
                                f"a plain integer", param="logit_bias")
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not -100 <= value <= 100):
            raise ApiError(400, f"logit_bias[{key!r}] must be a number in [-100, 100], not {shown(value)}",
                           param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def _params(body: dict, defaults: Defaults, vocab_size: int) -> SamplingParams:
    given = {name: _number(body, name) for name in ("temperature", "top_p", "min_p", "repetition_penalty")}
    given["top_k"] = _number(body, "top_k", integer=True)
    given["seed"] = _number(body, "seed", integer=True)
    if given["seed"] is not None and given["seed"] < -1:
        raise ApiError(400, f"seed must be >= 0, or -1 for a random one; not {given['seed']}", param="seed")
    given["logit_bias"] = _logit_bias(body, vocab_size) or None
    merged = {**dataclasses.asdict(defaults.params), **{k: v for k, v in given.items() if v is not None}}
    if given["seed"] == -1:     # random, as OpenAI clients and llama.cpp send it (over --seed too)
        merged["seed"] = None
    try:
        return SamplingParams(**merged)
    except SamplingError as e:  # a value of the request's out of range (the defaults were checked)
        raise ApiError(400, f"{e.field} {e.rule}", param=e.field) from None


def _max_tokens(body: dict, defaults: Defaults, echo: bool = False) -> int:
    """0 only with echo: the prompt's own logprobs and no reply (lm-eval's loglikelihood requests)."""
    for name in ("max_completion_tokens", "max_tokens", "n_predict"):    # n_predict: llama-server's
        value = _number(body, name, integer=True)
        if value is not None:
            if value < (0 if echo else 1):
                raise ApiError(400, f"{name} must be at least 1{' (0 only with echo)' * (value == 0)}, "
                                    f"not {value}", param=name)
            return value
    return defaults.max_tokens


def _stream(body: dict) -> tuple[bool, bool]:
    stream = boolean(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    return stream, boolean(options, "include_usage")


def _grammar(body: dict, tokenizer: Tokenizer, toolset: ToolSet | None,
             max_tokens: int | None = None) -> grammars.Grammar | None:
    """The grammar the output must follow: response_format's, or a forced tool call's."""
    fmt = response_format(body)
    if toolset is not None and toolset.forced:
        if fmt is not None:
            raise ApiError(400, f"response_format cannot be combined with tool_choice {toolset.choice!r}: "
                                f"the reply is a tool call", param="response_format")
        many = toolset.choice == "required" and toolset.parallel
        fmt = _compile(lambda: tooling.call_grammar(toolset.forced, tokenizer, many, max_tokens), "tool_choice")
    if fmt is not None and body.get("stop") not in (None, [], ""):
        raise ApiError(400, "stop cannot be combined with constrained output (response_format or a forced "
                            "tool call): the grammar decides where the reply ends", param="stop")
    return fmt


def _vocabulary(grammar: grammars.Grammar, tokenizer: Tokenizer, vocab_size: int, defaults: Defaults,
                toolset: ToolSet | None) -> Any:
    """The grammar's view of the tokenizer, its first mask computed now: the matcher fails on
    some schemas that compile (a recursive $ref) when it computes its first mask, found here as
    a 400 naming the param, not later in the scheduler as a 500."""
    vocab = grammars.vocabulary(tokenizer, vocab_size, defaults.eos_ids or tokenizer.eos_token_ids)
    param = "tool_choice" if toolset is not None and toolset.forced else "response_format"
    _compile(lambda: grammars.Constraint(grammar, vocab).allowed_mask(), param)
    return vocab
