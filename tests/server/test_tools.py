"""Tool calls through ds2 serve on ds2-tiny: no bundled checkpoint has a tool-capable template, so
the server gets one the way --chat-template gives it (DeepSeek-V2.5's own, from
tests/data/tokenizers, and a small one in DeepSeek's syntax that reads `tools`)."""

import json
import re
from pathlib import Path

import pytest

import ds2cli
from ds2cli.server import tools as tooling
from ds2cli.generation.sampling import SamplingParams
from test_serve import openai_client

pytest.importorskip("llguidance", reason="the grammar extra: pip install '.[grammar]'")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

DATA = Path(__file__).parents[1] / "data"
V25_TEMPLATE = json.loads((DATA / "tokenizers" / "deepseek-v2.5" / "tokenizer_config.json").read_text())["chat_template"]
OWN_TEMPLATE = (DATA / "tool_chat_template.jinja").read_text()

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model():
    return ds2cli.load()


def running(model, template):
    if template:
        model.tokenizer.set_chat_template(template)
    return openai_client(model, params=SamplingParams(temperature=1.0), max_tokens=120, max_queue=4)


@pytest.fixture(scope="module", params=["v2.5", "own"])
def client(request):
    m = ds2cli.load()       # its own model: the template is set on the tokenizer
    with running(m, V25_TEMPLATE if request.param == "v2.5" else OWN_TEMPLATE) as c:
        yield c


def check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---- forced calls ----
@pytest.mark.slow
def test_required_gives_valid_calls(client):
    r = client.chat.completions.create(model="ds2-tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                       seed=1, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, SCHEMAS)
    assert len(choice.message.tool_calls) == 1


@pytest.mark.slow
def test_named_call_streamed(client):
    stream = client.chat.completions.create(model="ds2-tiny", messages=ASK, tools=TOOLS, seed=4, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks]
    assert not "".join(d.content or "" for d in deltas)          # the markers never leak as content
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [tc.index for tc in calls] == [0]
    check_calls(calls, {"get_time"})
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_call_and_its_result_go_back_into_the_template(client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    asked = client.chat.completions.create(model="ds2-tiny", messages=ASK, tools=TOOLS, max_tokens=1)
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model="ds2-tiny", messages=messages, tools=TOOLS, max_tokens=1)
    # the call and the result are in the prompt: DeepSeek's markers and the texts, at least
    added = len(tooling.CALL_BEGIN + '"Paris", "unit": "celsius"' + '{"temperature": 21}') // 8
    assert r.usage.prompt_tokens > asked.usage.prompt_tokens + added
    assert r.usage.prompt_tokens_details.cached_tokens >= asked.usage.prompt_tokens - 1   # the same prefix


# ---- rendering ----
def test_rendering_puts_declarations_where_the_template_reads_them():
    toolset = tooling.parse_tools({"tools": TOOLS})
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    listed, declared = tooling.with_tools(messages, toolset, V25_TEMPLATE)   # V2.5 never reads `tools`
    assert declared is None and "You have the following functions available" in listed[0]["content"]
    assert listed[0]["content"].startswith("Be brief.") and '"get_time"' in listed[0]["content"]
    same, declared = tooling.with_tools(messages, toolset, OWN_TEMPLATE)
    assert same == messages and [d["function"]["name"] for d in declared] == ["get_weather", "get_time"]
    none = tooling.parse_tools({"tools": TOOLS, "tool_choice": "none"})
    assert tooling.with_tools(messages, none, OWN_TEMPLATE) == (messages, None)


def test_parse_calls_and_the_stream_hold_back():
    call = (f"{tooling.CALL_BEGIN}function{tooling.SEP}get_time\n```json\n{{\"zone\": 2}}\n```{tooling.CALL_END}")
    text = f"Let me look.{tooling.CALLS_BEGIN}{call}\n{call}{tooling.CALLS_END}"
    content, calls, complete = tooling.parse_calls(text)
    assert content == "Let me look." and [c["function"]["arguments"] for c in calls] == ['{"zone": 2}'] * 2
    assert complete
    # cut short by max_tokens inside the second call: no markers in the content, the first call
    # kept, the second as far as it got (as OpenAI returns a cut call), and the block marked
    # incomplete, so finish_reason stays "length"
    content, calls, complete = tooling.parse_calls(text[:-30])
    assert content == "Let me look." and [c["function"]["arguments"] for c in calls] == ['{"zone": 2}'] * 2
    assert not complete
    content, calls, complete = tooling.parse_calls(text[:len("Let me look.") + 40])     # inside the first
    assert content == "Let me look." and calls is None and not complete
    stream, sent = tooling.CallStream(), []
    for i in range(0, len(text), 3):
        sent.append(stream.feed(text[i:i + 3]))
    assert "".join(sent) == "Let me look."
    assert stream.finish()[0] == "" and len(stream.finish()[1]) == 2
    plain = tooling.CallStream()
    assert plain.feed("a <｜tool") == "a " and plain.feed("ing") == "<｜tooling" and plain.finish() == ("", None, True)


def test_without_llguidance_auto_works_and_forcing_says_how_to_install(client, without_llguidance):
    r = client.chat.completions.create(model="ds2-tiny", messages=ASK, tools=TOOLS, max_tokens=2, seed=1)
    assert r.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="ds2-tiny", messages=ASK, tools=TOOLS, tool_choice="required")
    assert e.value.body["param"] == "tool_choice" and "pip install" in e.value.body["message"]


