"""The OpenAI API as data: request bodies in (validated into a `Job`), response objects out.

No HTTP here (serve.py does that) and no generation (generate.py): this module only checks what
a client sent and says, in OpenAI's error format, what is wrong with it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ds2cli.generation import grammar as grammars
from ds2cli.server import tools as tooling
from ds2cli.generation.draft import MAX_DRAFT
from ds2cli.generation.generate import check_stops
from ds2cli.errors import Ds2Error
from ds2cli.generation.logprobs import MAX_TOP
from ds2cli.generation.sampling import SamplingError, SamplingParams
from ds2cli.text import fim
from ds2cli.text import reasoning
from ds2cli.text.tokenizer import FALLBACK_CHAT_TEMPLATE, Tokenizer
from ds2cli.server.tools import ToolError, ToolSet

ABORTED = "aborted"     # the scheduler's finish_reason for a generation the server ended (beside eos | stop | length)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
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
    logprobs: int | None = None     # None: off; else how many top alternatives each token reports
    echo: bool = False              # completions: the answer starts with the prompt (and its logprobs)
    continue_final: bool = False    # chat: the reply continues the last assistant message (no lstrip)
    draft: int | None = None    # speculative decoding's draft length (None: the server's default)
    index: int = 0              # the choice this job answers: prompt * n + sample
    sample: int = 0             # which of the n samples of its prompt (0 pays the prompt's tokens)
    grammar: grammars.Grammar | None = None     # response_format / a forced tool call
    vocab: Any = None           # the grammar's view of the tokenizer (grammar.vocabulary)
    tools: Any = None           # tools.ToolSet when the request declared tools (chat)
    ignore_eos: bool = False    # eos does not end the reply (llama-server's ignore_eos)
    end_ids: tuple[int, ...] = ()   # tokens that end the reply as eos does (a fill's FIM tokens)
    reasoning: bool = False     # chat: <think>...</think> goes to reasoning_content (reasoning_format deepseek)
    reasoning_opened: bool = False  # the prompt opened <think>: the reply starts inside the reasoning

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
    reasoning_format: str = "deepseek"  # --reasoning-format: chat replies' reasoning apart ("none": in content)


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


def boolean(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, not {_show(value)}", param=name)
    return bool(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _unsupported(body: dict) -> None:
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
                            f"not {_show(schema)}", param=param)
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
                            f"not {_show(value)}", param="reasoning_format")
    return "deepseek" if value == "auto" else value


def _n(body: dict) -> int:
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
        raise ApiError(400, f"logprobs must be true or false (the count goes in top_logprobs), not {_show(value)}",
                       param="logprobs")
    elif isinstance(value, int) and 0 <= value <= MAX_TOP:
        if top is not None and top != value:
            raise ApiError(400, f"logprobs = {value} and top_logprobs = {top} disagree: give one", param="top_logprobs")
        on, n = True, value
    else:
        raise ApiError(400, f"logprobs must be true, false or an integer in [0, {MAX_TOP}], not {_show(value)}",
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
            raise ApiError(400, f"logit_bias: {_show(key)} is not a token id in [0, {vocab_size}) written as "
                                f"a plain integer", param="logit_bias")
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not -100 <= value <= 100):
            raise ApiError(400, f"logit_bias[{key!r}] must be a number in [-100, 100], not {_show(value)}",
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


# ---- prompts ----
def unicode_text(text: str, param: str) -> str:
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
        return unicode_text(content, f"messages[{i}].content")
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return unicode_text("".join(p["text"] for p in content), f"messages[{i}].content")
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
        if message["role"] == "assistant" and isinstance(m.get(reasoning.REASONING_FIELD), str):
            # an earlier reply's reasoning, as this server returned it: for a template that reads
            # it (Tokenizer.render_chat drops it for the others)
            message[reasoning.REASONING_FIELD] = unicode_text(m[reasoning.REASONING_FIELD],
                                                              f"messages[{i}].{reasoning.REASONING_FIELD}")
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


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def prompt_ids(body: dict, tokenizer: Tokenizer, vocab_size: int, ctx: int) -> list[list[int]]:
    """/v1/completions' prompt: a string or token ids, or a list of either (one choice each); a
    string longer than `ctx` tokens can be is refused before it is tokenized."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of either", param="prompt")
    wheres = ["prompt" if len(prompts) == 1 else f"prompt[{i}]" for i in range(len(prompts))]
    for p, where in zip(prompts, wheres):        # every prompt checked before one is tokenized
        if isinstance(p, str):
            unicode_text(check_chars(p, tokenizer, ctx, where, "prompt"), where)
        elif not all(0 <= t < vocab_size for t in p):
            raise ApiError(400, f"{where} token ids must be in [0, {vocab_size})", param="prompt")
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]


def fim_tokens(tokenizer: Tokenizer, model_id: str, param: str) -> fim.FimTokens:
    """The model's FIM tokens, or a 400 naming those its tokenizer lacks."""
    try:
        return fim.FimTokens.of(tokenizer, model_id)
    except fim.FimUnavailable as e:
        raise ApiError(400, str(e), param=param, code="fim_unsupported") from None


