"""A request made into its jobs, one per choice (`parse_jobs`): its prompts read and checked
(chat messages rendered through the template, with tools and a continued last message; the
completions' strings or token ids; a fill's prefix and suffix) and tokenized, then each prompt's
n samples given the fields request_fields.py checked.

No HTTP here (http_server.py and endpoints.py do that) and no generation (generate.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ds2cli.errors import Ds2Error
from ds2cli.generation import grammar as grammars
from ds2cli.generation.sampling import SamplingParams
from ds2cli.server import tools as tooling
from ds2cli.server.request_fields import (MAX_CHOICES, ApiError, Defaults, boolean, n_samples, read_fields,
                                          refuse_unsupported, shown)
from ds2cli.server.tools import ToolError, ToolSet
from ds2cli.text import fim, reasoning
from ds2cli.text.tokenizer import FALLBACK_CHAT_TEMPLATE, Tokenizer

ABORTED = "aborted"     # the scheduler's finish_reason for a generation the server ended (beside eos | stop | length)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


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
                                f"not {shown(m.get('role'))}", param=f"messages[{i}].role")
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


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_ids(value: Any) -> bool:
    """A list of token ids, told by its first item: the rest are checked after its length
    (check_ids), so that a list of millions is refused before it is read through."""
    return isinstance(value, list) and bool(value) and _is_id(value[0])


def check_ids(ids: list, vocab_size: int, ctx: int, where: str) -> None:
    """A 400 when there are more than `ctx` ids (before any is looked at) or one is no id of the
    vocabulary."""
    if len(ids) > ctx:
        raise ApiError(400, f"{where} is {len(ids)} tokens, more than the context of {ctx} tokens",
                       param="prompt", code="context_length_exceeded")
    if not all(_is_id(t) and 0 <= t < vocab_size for t in ids):
        raise ApiError(400, f"{where} token ids must be in [0, {vocab_size})", param="prompt")


def prompt_ids(body: dict, tokenizer: Tokenizer, vocab_size: int, ctx: int,
               parse_special: bool = True) -> list[list[int]]:
    """/v1/completions' prompt: a string or token ids, or a list of either (one choice each), each
    measured against the context before it is tokenized whole or read through: a string as
    /tokenize's text is (check_length: its characters, then its tokens in slices that stop past
    `ctx`), ids by their count (check_ids). A special token's text in a string is that token, as
    llama.cpp reads it, unless `parse_special` is off (ds2 serve --no-special-in-prompts): then
    it is text."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of either", param="prompt")
    wheres = ["prompt" if len(prompts) == 1 else f"prompt[{i}]" for i in range(len(prompts))]
    for p, where in zip(prompts, wheres):        # the cheap measures of every prompt first
        if isinstance(p, str):
            check_chars(p, tokenizer, ctx, where, "prompt")
        else:
            check_ids(p, vocab_size, ctx, where)
    for p, where in zip(prompts, wheres):
        if isinstance(p, str):
            unicode_text(check_length(p, tokenizer, ctx, where, "prompt"), where)
    return [tokenizer.encode(p, parse_special=parse_special) if isinstance(p, str) else list(p) for p in prompts]


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
        raise ApiError(400, f"suffix must be a string, not {shown(suffix)}", param="suffix")
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
        raise ApiError(400, f"add_generation_prompt must be true or false, not {shown(gen)}",
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
    return text.cut(cut)      # the messages' own special-token text still known as text


def chat_ids(body: dict, tokenizer: Tokenizer, defaults: Defaults,
             toolset: ToolSet | None = None) -> tuple[list[int], bool]:
    """The chat prompt's ids (with the request's tools), and whether it continues the last message;
    a prompt longer than the context is refused before it is tokenized whole. The messages'
    own special-token text is text (Tokenizer.render_chat)."""
    text, cont, _ = chat_text(body, tokenizer, defaults, toolset)
    check_length(text, tokenizer, defaults.ctx, "the prompt", "messages")
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


def check_length(text: str, tokenizer: Tokenizer, ctx: int, where: str, param: str) -> str:
    """`text`, unless it is longer than `ctx` tokens: its characters (check_chars, as a
    completion's prompt), then its tokens counted in slices that stop past the context
    (Tokenizer.count_at_least), so that a text of megabytes costs what a slice does, never its
    whole tokenization (/tokenize, whose answer is not bounded by a context otherwise)."""
    check_chars(text, tokenizer, ctx, where, param)
    at_least = tokenizer.count_at_least(text, ctx + 1)
    if at_least > ctx:
        raise ApiError(400, f"{where} is at least {at_least} tokens, more than the context of {ctx} tokens",
                       param=param, code="context_length_exceeded")
    return text


# ---- jobs ----
def parse_jobs(body: dict, chat: bool, tokenizer: Tokenizer, vocab_size: int, defaults: Defaults,
               model_id: str = "the model", fill: list[int] | None = None, ends: tuple[int, ...] = ()) -> list[Job]:
    """The request's choices as jobs, in OpenAI's order: index = prompt * n + sample. A body
    that records what is read (http_io.Read) afterwards knows which of its fields nothing read.
    A completion with `suffix`, or `fill` (a fill's prompt ids that /infill built, with the
    FIM tokens that end it, `ends`), fills in the middle: the reply also ends at those tokens."""
    refuse_unsupported(body)
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
        check_length(text, tokenizer, defaults.ctx, "the prompt", "messages")
        prompts = [tokenizer.encode(text, add_special_tokens=False)]
    else:
        prompts, ends = completion_prompts(body, tokenizer, vocab_size, defaults, model_id, fill, ends)
    n = n_samples(body)
    _check_sizes(prompts, n, defaults.ctx, "messages" if chat else "prompt")
    fields = read_fields(body, chat, echo, tokenizer, vocab_size, defaults, toolset)
    offered = toolset if toolset is not None and toolset.offered else None
    params, jobs = fields.params, []
    for p, ids in enumerate(prompts):
        for k in range(n):
            # each sample its own random stream: a seed gives the k-th sample seed + k
            seeded = params if k == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + k)
            jobs.append(Job(chat, list(ids), seeded, fields.max_tokens, fields.stop, fields.stream,
                            fields.include_usage, logprobs=fields.logprobs, echo=echo, continue_final=cont,
                            draft=fields.draft, index=p * n + k, sample=k, grammar=fields.grammar,
                            vocab=fields.vocab, tools=offered, ignore_eos=fields.ignore_eos, end_ids=ends,
                            reasoning=fields.reasoning, reasoning_opened=fields.reasoning and opened))
    return jobs