# ---- bad input ----
@pytest.mark.parametrize("fields, param, fault", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "needs a name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the declared tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]}, "tools",
     "not a usable JSON Schema"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_1", "content": "21"}]}, "messages[1]",
     "no assistant message before it"),
])
def test_bad_tool_fields_are_400_naming_the_param(client, fields, param, fault):
    body = {"model": "ds2-tiny", "messages": ASK, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.body["param"] == param and fault in e.value.body["message"]


def test_a_template_without_tools_is_400_saying_so(model):
    with running(model, None) as c:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="ds2-tiny", messages=ASK, tools=TOOLS)
        assert e.value.body["param"] == "tools" and "--chat-template" in e.value.body["message"]
        r = c.chat.completions.create(model="ds2-tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2)
        assert r.choices[0].message.tool_calls is None
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="ds2-tiny", prompt="x", extra_body={"tools": TOOLS})
        assert e.value.body["param"] == "tools"


def test_forced_calls_close_objects_that_do_not_say_otherwise():
    schema = {"type": "object", "properties": {"where": {"type": "object", "properties": {"city": {"type": "string"}}},
                                               "tags": {"type": "array", "items": {"type": "object"}}},
              "$defs": {"d": {"properties": {"x": {"type": "integer"}}}}}
    got = tooling.closed(schema)
    assert got["additionalProperties"] is False and got["properties"]["where"]["additionalProperties"] is False
    assert got["properties"]["tags"]["items"]["additionalProperties"] is False
    assert got["$defs"]["d"]["additionalProperties"] is False
    assert tooling.closed({"type": "object", "additionalProperties": True}) == {"type": "object",
                                                                               "additionalProperties": True}
    assert "additionalProperties" not in schema                # the request's own schema is untouched


# ---- a forced call cut by max_tokens, and numbers without bounds ----
COUNT = {"type": "function", "function": {
    "name": "count", "parameters": {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}}}


def test_a_call_cut_short_comes_back_partial_as_openai_returns_it():
    head = f"{tooling.CALLS_BEGIN}{tooling.CALL_BEGIN}function{tooling.SEP}count\n```json\n"
    content, calls, complete = tooling.parse_calls(head + '{"n": 1234567')
    assert content == "" and not complete
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("count", '{"n": 1234567')]
    _, calls, complete = tooling.parse_calls(head + '{"n": 12}\n``')          # the fence begun: not arguments
    assert calls[0]["function"]["arguments"] == '{"n": 12}' and not complete
    assert tooling.parse_calls(head[:-12]) == ("", None, False)                # its name not yet whole


@pytest.mark.parametrize("max_tokens, digits", [(None, 15), (8, 2), (30, 7), (1000, 15), (1, 1)])
def test_unbounded_numbers_are_bounded_by_max_tokens(max_tokens, digits):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]},
                                               "k": {"type": "integer", "maximum": 5}, "e": {"enum": [10 ** 20]},
                                               "xs": {"type": "array", "items": {"type": "number"}}}}
    got = tooling.bounded(schema, max_tokens)["properties"]
    top = 10 ** digits - 1
    assert (got["n"]["minimum"], got["n"]["maximum"]) == (-top, top) and "multipleOf" not in got["n"]
    assert (got["x"]["minimum"], got["x"]["maximum"], got["x"]["multipleOf"]) == (-top, top, 1e-6)
    assert (got["k"]["minimum"], got["k"]["maximum"]) == (-top, 5)           # its own bound kept
    assert got["e"] == {"enum": [10 ** 20]} and got["xs"]["items"]["maximum"] == top
    assert "minimum" not in schema["properties"]["n"]                          # the request's own schema untouched


def test_a_bounded_number_ends_where_its_digits_do(model):
    from ds2cli.generation import grammar as grammars
    schema = tooling.bounded({"type": "integer"}, 30)                         # 7 digits
    for text, ok in (("9999999", True), ("10000000", False), ("-9999999", True), ("1.5", False)):
        c = grammars.Constraint.for_model(grammars.json_schema_grammar(schema), model)
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        assert (c.valid_prefix(ids) == len(ids)) == ok, text
    x = tooling.bounded({"type": "number"}, 30)
    c = grammars.Constraint.for_model(grammars.json_schema_grammar(x), model)
    ids = model.tokenizer.encode("1.0000001", add_special_tokens=False)       # a seventh decimal: refused
    assert c.valid_prefix(ids) < len(ids)


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [55, 200])
def test_a_forced_call_with_an_unbounded_integer_returns_a_call(client, max_tokens):
    """ds2-tiny writes digits as long as it may: the number is bounded to fit, and a call that
    max_tokens still cuts (ds2-tiny spells DeepSeek's markers in 49 tokens before the first
    digit, so 55 cuts it among them) comes back as far as it got, with finish_reason length."""
    for seed in range(3):
        r = client.chat.completions.create(model="ds2-tiny", messages=ASK, tools=[COUNT], tool_choice="required",
                                           seed=seed, max_tokens=max_tokens, temperature=1.0)
        choice = r.choices[0]
        assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "count"
        args = choice.message.tool_calls[0].function.arguments
        if choice.finish_reason == "tool_calls":
            n = json.loads(args)["n"]
            assert abs(n) < 10 ** tooling.number_digits(max_tokens)
        else:
            assert choice.finish_reason == "length" and r.usage.completion_tokens == max_tokens
            assert re.fullmatch(r'\{"n": ?-?\d*', args)