def fim_prompt(tokenizer: Tokenizer, tokens: fim.FimTokens, prefix: str, suffix: str, ctx: int,
               files=(), param: str = "prompt") -> list[int]:
    """A fill's prompt ids (text/fim.py's layout). A text that cannot fit the context is
    refused before it is tokenized whole (count_at_least stops in slices past the context)."""
    try:
        before, after = fim.fim_text(prefix, suffix, files)
    except fim.RepositoryError as e:
        raise ApiError(400, f"input_extra: {e}", param="input_extra") from None
    at_least = tokenizer.count_at_least(before, ctx + 1) + tokenizer.count_at_least(after, ctx + 1)
    if at_least > ctx:
        raise ApiError(400, f"the prompt is at least {at_least} tokens, more than the context of {ctx} tokens",
                       param=param, code="context_length_exceeded")
    return fim.fim_ids(tokenizer, tokens, prefix, suffix, files)


def suffix_prompts(body: dict, tokenizer: Tokenizer, defaults: Defaults,
                   model_id: str) -> tuple[list[list[int]], tuple[int, ...]]:
    """/v1/completions with `suffix` (OpenAI's insert mode): each prompt string is a fill's
    prefix. Returns the prompts' ids and the tokens that end a fill."""
    suffix = body.get("suffix")
    if not isinstance(suffix, str):
        raise ApiError(400, f"suffix must be a string, not {_show(suffix)}", param="suffix")
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ApiError(400, "with suffix, prompt must be a string or a list of strings (the text before "
                            "the hole)", param="prompt")
    if boolean(body, "echo"):
        raise ApiError(400, "echo cannot be combined with suffix", param="echo")
    tokens = fim_tokens(tokenizer, model_id, "suffix")
    unicode_text(suffix, "suffix")
    ids = [fim_prompt(tokenizer, tokens, unicode_text(p, "prompt"), suffix, defaults.ctx) for p in prompts]
    return ids, tokens.ends


CONTINUE_MARK = "\x00ds2-continue\x00"    # where the last message's content ends, in a rendered prompt


def continuation(body: dict, messages: list[dict]) -> bool:
    """Whether the reply continues the last (assistant) message: continue_final_message, or a
    trailing assistant message with add_generation_prompt false (as vLLM and HF read them)."""
    cont, gen = boolean(body, "continue_final_message"), body.get("add_generation_prompt")
    if gen is not None and not isinstance(gen, bool):
        raise ApiError(400, f"add_generation_prompt must be true or false, not {_show(gen)}",
                       param="add_generation_prompt")
    last = messages[-1]["role"]
    if cont and gen:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")
    if cont and last != "assistant":
        raise ApiError(400, f"continue_final_message needs the last message to be the assistant's, not {last}'s",
                       param="continue_final_message")
    return cont or (gen is False and last == "assistant")


def render_continuation(tokenizer: Tokenizer, messages: list[dict]) -> str:
    """The prompt up to the end of the last message's content: rendered without a generation
    prompt, with a mark after that content, and cut at the mark (which drops whatever the
    template closes a message with: DeepSeek's eos, ChatML's <|im_end|>)."""
    marked = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + CONTINUE_MARK}]
    text = tokenizer.render_chat(marked, add_generation_prompt=False)
    cut = text.rfind(CONTINUE_MARK)
    if cut < 0:
        raise ApiError(400, "the chat template does not render the last message's content as given, so it "
                            "cannot be continued", param="continue_final_message")
    return text[:cut]


def chat_ids(body: dict, tokenizer: Tokenizer, defaults: Defaults,
             toolset: ToolSet | None = None) -> tuple[list[int], bool]:
    """The chat prompt's ids (with the request's tools), and whether it continues the last message."""
    text, cont, _ = chat_text(body, tokenizer, defaults, toolset)
    return tokenizer.encode(text, add_special_tokens=False), cont


def chat_text(body: dict, tokenizer: Tokenizer, defaults: Defaults,
              toolset: ToolSet | None = None) -> tuple[str, bool, bool]:
    """The chat prompt as the template renders it (with the request's tools), whether it
    continues the last message, and whether the reply starts inside reasoning: the prompt
    opened <think> (R1's generation prompt does), or the assistant message it continues did."""
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
    cont, gen = continuation(body, messages), body.get("add_generation_prompt") is not False
    try:
        if cont:
            last = messages[-1]["content"] or ""
            opened = last.rfind(reasoning.THINK_OPEN) > last.rfind(reasoning.THINK_CLOSE)
            return render_continuation(tokenizer, messages), True, opened
        text = tokenizer.render_chat(messages, add_generation_prompt=gen, tools=declared)
        return text, False, reasoning.opens_reasoning(text)
    except Ds2Error as e:  # the chat template refused the conversation (e.g. roles out of order)
        raise ApiError(400, str(e), param="messages") from None


