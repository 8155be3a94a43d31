"""The OpenAI API as data: request bodies in (validated into a `Job`), response objects out.

No HTTP here (serve.py does that) and no generation (generate.py): this module only checks what
a client sent and says, in OpenAI's error format, what is wrong with it.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any

from ds2cli import grammar as grammars
from ds2cli import tools as tooling
from ds2cli.errors import Ds2Error
from ds2cli.generate import Chunk
from ds2cli.sampling import SamplingError, SamplingParams
from ds2cli.tokenizer import FALLBACK_CHAT_TEMPLATE, Tokenizer
from ds2cli.tools import ToolError, ToolSet

ABORTED = "aborted"     # the engine's finish_reason for a generation the server ended (beside eos | stop | length)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_STOPS = 16


class ApiError(Exception):
    """An error a client gets as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class Job:
    """One validated request: the prompt as token ids and how to continue it."""
    chat: bool                  # chat/completions (reply lstripped) or completions (raw)
    ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    cached: int = 0             # set by the engine: prompt tokens found in the prompt cache
    grammar: grammars.Grammar | None = None     # response_format / a forced tool call
    vocab: Any = None           # the grammar's view of the tokenizer (grammar.vocabulary)
    tools: Any = None           # tools.ToolSet when the request declared tools (chat)

    def constraint(self) -> grammars.Constraint | None:
        """A fresh grammar state for this job's sequence (None when the output is free)."""
        return grammars.Constraint(self.grammar, self.vocab) if self.grammar is not None else None


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What `ds2 serve`'s options and the checkpoint's generation_config say, before the request."""
    params: SamplingParams
    max_tokens: int
    ctx: int
    system: str | None = None   # --system: for chat requests that bring no system message
    eos_ids: tuple[int, ...] = ()   # the model's eos ids (a grammar allows them where it accepts)


# ---- request fields ----
def _number(body: dict, name: str, integer: bool = False) -> float | int | None:
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (not integer and not math.isfinite(value)):
        raise ApiError(400, f"{name} must be {'an integer' if integer else 'a finite number'}, "
                            f"not {_show(value)}", param=name)
    return value


def _bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, not {_show(value)}", param=name)
    return bool(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _unsupported(body: dict) -> None:
    """Refuse what ds2 cannot honour rather than silently ignore it; defaults pass."""
    n = _number(body, "n", integer=True)
    if n is not None and n != 1:
        raise ApiError(400, f"n = {n}: ds2 generates one choice per request (n must be 1)", param="n")
    best_of = _number(body, "best_of", integer=True)
    if best_of is not None and best_of != 1:
        raise ApiError(400, "best_of must be 1", param="best_of")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "functions", "logit_bias"):
        if body.get(name) not in (None, False, [], {}, ""):
            raise ApiError(400, f"{name} is not supported by ds2", param=name)
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
                            f"not {_show(schema)}", param=param)
    return _compile(lambda: grammars.json_schema_grammar(schema), param, "response_format.json_schema.schema")


def _compile(build, param: str, what: str | None = None) -> grammars.Grammar:
    try:
        return build()
    except grammars.GrammarUnavailable as e:
        raise ApiError(400, f"{param}: {e}", param=param, code="grammar_unavailable") from None
    except grammars.GrammarError as e:
        raise ApiError(400, f"{what or param} is not a usable JSON Schema: {e}", param=param) from None


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"at most {MAX_STOPS} stop strings, got {len(stops)}", param="stop")
    return tuple(stops)


def _params(body: dict, defaults: Defaults) -> SamplingParams:
    given = {name: _number(body, name) for name in ("temperature", "top_p", "min_p", "repetition_penalty")}
    given["top_k"] = _number(body, "top_k", integer=True)
    given["seed"] = _number(body, "seed", integer=True)
    if given["seed"] is not None and given["seed"] < -1:
        raise ApiError(400, f"seed must be >= 0, or -1 for a random one; not {given['seed']}", param="seed")
    merged = {**dataclasses.asdict(defaults.params), **{k: v for k, v in given.items() if v is not None}}
    if given["seed"] == -1:     # random, as OpenAI clients and llama.cpp send it (over --seed too)
        merged["seed"] = None
    try:
        return SamplingParams(**merged)
    except SamplingError as e:  # a value of the request's out of range (the defaults were checked)
        raise ApiError(400, f"{e.field} {e.rule}", param=e.field) from None


def _max_tokens(body: dict, defaults: Defaults) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = _number(body, name, integer=True)
        if value is not None:
            if value < 1:
                raise ApiError(400, f"{name} must be at least 1, not {value}", param=name)
            return value
    return defaults.max_tokens


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    return stream, _bool(options, "include_usage")


# ---- prompts ----
def _text(text: str, param: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} is not valid Unicode (it holds a lone surrogate)", param=param) from None
    return text


def _content(message: dict, i: int) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts joined."""
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return _text(content, f"messages[{i}].content")
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return _text("".join(p["text"] for p in content), f"messages[{i}].content")
        raise ApiError(400, f"messages[{i}].content: ds2 reads only text parts", param=f"messages[{i}].content")
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        if m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of system, developer, user, assistant, tool, "
                                f"not {_show(m.get('role'))}", param=f"messages[{i}].role")
        message = {"role": ROLES[m["role"]], "content": _content(m, i)}
        if message["role"] == "assistant" and m.get("tool_calls") not in (None, []):
            message["tool_calls"] = _tool_check(tooling.assistant_calls, m, i)
            # templates (DeepSeek's) tell a call from a reply by `content is none`
            message["content"] = message["content"] or None
        if message["role"] == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise ApiError(400, f"messages[{i}].tool_call_id must be a string", param=f"messages[{i}]")
            message["tool_call_id"] = call_id
        out.append(message)
    _tool_check(tooling.check_tool_results, out)
    return out


