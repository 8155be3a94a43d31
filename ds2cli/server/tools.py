"""Tool calls in DeepSeek's syntax: what a request declares (`tools`, `tool_choice`), how the
conversation reaches the chat template, the grammar that forces a call, and the model's output
parsed back into OpenAI's `tool_calls`.

DeepSeek-V2.5's and V3's chat templates write a call with these tokens (single added tokens in
their tokenizers; plain text in ds2-tiny's, which the grammar handles the same way):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"arg": ...}
    ```<｜tool▁call▁end｜>            (further calls: "\\n" then the same from <｜tool▁call▁begin｜>)
    <｜tool▁calls▁end｜>

and a tool's result as <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>...<｜tool▁output▁end｜>
<｜tool▁outputs▁end｜>. A template is taken as tool-capable when it writes <｜tool▁call▁begin｜>.
The V2.5 template renders calls and results but not the declarations (it never reads `tools`):
for such a template ds2 lists the tools in the system message as DeepSeek's V2.5 model card
does ("## Tools ... You have the following functions available: ..."); a template that reads
`tools` gets them as its variable, as with Hugging Face's apply_chat_template(tools=...).

No HTTP (serve.py) and no request fields beyond the tool ones (request_fields.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from ds2cli.generation import grammar as grammars
from ds2cli.errors import Ds2Error

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")     # OpenAI's rule for function names
CALL_RE = re.compile(re.escape(CALL_BEGIN) + r"\s*(?P<type>[A-Za-z_]*)\s*" + re.escape(SEP)
                     + r"\s*(?P<name>[^\n]*?)\s*\n```(?:json)?\s*\n(?P<args>.*?)\s*```\s*"
                     + re.escape(CALL_END), re.S)


# the last call of a block cut short: named in full (its line ended), its arguments begun
PARTIAL_RE = re.compile(re.escape(CALL_BEGIN) + r"\s*[A-Za-z_]*\s*" + re.escape(SEP)
                        + r"\s*(?P<name>[^\n]*?)\s*\n```(?:json)?\n(?P<args>.*)", re.S)


class ToolError(Ds2Error):
    """A tool field of the request that cannot be used; `param` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict            # a JSON Schema for the arguments object

    def declaration(self) -> dict:
        fn = {"name": self.name, **({"description": self.description} if self.description else {}),
              "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclasses.dataclass(frozen=True)
class ToolSet:
    tools: tuple[Tool, ...]
    choice: str                 # "auto" | "none" | "required" | "function" (one named tool)
    name: str | None = None     # the function tool_choice names
    parallel: bool = True       # parallel_tool_calls: a forced reply may make more than one call

    @property
    def offered(self) -> bool:
        """Whether the model is shown the tools and its output parsed for calls."""
        return self.choice != "none"

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The tools one of which the output must call (empty: the output is free)."""
        if self.choice == "required":
            return self.tools
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.name)
        return ()


# ---- the request ----
MAX_TOOLS = 128             # functions one request may declare (OpenAI's own limit)


def parse_tools(body: dict) -> ToolSet | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools: the request declares none", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    if len(tools) > MAX_TOOLS:      # counted before any schema is compiled
        raise ToolError(f"tools: {len(tools)} functions, more than the limit of {MAX_TOOLS}", "tools")
    seen: set = set()
    for i, t in enumerate(tools):   # a name used twice is found by a set, before compiling
        name = (t.get("function") or {}).get("name") if isinstance(t, dict) and isinstance(t.get("function"), dict) else None
        if isinstance(name, str) and name in seen:
            raise ToolError(f"tools: two functions share a name ({name})", "tools")
        seen.add(name)
    parsed = tuple(_tool(t, i) for i, t in enumerate(tools))
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    return dataclasses.replace(_choice(choice, parsed), parallel=parallel)


def _tool(tool: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
            not isinstance(tool.get("function"), dict):
        raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{where}.function.name is missing: every tool needs a name", "tools")
    if not NAME_RE.match(name):
        raise ToolError(f"{where}.function.name {name!r} must be 1-64 letters, digits, _ . or -", "tools")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.function.description must be a string", "tools")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON Schema object", "tools")
    if grammars.available():    # the schema must compile: it constrains forced calls
        try:
            grammars.json_schema_grammar(parameters)
        except grammars.GrammarError as e:
            raise ToolError(f"{where}.function.parameters is not a usable JSON Schema: {e}", "tools") from None
    return Tool(name, description, parameters)


def _choice(choice: Any, tools: tuple[Tool, ...]) -> ToolSet:
    if choice is None or choice in ("auto", "none", "required"):
        return ToolSet(tools, choice or "auto")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(t.name == name for t in tools):
            raise ToolError(f"tool_choice names {name!r}, which is not among the declared tools "
                            f"({', '.join(t.name for t in tools)})", "tool_choice")
        return ToolSet(tools, "function", name)
    raise ToolError("tool_choice must be \"auto\", \"none\", \"required\" or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


# ---- messages ----
def assistant_calls(message: dict, i: int) -> list[dict]:
    """An assistant message's tool_calls, checked, in the shape templates read."""
    calls = message.get("tool_calls")
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise ToolError(f"{where} must be a non-empty list", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"{where}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": "
                            f"{{\"name\", \"arguments\"}}}}", where)
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):      # OpenAI sends a JSON string; accept an object too
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def check_tool_results(messages: list[dict]) -> None:
    """Every tool message answers a call made before it: by its tool_call_id, or (without one)
    follows an assistant message that made calls."""
    made: set[str] = set()
    calls_seen = False
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            made.update(c["id"] for c in m["tool_calls"] if c["id"])
            calls_seen = True
        elif m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if not calls_seen or (call_id and made and call_id not in made):
                what = f"tool_call_id {call_id!r}" if call_id else "it"
                raise ToolError(f"messages[{i}] is a tool result, but no assistant message before it "
                                f"made the call {what} answers", f"messages[{i}]")