def check_chars(text: str, tokenizer: Tokenizer, ctx: int, where: str, param: str) -> str:
    """`text`, unless it has more characters than `ctx` tokens can hold (each covers at most
    tokenizer.longest_token): then its 400 comes before it is tokenized."""
    most = ctx * tokenizer.longest_token
    if len(text) > most:
        raise ApiError(400, f"{where} is {len(text)} characters, more than the context of {ctx} tokens can "
                            f"hold (at most {most}: no token of this model covers more than "
                            f"{tokenizer.longest_token} characters)", param=param, code="context_length_exceeded")
    return text


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


def parse_jobs(body: dict, chat: bool, tokenizer: Tokenizer, vocab_size: int, defaults: Defaults,
               model_id: str = "the model", fill: list[int] | None = None, ends: tuple[int, ...] = ()) -> list[Job]:
    """The request's choices as jobs, in OpenAI's order: index = prompt * n + sample. A body
    that records what is read (http_io.Read) afterwards knows which of its fields nothing read.
    A completion with `suffix`, or `fill` (a fill's prompt ids that /infill built, with the
    FIM tokens that end it, `ends`), fills in the middle: the reply also ends at those tokens."""
    _unsupported(body)
    for name in ("cache_prompt", "model", "user", "metadata", "store", "service_tier"):
        body.get(name)          # accepted: ds2 always reuses cached prompts; one model; no store
    cont = opened = False
    echo = boolean(body, "echo")
    if chat and echo:
        raise ApiError(400, "echo is only for /v1/completions", param="echo")
    toolset = None
    if chat:
        toolset = _tool_check(tooling.parse_tools, body)
        text, cont, opened = chat_text(body, tokenizer, defaults, toolset)
        check_chars(text, tokenizer, defaults.ctx, "the prompt", "messages")
        prompts = [tokenizer.encode(text, add_special_tokens=False)]
    else:
        if body.get("tools") not in (None, []):
            raise ApiError(400, "tools are for /v1/chat/completions", param="tools")
        n, prompt = _n(body), body.get("prompt")
        many = len(prompt) if isinstance(prompt, list) and prompt and not _is_ids(prompt) else 1
        if fill is None and many * n > MAX_CHOICES:          # before a single prompt is tokenized
            raise ApiError(400, f"{many} prompts x n = {n} is more than {MAX_CHOICES} choices in one request",
                           param="n")
        if fill is not None:
            prompts = [fill]
        elif body.get("suffix") is not None:
            prompts, ends = suffix_prompts(body, tokenizer, defaults, model_id)
        else:
            prompts = prompt_ids(body, tokenizer, vocab_size, defaults.ctx)
    n = _n(body)
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n = {n} is more than {MAX_CHOICES} choices in one request",
                       param="n")
    for i, ids in enumerate(prompts):
        where = "the prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not ids:
            raise ApiError(400, f"{where} is empty and the tokenizer adds no bos token: nothing to condition on",
                           param="prompt")
        if len(ids) > defaults.ctx:
            raise ApiError(400, f"{where} is {len(ids)} tokens, more than the context of {defaults.ctx} tokens",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
    stream, include_usage = _stream(body)
    params, max_tokens = _params(body, defaults, vocab_size), _max_tokens(body, defaults, echo)
    stop, draft, logprobs = _stop(body), _draft(body), _logprobs(body, chat)
    ignore_eos = boolean(body, "ignore_eos")     # llama-server's: only max_tokens, stop or ctx end it
    split = chat and _reasoning_format(body, defaults) != "none"
    grammar = _grammar(body, tokenizer, toolset, max_tokens)
    vocab = None
    if grammar is not None:
        vocab = grammars.vocabulary(tokenizer, vocab_size, defaults.eos_ids or tokenizer.eos_token_ids)
        param = "tool_choice" if toolset is not None and toolset.forced else "response_format"
        # the matcher fails on some schemas that compile (a recursive $ref) when it computes its
        # first mask: found now, as a 400 naming the param, not later in the scheduler as a 500
        _compile(lambda: grammars.Constraint(grammar, vocab).allowed_mask(), param)
    offered = toolset if toolset is not None and toolset.offered else None
    jobs = []
    for p, ids in enumerate(prompts):
        for k in range(n):
            # each sample its own random stream: a seed gives the k-th sample seed + k
            seeded = params if k == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + k)
            jobs.append(Job(chat, list(ids), seeded, max_tokens, stop, stream, include_usage,
                            logprobs=logprobs, echo=echo, continue_final=cont, draft=draft,
                            index=p * n + k, sample=k, grammar=grammar, vocab=vocab, tools=offered,
                            ignore_eos=ignore_eos, end_ids=ends, reasoning=split,
                            reasoning_opened=split and opened))
    return jobs


def parse_job(body: dict, chat: bool, tokenizer: Tokenizer, vocab_size: int, defaults: Defaults,
              model_id: str = "the model", fill: list[int] | None = None, ends: tuple[int, ...] = ()) -> Job:
    """A request that must be one choice."""
    jobs = parse_jobs(body, chat, tokenizer, vocab_size, defaults, model_id, fill, ends)
    if len(jobs) > 1:
        raise ApiError(400, "this request must have one prompt and n = 1", param="n")
    return jobs[0]