def completion_prompts(body: dict, tokenizer: Tokenizer, vocab_size: int, defaults: Defaults, model_id: str,
                       fill: list[int] | None, ends: tuple[int, ...]) -> tuple[list[list[int]], tuple[int, ...]]:
    """/v1/completions' prompts as ids, and the tokens that end a fill: `fill` as /infill built
    it, a `suffix`'s fills, or the prompt field's strings and token ids."""
    if body.get("tools") not in (None, []):
        raise ApiError(400, "tools are for /v1/chat/completions", param="tools")
    n, prompt = n_samples(body), body.get("prompt")
    many = len(prompt) if isinstance(prompt, list) and prompt and not _is_ids(prompt) else 1
    if fill is None and many * n > MAX_CHOICES:          # before a single prompt is tokenized
        raise ApiError(400, f"{many} prompts x n = {n} is more than {MAX_CHOICES} choices in one request",
                       param="n")
    if fill is not None:
        return [fill], ends
    if body.get("suffix") is not None:
        return suffix_prompts(body, tokenizer, defaults, model_id)
    return prompt_ids(body, tokenizer, vocab_size, defaults.ctx, defaults.special_in_prompts), ends


def _check_sizes(prompts: list[list[int]], n: int, ctx: int, param: str) -> None:
    """At most MAX_CHOICES choices, and every prompt some tokens but no more than the context."""
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n = {n} is more than {MAX_CHOICES} choices in one request",
                       param="n")
    for i, ids in enumerate(prompts):
        where = "the prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not ids:
            raise ApiError(400, f"{where} is empty and the tokenizer adds no bos token: nothing to condition on",
                           param="prompt")
        if len(ids) > ctx:
            raise ApiError(400, f"{where} is {len(ids)} tokens, more than the context of {ctx} tokens",
                           param=param, code="context_length_exceeded")


def parse_job(body: dict, chat: bool, tokenizer: Tokenizer, vocab_size: int, defaults: Defaults,
              model_id: str = "the model", fill: list[int] | None = None, ends: tuple[int, ...] = ()) -> Job:
    """A request that must be one choice."""
    jobs = parse_jobs(body, chat, tokenizer, vocab_size, defaults, model_id, fill, ends)
    if len(jobs) > 1:
        raise ApiError(400, "this request must have one prompt and n = 1", param="n")
    return jobs[0]
