"""Reasoning kept apart by ds2 serve: ds2-tiny made to write `<think>...</think>answer`
(tests/support/scripted.py), with a chat template in the manner of DeepSeek-R1's (its generation
prompt opens `<think>`) and with ds2-tiny's own (the reply opens it), through the openai client,
streamed and not, through raw server-sent events, and the prompt of a later turn."""

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

import ds2cli
from ds2cli.server.jobs import parse_job
from ds2cli.server.request_fields import Defaults
from ds2cli.generation.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from test_serve import KEY, openai_client, request, running, sse  # noqa: E402
from support.scripted import Script  # noqa: E402

pytestmark = pytest.mark.slow     # servers in threads

R1_TEMPLATE = (Path(__file__).parents[1] / "data" / "r1_chat_template.jinja").read_text(encoding="utf-8")
THOUGHT, ANSWER = "I add 2 and 3: 5.", "2 + 3 = 5."
R1_REPLY = f"{THOUGHT}\n</think>\n\n{ANSWER}"             # the prompt opened <think>
V3_REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"    # the reply opens it
ASK = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def model():
    return ds2cli.load()


@contextmanager
def template(model, source):
    before = model.tokenizer.chat_template
    model.tokenizer.set_chat_template(source)
    try:
        yield
    finally:
        model.tokenizer.set_chat_template(before)


@pytest.mark.parametrize("source, reply", [("r1", R1_REPLY), ("ds2-tiny", V3_REPLY)])
def test_reasoning_comes_apart_whole_and_streamed(model, monkeypatch, source, reply):
    Script(reply).install(monkeypatch)
    with template(model, R1_TEMPLATE if source == "r1" else model.tokenizer.chat_template), \
            openai_client(model) as client:
        whole = client.chat.completions.create(model="ds2-tiny", messages=ASK, temperature=0)
        message = whole.choices[0].message
        assert (message.reasoning_content, message.content) == (THOUGHT, ANSWER)
        assert whole.choices[0].finish_reason == "stop"
        thought, answer = "", ""
        for chunk in client.chat.completions.create(model="ds2-tiny", messages=ASK, temperature=0, stream=True):
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            answer += delta.content or ""
        assert (thought, answer) == (THOUGHT, ANSWER)


def test_no_partial_marker_in_any_event(model, monkeypatch):
    """Every event carries reasoning or answer and never a piece of a marker (the markers are
    several tokens in ds2-tiny's vocabulary, so they arrive cut); n = 2 choices split apart."""
    Script(V3_REPLY).install(monkeypatch)
    with running(model) as (port, _, _):
        events = sse(port, {"messages": ASK, "stream": True, "n": 2, "temperature": 0.8},
                     path="/v1/chat/completions")
    assert events[-1] == "[DONE]"
    for index in (0, 1):
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert all("<" not in d.get("content", "") + d.get("reasoning_content", "") for d in deltas[1:])
        assert all(set(d) <= {"role", "content", "reasoning_content"} for d in deltas)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
        assert "".join(d.get("content") or "" for d in deltas) == ANSWER
        # the reasoning's deltas come first, with no content key
        first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
        assert all("content" not in d for d in deltas[1:first_answer])


def test_reasoning_format_none_leaves_it_in_content(model, monkeypatch):
    Script(R1_REPLY).install(monkeypatch)
    with template(model, R1_TEMPLATE), running(model, reasoning_format="none") as (port, _, _):
        status, body, _ = request(port, "POST", "/v1/chat/completions", {"messages": ASK, "temperature": 0})
        assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": R1_REPLY}
        # the request's own reasoning_format wins over the server's
        status, body, _ = request(port, "POST", "/v1/chat/completions",
                                  {"messages": ASK, "temperature": 0, "reasoning_format": "deepseek"})
        assert body["choices"][0]["message"]["reasoning_content"] == THOUGHT
        status, body, _ = request(port, "POST", "/v1/chat/completions",
                                  {"messages": ASK, "reasoning_format": "parsed"})
        assert status == 400 and body["error"]["param"] == "reasoning_format"
        assert "deepseek, none or auto" in body["error"]["message"]


