"""A request's limits (request_fields.py, jobs.py), each a 400 before any work its size would
cost (the tokenizer's calls counted): a list of prompts beyond 64 choices, logit_bias keys
spelled any way but as a plain id and more entries than the limit, tools beyond their count and
a name used twice (found before any schema compiles)."""

import pytest

import ds2cli
from ds2cli.generation.sampling import SamplingParams
from ds2cli.server import tools
from ds2cli.server.jobs import parse_jobs
from ds2cli.server.request_fields import MAX_LOGIT_BIAS, ApiError, Defaults


class Counting:
    """The model's tokenizer, its encode calls counted."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer.encode(*args, **kwargs)


@pytest.fixture(scope="module")
def model():
    return ds2cli.load()


def parse(model, body, chat=False, ctx=1024):
    tok = Counting(model.tokenizer)
    defaults = Defaults(SamplingParams(), 16, ctx, None, tuple(model.eos_token_ids))
    try:
        return parse_jobs(body, chat, tok, model.config.vocab_size, defaults), tok.calls
    except ApiError as e:
        return e, tok.calls


def test_too_many_prompts_are_refused_before_one_is_tokenized(model):
    error, calls = parse(model, {"prompt": ["a"] * 65})
    assert error.status == 400 and "65 prompts" in error.message and calls == 0
    error, calls = parse(model, {"prompt": ["a"] * 33, "n": 2})
    assert error.status == 400 and calls == 0


@pytest.mark.parametrize("key", [" 12", "012", "+12", "12 ", "1e1", "0x1"])
def test_logit_bias_keys_are_plain_ids(model, key):
    error, _ = parse(model, {"prompt": "a", "logit_bias": {key: 1}})
    assert error.status == 400 and error.param == "logit_bias" and "plain integer" in error.message


def test_logit_bias_entries_are_counted_first(model):
    error, calls = parse(model, {"prompt": "a", "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}})
    assert error.status == 400 and "more than the limit" in error.message
    jobs, _ = parse(model, {"prompt": "a", "logit_bias": {"12": 5}})
    assert jobs[0].params.logit_bias == ((12, 5.0),)


def function(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def test_tools_beyond_their_count_and_a_name_used_twice_are_refused_before_compiling(model, monkeypatch):
    compiled = []
    monkeypatch.setattr(tools, "_tool", lambda t, i: compiled.append(i))
    messages = [{"role": "user", "content": "hi"}]
    error, _ = parse(model, {"messages": messages, "tools": [function(f"f{i}") for i in range(tools.MAX_TOOLS + 1)]}, True)
    assert error.status == 400 and "more than the limit" in error.message and compiled == []
    error, _ = parse(model, {"messages": messages, "tools": [function("a"), function("b"), function("a")]}, True)
    assert error.status == 400 and "share a name (a)" in error.message and compiled == []


def test_llama_servers_fields_are_read_and_an_unknown_one_is_named(model):
    from ds2cli.server.http_io import Read
    body = Read({"prompt": "a", "n_predict": 7, "ignore_eos": True, "cache_prompt": True, "temprature": 0.5})
    jobs, _ = parse(model, body)
    assert jobs[0].max_tokens == 7 and jobs[0].ignore_eos
    assert body.ignored() == ["temprature"]


def test_a_prompt_longer_than_the_context_in_characters_is_refused_before_it_is_tokenized(model):
    most = 1024 * model.tokenizer.longest_token            # the test's ctx x the longest token's characters
    error, calls = parse(model, {"prompt": "7" * (most + 1)})
    assert (error.status, error.code, error.param, calls) == (400, "context_length_exceeded", "prompt", 0)
    assert f"{most + 1} characters" in error.message and "1024 tokens" in error.message
    error, calls = parse(model, {"prompt": ["a", "b", "7" * (most + 1)]})     # the short ones are not read first
    assert error.status == 400 and "prompt[2]" in error.message and calls == 0
    chat = {"messages": [{"role": "user", "content": "7" * most}]}            # the template's words make it longer
    error, calls = parse(model, chat, True)
    assert (error.status, error.code, error.param, calls) == (400, "context_length_exceeded", "messages", 0)


def test_a_prompt_within_the_characters_is_still_counted_in_tokens(model):
    """Counted in slices that stop past the context (Tokenizer.count_at_least), as /tokenize's
    text is, never tokenized whole: no encode call."""
    error, calls = parse(model, {"prompt": "7 " * 2000})    # 4,000 characters, over 1,024 tokens
    assert error.code == "context_length_exceeded" and "tokens, more than the context" in error.message and calls == 0
    chat = {"messages": [{"role": "user", "content": "7 " * 2000}]}
    error, calls = parse(model, chat, True)
    assert (error.code, error.param, calls) == ("context_length_exceeded", "messages", 0)


def test_the_longest_prompt_the_characters_admit_is_counted_only_past_the_context(model, monkeypatch):
    """At a context of 4,096 tokens ds2-tiny's tokens admit ~119,000 characters; a prompt of them
    is counted in slices (64K characters) until the count passes the context: one slice, not all."""
    most = 4096 * model.tokenizer.longest_token
    prompt = ("7 " * most)[:most]
    counted = []
    real = model.tokenizer._ids
    monkeypatch.setattr(model.tokenizer, "_ids", lambda text, **kw: counted.append(len(text)) or real(text, **kw))
    error, calls = parse(model, {"prompt": prompt}, ctx=4096)
    assert (error.status, error.code, calls) == (400, "context_length_exceeded", 0)
    assert error.message.startswith("prompt is at least ") and len(counted) == 1 and counted[0] < len(prompt) / 1.5


def test_token_ids_are_counted_before_they_are_read_through(model):
    """A list of ids longer than the context is refused by its length, before any id is looked at
    (one bad id at its end is not what the 400 names); a list of a million ids, a 2 MB body, costs
    no loop over them."""
    error, calls = parse(model, {"prompt": [5] * 1024 + ["x"]})
    assert (error.status, error.code, error.param, calls) == (400, "context_length_exceeded", "prompt", 0)
    assert error.message == "prompt is 1025 tokens, more than the context of 1024 tokens"
    error, _ = parse(model, {"prompt": ["a", [5] * 1_000_000]})
    assert error.code == "context_length_exceeded" and error.message.startswith("prompt[1] is 1000000 tokens")
    error, _ = parse(model, {"prompt": [5, "x"]})
    assert error.status == 400 and error.message == "prompt token ids must be in [0, 4096)"
    jobs, calls = parse(model, {"prompt": [[5, 6], "a"]})
    assert [j.ids[:2] for j in jobs][0] == [5, 6] and calls == 1