# ---- the template ----
def check_template(source: str) -> None:
    if CALL_BEGIN not in source:
        raise ToolError("this checkpoint's chat template has no tool calls (it never writes DeepSeek's "
                        f"{CALL_BEGIN}): give one that does with ds2 serve --chat-template FILE, e.g. "
                        "DeepSeek-V2.5's", "tools")


def template_reads_tools(source: str) -> bool:
    return re.search(r"\btools\b", source) is not None


def system_prompt(tools: tuple[Tool, ...]) -> str:
    """The tools as DeepSeek-V2.5's model card lists them in the system message."""
    lines = ["## Tools", "", "### Function", "", "You have the following functions available:", ""]
    for t in tools:
        lines += [f"- `{t.name}`:", "```json", json.dumps(t.declaration()["function"], ensure_ascii=False,
                                                           indent=4), "```"]
    return "\n".join(lines)


def with_tools(messages: list[dict], toolset: ToolSet, source: str) -> tuple[list[dict], list[dict] | None]:
    """(messages, the template's `tools`): the declarations go to the template, or into the system
    message when the template does not read them."""
    if not toolset.offered:
        return messages, None
    if template_reads_tools(source):
        return messages, [t.declaration() for t in toolset.tools]
    listing = system_prompt(toolset.tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + listing}, *messages[1:]], None
    return [{"role": "system", "content": listing}, *messages], None


# ---- forcing a call ----
def call_grammar(tools: tuple[Tool, ...], tokenizer, many: bool, max_tokens: int | None = None) -> grammars.Grammar:
    """Output that is a block of calls (one, or with `many` one or more) of `tools`, each with
    arguments valid under that tool's schema, in the template's syntax; with `max_tokens`, the
    numbers the schemas leave unbounded are bounded to fit it (bounded)."""
    def mark(text: str) -> str:   # a special token by id (llguidance's <[id]>), else the text
        token = grammars.special_token_id(tokenizer, text)
        return f"<[{token}]>" if token is not None else grammars.lark_literal(text)

    more = '("\\n" call)*' if many else ""                   # further calls, one per line
    choices = " | ".join(f"fn_{i}" for i in range(len(tools)))
    rules = [f"start: {mark(CALLS_BEGIN)} call {more} {mark(CALLS_END)}",
             f"call: {mark(CALL_BEGIN)} \"function\" {mark(SEP)} ({choices})"]
    for i, t in enumerate(tools):
        rules += [f"fn_{i}: {grammars.lark_literal(t.name + chr(10) + '```json' + chr(10))} args_{i} "
                  f"{grammars.lark_literal(chr(10) + '```')} {mark(CALL_END)}",
                  f"args_{i}: {grammars.lark_json(bounded(closed(t.parameters), max_tokens))}"]
    return grammars.lark_grammar("\n".join(rules))


