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

from ds2cli.draft import MAX_DRAFT
from ds2cli.errors import Ds2Error
from ds2cli.generate import Chunk
from ds2cli.sampling import SamplingError, SamplingParams
from ds2cli.tokenizer import Tokenizer

ABORTED = "aborted"     # the engine's finish_reason for a generation the server ended (beside eos | stop | length)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOPS = 16
MAX_CHOICES = 64        # prompts x n in one request: each choice is a sequence of the batch


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
    draft: int | None = None    # speculative decoding's draft length (None: the server's default)
    index: int = 0              # the choice this job answers: prompt * n + sample
    sample: int = 0             # which of the n samples of its prompt (0 pays the prompt's tokens)


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What `ds2 serve`'s options and the checkpoint's generation_config say, before the request."""
    params: SamplingParams
    max_tokens: int
    ctx: int
    system: str | None = None   # --system: for chat requests that bring no system message


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
    best_of = _number(body, "best_of", integer=True)
    if best_of is not None and best_of != 1:
        raise ApiError(400, "best_of must be 1", param="best_of")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "logit_bias"):
        if body.get(name) not in (None, False, [], {}, ""):
            raise ApiError(400, f"{name} is not supported by ds2", param=name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name) not in (None, 0):
            raise ApiError(400, f"{name} is not supported: ds2 applies repetition_penalty (multiplicative,"
                                f" as Hugging Face does; 1 = off) instead", param=name)


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
            raise ApiError(400, f"messages[{i}].role must be one of system, developer, user, assistant, "
                                f"not {_show(m.get('role'))}", param=f"messages[{i}].role")
        out.append({"role": ROLES[m["role"]], "content": _content(m, i)})
    return out


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def prompt_ids(body: dict, tokenizer: Tokenizer, vocab_size: int) -> list[list[int]]:
    """/v1/completions' prompt: a string or token ids, or a list of either (one choice each)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of either", param="prompt")
    out = []
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            out.append(tokenizer.encode(_text(p, where)))
        elif not all(0 <= t < vocab_size for t in p):
            raise ApiError(400, f"{where} token ids must be in [0, {vocab_size})", param="prompt")
        else:
            out.append(list(p))
    return out


def parse_jobs(body: dict, chat: bool, tokenizer: Tokenizer, vocab_size: int, defaults: Defaults) -> list[Job]:
    """The request's choices as jobs, in OpenAI's order: index = prompt * n + sample."""
    _unsupported(body)
    if chat:
        messages = chat_messages(body)
        if defaults.system and all(m["role"] != "system" for m in messages):
            messages.insert(0, {"role": "system", "content": defaults.system})
        try:
            prompts = [tokenizer.encode_chat(messages, add_generation_prompt=True)]
        except Ds2Error as e:  # the chat template refused the conversation (e.g. roles out of order)
            raise ApiError(400, str(e), param="messages") from None
    else:
        prompts = prompt_ids(body, tokenizer, vocab_size)
    n = _n(body)
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n = {n} is more than {MAX_CHOICES} choices in one request",
                       param="n")
    for i, ids in enumerate(prompts):
        where = "the prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not ids:
            raise ApiError(400, f"{where} is empty and the tokenizer adds no bos token: nothing to condition on",
                           param="messages" if chat else "prompt")
        if len(ids) > defaults.ctx:
            raise ApiError(400, f"{where} is {len(ids)} tokens, more than the context of {defaults.ctx} tokens",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
    stream, include_usage = _stream(body)
    params, max_tokens, stop, draft = _params(body, defaults), _max_tokens(body, defaults), _stop(body), _draft(body)
    jobs = []
    for p, ids in enumerate(prompts):
        for k in range(n):
            # each sample its own random stream: a seed gives the k-th sample seed + k
            seeded = params if k == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + k)
            jobs.append(Job(chat, list(ids), seeded, max_tokens, stop, stream, include_usage,
                            draft=draft, index=p * n + k, sample=k))
    return jobs


def parse_job(body: dict, chat: bool, tokenizer: Tokenizer, vocab_size: int, defaults: Defaults) -> Job:
    """A request that must be one choice."""
    jobs = parse_jobs(body, chat, tokenizer, vocab_size, defaults)
    if len(jobs) > 1:
        raise ApiError(400, "this request must have one prompt and n = 1", param="n")
    return jobs[0]


# ---- responses ----
class Response:
    """Builds the objects of one completion (its choices, one per job), streamed or whole, in
    OpenAI's shapes."""

    def __init__(self, jobs: list[Job], model_id: str):
        self.jobs, self.job, self.model_id = jobs, jobs[0], model_id
        self.id = ("chatcmpl-" if self.job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if self.job.chat else "text_completion"

    def _wrap(self, choices: list, obj: str, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id,
                "choices": choices, **extra}

    def _choice(self, index: int, text: str | None, finish: str | None, delta: bool, role: bool = False) -> dict:
        if not self.job.chat:
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        body: dict = {"role": "assistant"} if role or not delta else {}
        if text is not None:
            body["content"] = text
        return {"index": index, ("delta" if delta else "message"): body, "logprobs": None, "finish_reason": finish}

    def usage(self, lasts: dict[int, Chunk]) -> dict:
        """A prompt's tokens count once however many samples it has; every sample's reply counts."""
        prompt = sum(len(j.ids) for j in self.jobs if j.sample == 0)
        completion = sum(last.generated_tokens for last in lasts.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(j.cached for j in self.jobs if j.sample == 0)}}

    def whole(self, texts: dict[int, str], lasts: dict[int, Chunk]) -> dict:
        choices = [self._choice(j.index, texts[j.index], finish_reason(lasts[j.index]), delta=False)
                   for j in self.jobs]
        return self._wrap(choices, self.object, usage=self.usage(lasts))

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False, index: int = 0) -> dict:
        extra = {"usage": None} if self.job.include_usage else {}
        return self._wrap([self._choice(index, text, finish, delta=True, role=role)], self._chunk_object(), **extra)

    def finish_chunk(self, last: Chunk, index: int = 0) -> dict:
        """The chunk that carries a choice's finish_reason."""
        return self.chunk(None if self.job.chat else "", finish_reason(last), index=index)

    def usage_chunk(self, lasts: dict[int, Chunk]) -> list[dict]:
        """After every choice has finished: (with include_usage) the chunk with usage."""
        return [self._wrap([], self._chunk_object(), usage=self.usage(lasts))] if self.job.include_usage else []

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.job.chat else "text_completion"


def finish_reason(last: Chunk) -> str:
    """ds2's eos | stop | length | aborted -> OpenAI's stop | length. A reply the server cut
    short (a second Ctrl-C) is "length", which clients already read as "the text is incomplete"."""
    return "length" if last.finish_reason in ("length", ABORTED) else "stop"