def test_without_markers_nothing_changes(model):
    """ds2-tiny as it is: no reasoning_content key, the content as before, in every shape."""
    with running(model) as (port, _, _):
        status, body, _ = request(port, "POST", "/v1/chat/completions", {"messages": ASK, "temperature": 0})
        assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
        events = sse(port, {"messages": ASK, "stream": True, "temperature": 0}, path="/v1/chat/completions")
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == ANSWER
        assert not any("reasoning_content" in d for d in deltas)


def rendered(port, messages) -> str:
    status, ids, _ = request(port, "POST", "/tokenize", {"messages": messages})
    assert status == 200, ids
    status, text, _ = request(port, "POST", "/detokenize", {"tokens": ids["tokens"]})
    return text["content"]


@pytest.mark.parametrize("source", ["r1", "ds2-tiny"])
def test_earlier_reasoning_is_not_sent_back(model, monkeypatch, source):
    """A second turn, as the openai client sends it (the reply with its reasoning_content) and as
    a client that kept the whole text: the prompt holds the answer, never the reasoning."""
    Script(R1_REPLY if source == "r1" else V3_REPLY).install(monkeypatch)
    with template(model, R1_TEMPLATE if source == "r1" else model.tokenizer.chat_template), \
            running(model) as (port, _, _):
        status, body, _ = request(port, "POST", "/v1/chat/completions", {"messages": ASK, "temperature": 0})
        reply = body["choices"][0]["message"]
        follow = {"role": "user", "content": "And 4 + 4?"}
        for earlier in (reply, {"role": "assistant", "content": V3_REPLY}):
            prompt = rendered(port, [*ASK, earlier, follow])
            assert ANSWER in prompt and "I add" not in prompt and "</think>" not in prompt, prompt
            status, again, _ = request(port, "POST", "/v1/chat/completions",
                                       {"messages": [*ASK, earlier, follow], "temperature": 0})
            assert status == 200 and again["choices"][0]["message"]["reasoning_content"] == THOUGHT


def test_a_template_that_reads_reasoning_content_gets_it(model):
    reads = ("{% for m in messages %}{{ m['role'] }}: {% if m.get('reasoning_content') %}"
             "[{{ m['reasoning_content'] }}] {% endif %}{{ m['content'] }}\n{% endfor %}assistant:")
    with template(model, reads):
        defaults = Defaults(SamplingParams(), 16, 1024, None, tuple(model.eos_token_ids))
        job = parse_job({"messages": [*ASK, {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT},
                                      {"role": "user", "content": "And 4 + 4?"}]},
                        True, model.tokenizer, model.config.vocab_size, defaults)
        assert f"assistant: [{THOUGHT}] {ANSWER}\n" in model.tokenizer.decode(job.ids)
        assert not job.reasoning_opened
        with pytest.raises(Exception, match="reasoning_content"):      # a lone surrogate is a 400
            parse_job({"messages": [*ASK, {"role": "assistant", "content": "", "reasoning_content": "\ud800"}]},
                      True, model.tokenizer, model.config.vocab_size, defaults)


def test_continuing_a_message_inside_its_reasoning(model, monkeypatch):
    """continue_final_message on "<think>\\nI add": the reply goes on inside the reasoning."""
    Script(V3_REPLY).install(monkeypatch)
    with running(model) as (port, _, _):
        status, body, _ = request(port, "POST", "/v1/chat/completions", {
            "messages": [*ASK, {"role": "assistant", "content": "<think>\nI add"}], "continue_final_message": True,
            "temperature": 0})
    assert status == 200
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER,
                                             "reasoning_content": THOUGHT[len("I add"):].lstrip()}