def closed(schema: Any) -> Any:
    """A JSON Schema whose objects admit no keys beyond their properties unless they say
    `additionalProperties` themselves, as OpenAI's strict mode reads tool parameters: else a
    forced call may open a key the schema never names, and never close it."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (closed(v) if k in ("items", "anyOf", "oneOf", "allOf", "not", "prefixItems") else
               {n: closed(s) for n, s in v.items()} if k in ("properties", "$defs", "definitions")
               and isinstance(v, dict) else v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


MAX_DIGITS = 15          # what a float64 holds exactly: no unbounded number is written longer
MAX_DECIMALS = 6
TOKENS_A_DIGIT = 4      # DeepSeek's tokenizers write a digit a token: a quarter of max_tokens for one number


def number_digits(max_tokens: int | None) -> int:
    """How many digits an unbounded number of a forced call may have before its point."""
    return MAX_DIGITS if max_tokens is None else max(1, min(MAX_DIGITS, max_tokens // TOKENS_A_DIGIT))


def bounded(schema: Any, max_tokens: int | None) -> Any:
    """`schema` with every integer or number it leaves unbounded held to number_digits(max_tokens)
    digits (minimum/maximum) and a number to MAX_DECIMALS decimals (multipleOf): JSON's numbers
    have no end of their own, so a forced call whose model keeps writing digits would reach
    max_tokens inside one and never close. Bounds the schema sets itself are kept."""
    if isinstance(schema, list):
        return [bounded(s, max_tokens) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v, max_tokens) if isinstance(v, (dict, list)) and k not in ("enum", "const", "default",
                                                                                  "examples", "required")
           else v for k, v in schema.items()}
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if ("integer" in kinds or "number" in kinds) and "enum" not in out and "const" not in out:
        top = 10 ** number_digits(max_tokens) - 1
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -top
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = top
        if "number" in kinds and "multipleOf" not in out:
            out["multipleOf"] = 10.0 ** -MAX_DECIMALS
    return out


# ---- the output ----
def parse_calls(text: str) -> tuple[str, list[dict] | None, bool]:
    """The reply split into (content, tool_calls in OpenAI's shape, whether the block of calls is
    complete). The content never holds the call markers: a block cut short (by max_tokens) gives
    the calls it completed, or None, and False, so that its finish_reason stays "length"."""
    start = text.find(CALLS_BEGIN)
    if start < 0:
        return text, None, True
    end = text.find(CALLS_END, start)
    block = text[start + len(CALLS_BEGIN): end if end >= 0 else len(text)]
    calls = [(m["name"], m["args"]) for m in CALL_RE.finditer(block)]
    complete = bool(calls) and (end >= 0 or block.rstrip().endswith(CALL_END))
    cut = None if complete else PARTIAL_RE.search(block, max((m.end() for m in CALL_RE.finditer(block)), default=0))
    if cut is not None:     # a call max_tokens cut short: its name and the arguments so far, as OpenAI
        args = cut["args"].split("```")[0]
        if args != cut["args"] or re.search(r"\n`{1,2}\Z", args):     # the closing fence, begun: no argument
            args = args.rstrip("`").rstrip()
        calls.append((cut["name"], args))
    out = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": args}} for name, args in calls]
    return text[:start].rstrip(), out or None, complete


class CallStream:
    """Streams a reply's content while holding back what may be a block of calls: text from
    <｜tool▁calls▁begin｜> on (and a tail that could start it) waits for parse_calls at the end."""

    def __init__(self):
        self.text, self.sent = "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        start = self.text.find(CALLS_BEGIN, self.sent)
        if start >= 0:
            safe = start
        else:
            hold = max((k for k in range(1, len(CALLS_BEGIN)) if self.text.endswith(CALLS_BEGIN[:k])), default=0)
            safe = len(self.text) - hold
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[dict] | None, bool]:
        """(the content not yet sent, the calls, whether their block was complete) at the end."""
        content, calls, complete = parse_calls(self.text)
        return content[self.sent:], calls, complete