def _tool_check(fn, *args):
    """A tools.py check, its ToolError as a 400 naming the param."""
    try:
        return fn(*args)
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None


def prompt_ids(body: dict, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """/v1/completions' prompt: a string, or token ids, alone or as a one-element list."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(_text(prompt, "prompt"))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        return list(prompt)
    raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)",
                   param="prompt")


def _chat_ids(body: dict, tokenizer: Tokenizer, defaults: Defaults, toolset: ToolSet | None) -> list[int]:
    messages = chat_messages(body)
    if defaults.system and all(m["role"] != "system" for m in messages):
        messages.insert(0, {"role": "system", "content": defaults.system})
    source = tokenizer.chat_template or FALLBACK_CHAT_TEMPLATE
    declared = None
    offered = toolset is not None and toolset.offered
    if offered or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        _tool_check(tooling.check_template, source)
    if toolset is not None:
        messages, declared = tooling.with_tools(messages, toolset, source)
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=True, tools=declared)
    except Ds2Error as e:  # the chat template refused the conversation (e.g. roles out of order)
        raise ApiError(400, str(e), param="messages") from None


def _grammar(body: dict, tokenizer: Tokenizer, toolset: ToolSet | None) -> grammars.Grammar | None:
    """The grammar the output must follow: response_format's, or a forced tool call's."""
    fmt = response_format(body)
    if toolset is not None and toolset.forced:
        if fmt is not None:
            raise ApiError(400, f"response_format cannot be combined with tool_choice {toolset.choice!r}: "
                                f"the reply is a tool call", param="response_format")
        many = toolset.choice == "required" and toolset.parallel
        fmt = _compile(lambda: tooling.call_grammar(toolset.forced, tokenizer, many), "tool_choice")
    if fmt is not None and body.get("stop") not in (None, [], ""):
        raise ApiError(400, "stop cannot be combined with constrained output (response_format or a forced "
                            "tool call): the grammar decides where the reply ends", param="stop")
    return fmt


def parse_job(body: dict, chat: bool, tokenizer: Tokenizer, vocab_size: int, defaults: Defaults) -> Job:
    _unsupported(body)
    toolset = None
    if chat:
        toolset = _tool_check(tooling.parse_tools, body)
        ids = _chat_ids(body, tokenizer, defaults, toolset)
    else:
        if body.get("tools") not in (None, []):
            raise ApiError(400, "tools are for /v1/chat/completions", param="tools")
        ids = prompt_ids(body, tokenizer, vocab_size)
    if not ids:
        raise ApiError(400, "the prompt is empty and the tokenizer adds no bos token: nothing to condition on",
                       param="prompt")
    if len(ids) > defaults.ctx:
        raise ApiError(400, f"the prompt is {len(ids)} tokens, more than the context of {defaults.ctx} tokens",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    stream, include_usage = _stream(body)
    grammar = _grammar(body, tokenizer, toolset)
    vocab = None
    if grammar is not None:
        vocab = grammars.vocabulary(tokenizer, vocab_size, defaults.eos_ids or tokenizer.eos_token_ids)
    return Job(chat, ids, _params(body, defaults), _max_tokens(body, defaults), _stop(body),
               stream, include_usage, grammar=grammar, vocab=vocab,
               tools=toolset if toolset is not None and toolset.offered else None)


# ---- responses ----
class Response:
    """Builds the objects of one completion, streamed or whole, in OpenAI's shapes."""

    def __init__(self, job: Job, model_id: str):
        self.job, self.model_id = job, model_id
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if job.chat else "text_completion"
        self.calls = tooling.CallStream() if job.tools is not None else None    # streamed tool calls

    def _wrap(self, choices: list, obj: str, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id,
                "choices": choices, **extra}

    def _choice(self, text: str | None, finish: str | None, delta: bool, role: bool = False,
                calls: list | None = None) -> dict:
        if not self.job.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        body: dict = {"role": "assistant"} if role or not delta else {}
        if text is not None or (calls and not delta):
            body["content"] = text
        if calls:
            body["tool_calls"] = ([{"index": k, **c} for k, c in enumerate(calls)] if delta else calls)
        return {"index": 0, ("delta" if delta else "message"): body, "logprobs": None, "finish_reason": finish}

    def usage(self, last: Chunk) -> dict:
        return {"prompt_tokens": len(self.job.ids), "completion_tokens": last.generated_tokens,
                "total_tokens": len(self.job.ids) + last.generated_tokens,
                "prompt_tokens_details": {"cached_tokens": self.job.cached}}

    def whole(self, text: str, last: Chunk) -> dict:
        finish, calls = finish_reason(last), None
        if self.job.tools is not None:
            text, calls = tooling.parse_calls(text)
            if calls:
                text, finish = text or None, "tool_calls"
        return self._wrap([self._choice(text, finish, delta=False, calls=calls)], self.object,
                          usage=self.usage(last))

    def content(self, text: str) -> str:
        """What of a streamed piece can go out as content now (tool calls wait for the end)."""
        return self.calls.feed(text) if self.calls is not None else text

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False,
              calls: list | None = None) -> dict:
        extra = {"usage": None} if self.job.include_usage else {}
        return self._wrap([self._choice(text, finish, delta=True, role=role, calls=calls)],
                          self._chunk_object(), **extra)

    def final_chunks(self, last: Chunk) -> list[dict]:
        """The rest of the content and the tool calls (with tools), the chunk that carries
        finish_reason, then (with include_usage) the one with usage."""
        out, finish = [], finish_reason(last)
        if self.calls is not None:
            rest, calls = self.calls.finish()
            if rest:
                out.append(self.chunk(rest))
            if calls:
                out.append(self.chunk(None, calls=calls))
                finish = "tool_calls"
        out.append(self.chunk(None if self.job.chat else "", finish))
        if self.job.include_usage:
            out.append(self._wrap([], self._chunk_object(), usage=self.usage(last)))
        return out

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.job.chat else "text_completion"


def finish_reason(last: Chunk) -> str:
    """ds2's eos | stop | length | aborted -> OpenAI's stop | length. A reply the server cut
    short (a second Ctrl-C) is "length", which clients already read as "the text is incomplete"."""
    return "length" if last.finish_reason in ("length", ABORTED) else "stop"
