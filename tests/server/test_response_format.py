"""response_format through ds2 serve with the official openai client: JSON Schema, json_object,
Lark, streamed and not, and the 400s that name the param (tests/generation/test_grammar.py tests
the masks themselves). ds2-tiny at temperature 1 writes near-random text, so a reply that parses
and validates shows the mask did the work."""

import json

import pytest

import ds2cli
from ds2cli.generation.sampling import SamplingParams
from test_serve import openai_client
from support.schemas import LIST, NESTED, PERSON

pytest.importorskip("llguidance", reason="the grammar extra: pip install '.[grammar]'")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def model():
    return ds2cli.load()


def running(model, temperature=1.0, max_tokens=200):
    return openai_client(model, params=SamplingParams(temperature=temperature), max_tokens=max_tokens, max_queue=4)


@pytest.fixture(scope="module")
def client(model):
    with running(model) as c:
        yield c


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


# ---- ds2 serve ----
@pytest.mark.slow
@pytest.mark.parametrize("schema", [PERSON, NESTED, LIST], ids=["person", "nested", "list"])
def test_json_schema_replies_validate(client, schema):
    for seed in (1, 2):
        r = client.chat.completions.create(model="ds2-tiny", messages=[{"role": "user", "content": "Describe."}],
                                           seed=seed, response_format=schema_format(schema))
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.slow
def test_json_object_streamed_and_completions(client):
    stream = client.chat.completions.create(model="ds2-tiny", messages=[{"role": "user", "content": "JSON?"}],
                                            seed=5, stream=True, response_format={"type": "json_object"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text), dict)
    r = client.completions.create(model="ds2-tiny", prompt="ROMEO:", seed=5,
                                  extra_body={"response_format": schema_format(NESTED)})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), NESTED)


def test_cut_by_max_tokens_is_length_not_stop(client):
    r = client.chat.completions.create(model="ds2-tiny", messages=[{"role": "user", "content": "x"}], seed=1,
                                       max_tokens=3, response_format=schema_format(PERSON))
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


@pytest.mark.parametrize("fmt, fault", [
    ({"type": "xml"}, "response_format must be"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "Invalid type: foo"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}, "strict")])
def test_bad_response_format_is_400_naming_it(client, fmt, fault):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="ds2-tiny", messages=[{"role": "user", "content": "x"}],
                                       response_format=fmt)
    assert e.value.body["param"] == "response_format" and fault in e.value.body["message"]


def test_stop_with_a_grammar_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="ds2-tiny", messages=[{"role": "user", "content": "x"}],
                                       stop=["}"], response_format={"type": "json_object"})
    assert e.value.body["param"] == "stop"


def test_without_llguidance_the_400_says_how_to_install(client, without_llguidance):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="ds2-tiny", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"})
    assert "pip install" in e.value.body["message"] and e.value.body["param"] == "response_format"
    r = client.chat.completions.create(model="ds2-tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, response_format={"type": "text"})
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("schema", [
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/loop"}}, "required": ["a"],
     "$defs": {"loop": {"allOf": [{"$ref": "#/$defs/loop"}]}}},
], ids=["self_ref", "allof_loop"])
def test_a_schema_the_grammar_library_cannot_use_is_a_short_400(client, schema):
    """Never the library's parser state, a panic or a build path: one short line naming the param."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="ds2-tiny", messages=[{"role": "user", "content": "x"}],
                                       response_format=schema_format(schema))
    body = e.value.body
    assert body["param"] == "response_format" and len(body["message"]) < 300
    for leak in ("<state>", ".rs", "panicked", "Parser:", "\n"):
        assert leak not in body["message"]
