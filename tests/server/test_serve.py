"""ds2 serve on ds2-tiny: the official openai client for the API, raw HTTP for the error cases,
a subprocess for signals. Servers run on ephemeral ports in threads; nothing leaves localhost."""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from contextlib import contextmanager

import numpy as np
import pytest
from click.testing import CliRunner

import ds2cli
from ds2cli.wording import unpacked
from ds2cli.server import scheduler as engine_module
from ds2cli.cli import serve as serve_module
from ds2cli.server.jobs import Job
from ds2cli.server.request_fields import Defaults
from ds2cli.cli.main import main
from ds2cli.errors import GenerationError
from ds2cli.generation.generate import lstrip_reply, stream_generate
from ds2cli.model.cache import common_prefix
from ds2cli.server.prompt_cache import PromptCache
from ds2cli.generation.sampling import SamplingParams, make_sampler
from ds2cli.server.scheduler import Scheduler
from ds2cli.server.http_server import MAX_BODY_BYTES, Server, State

openai = pytest.importorskip("openai")   # the test extra: pip install ".[test]"

KEY = "sk-test-key"
ROMEO = "ROMEO:\n"


@pytest.fixture(scope="module")
def model():
    return ds2cli.load()


def make_server(model, api_key=KEY, max_queue=16, budget=64 << 20, ctx=1024, params=None, system=None,
                parallel=1, cors_origins=(), max_tokens=256, reasoning_format="deepseek", **scheduler):
    """A server not yet serving; returns (server, state, log lines)."""
    lines = []
    params = params or SamplingParams.from_generation_config(model.generation_config)
    defaults = Defaults(params, max_tokens, ctx, system, tuple(model.eos_token_ids), reasoning_format)
    state = State(Scheduler(model, ctx, budget, max_queue, parallel=parallel, **scheduler), "ds2-tiny", defaults,
                  api_key, sink=lines.append, cors_origins=cors_origins)
    return Server(("127.0.0.1", 0), state), state, lines


@contextmanager
def holding(scheduler):
    """The test holds one of the scheduler's slots, as a long request whose client reads nothing
    would: it sits out every pass once its backlog is full."""
    job = Job(False, scheduler.model.tokenizer.encode(ROMEO), SamplingParams(temperature=0), 10 ** 6, (), True, False)
    with scheduler.admit([job], lambda: False):
        yield


@contextmanager
def running(model, **settings):
    """A server in a thread; yields (port, state, log lines)."""
    server, state, lines = make_server(model, **settings)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], state, lines
    finally:
        server.shutdown()
        server.server_close()
    assert not any("Traceback" in line for line in lines)


@contextmanager
def openai_client(model, **settings):
    """A server in a thread (no key); yields the official client pointed at it."""
    with running(model, api_key=None, **settings) as (port, _, _):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server(model):
    with running(model) as s:
        yield s


def client(port, key=KEY):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30)


def cli_json(*args):
    r = CliRunner().invoke(main, ["generate", "--temperature", "0", "--json", *args])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def fresh_greedy(model, ids, max_new, chat):
    """What a fresh cache gives for these ids: the reference for cached prefixes."""
    chunks = stream_generate(model, ids, model.new_cache(len(ids) + max_new),
                             make_sampler(SamplingParams(temperature=0)), max_new)
    chunks = list(lstrip_reply(chunks) if chat else chunks)
    return "".join(c.text for c in chunks), chunks[-1]


def request(port, method, path, body=None, headers=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Authorization": f"Bearer {KEY}", **(headers or {})})
    r = conn.getresponse()
    payload = r.read()
    conn.close()
    return r.status, json.loads(payload) if payload else None, r


# ---- the API, through the openai client ----
@pytest.mark.slow
@pytest.mark.parametrize("question", ["What is 451 - 123?", "Count from 3 to 9."])
def test_chat_greedy_equals_generate_chat(server, question):
    port, _, _ = server
    expected = cli_json("--chat", question, "-n", "40")
    r = client(port).chat.completions.create(model="ds2-tiny", messages=[{"role": "user", "content": question}],
                                             temperature=0, max_tokens=40)
    assert r.choices[0].message.content == expected["text"]
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == expected["completion_tokens"]
    assert r.usage.prompt_tokens == expected["prompt_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason == "stop" and expected["finish_reason"] == "eos"
    assert r.model == "ds2-tiny" and r.object == "chat.completion" and r.id.startswith("chatcmpl-")


@pytest.mark.slow
def test_completion_greedy_equals_generate_and_stops_at_length(server):
    port, _, _ = server
    expected = cli_json(ROMEO, "-n", "40")
    r = client(port).completions.create(model="ds2-tiny", prompt=ROMEO, temperature=0, max_tokens=40)
    assert r.choices[0].text == expected["text"]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40
    assert r.usage.prompt_tokens == expected["prompt_tokens"]
    # the same prompt as token ids
    ids = ds2cli.load().tokenizer.encode(ROMEO)
    r2 = client(port).completions.create(model="ds2-tiny", prompt=ids, temperature=0, max_tokens=40)
    assert r2.choices[0].text == expected["text"]


def test_chat_stream_equals_whole_answer_with_usage(server):
    port, _, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 17 + 25?"}]
    whole = client(port).chat.completions.create(model="x", messages=messages, temperature=0)
    chunks = list(client(port).chat.completions.create(model="x", messages=messages, temperature=0, stream=True,
                                                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content == "17 + 25 = 42."
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "stop" and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # the stream asked the same prompt again: all but its last token came from the prompt cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1


@pytest.mark.slow
def test_completion_stream_and_stop_strings(server):
    port, _, _ = server
    expected = cli_json(ROMEO, "-n", "60", "--stop", "ULYSSES")
    chunks = list(client(port).completions.create(model="x", prompt=ROMEO, temperature=0, max_tokens=60,
                                                  stop=["ULYSSES"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected["text"]
    assert chunks[-1].choices[0].finish_reason == "stop" and expected["finish_reason"] == "stop"
    assert all(c.usage is None for c in chunks)     # no include_usage: no usage chunk


@pytest.mark.slow
def test_follow_up_turn_reuses_the_cached_prefix_and_matches_a_fresh_prefill(server, model):
    port, _, _ = server
    c = client(port)
    messages = [{"role": "user", "content": "What is 30 + 12?"}]
    first = c.chat.completions.create(model="x", messages=messages, temperature=0, max_tokens=30)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": [{"type": "text", "text": "Count from 4 "},
                                              {"type": "text", "text": "to 8."}]}]
    second = c.chat.completions.create(model="x", messages=messages, temperature=0, max_tokens=30)
    flat = messages[:2] + [{"role": "user", "content": "Count from 4 to 8."}]
    ids = model.tokenizer.encode_chat(flat)
    text, last = fresh_greedy(model, ids, 30, chat=True)
    assert second.choices[0].message.content == text == "4, 5, 6, 7, 8."
    assert second.usage.completion_tokens == last.generated_tokens
    # everything before the second user turn was cached: the first prompt and the first reply
    # (the reply's closing eos was sampled, never fed, so it is recomputed)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert cached < second.usage.prompt_tokens


def test_two_concurrent_clients_get_their_own_answers(server):
    port, _, lines = server
    questions = {"What is 2 + 3?": "2 + 3 = 5.", "What is 10 + 11?": "10 + 11 = 21."}
    answers = {}

    def ask(q):
        r = client(port).chat.completions.create(model="x", messages=[{"role": "user", "content": q}], temperature=0)
        answers[q] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert answers == questions


def test_models_and_health(server):
    port, _, _ = server
    models = client(port).models.list()
    assert [m.id for m in models.data] == ["ds2-tiny"]
    assert client(port).models.retrieve("ds2-tiny").id == "ds2-tiny"
    status, body, _ = request(port, "GET", "/health", headers={"Authorization": ""})
    assert status == 200 and body["status"] == "ok" and body["model"] == "ds2-tiny"
    status, body, r = request(port, "HEAD", "/v1/models")
    assert status == 200 and body is None and int(r.getheader("Content-Length")) > 0


@pytest.mark.slow
def test_server_default_sampling_with_a_seed_is_reproducible(server):
    port, _, _ = server
    ask = lambda seed: client(port).completions.create(model="x", prompt=ROMEO, max_tokens=20, seed=seed,  # noqa: E731
                                                       temperature=1.0).choices[0].text
    assert ask(7) == ask(7)
    assert len({ask(s) for s in range(4)}) > 1


# ---- bad input, over raw HTTP ----
ERROR_CASES = [
    ("POST", "/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("POST", "/v1/chat/completions", b"[" * 100000 + b"]" * 100000, 400, "nested too deeply"),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages must be a non-empty list"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "only text parts"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400,
     "temperature must be a finite number"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400,
     "temperature must be >= 0"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
     "max_tokens must be at least 1"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400,
     "n must be in [1, 64], not 0"),
    ("POST", "/v1/completions", {"prompt": ["a", "b"], "n": 40}, 400, "2 prompts x n = 40 is more than 64 choices"),
    ("POST", "/v1/completions", {"prompt": ["a", [5, 99999]]}, 400, "prompt[1] token ids must be in [0, 4096)"),
    ("POST", "/v1/completions", {"prompt": ["a", 5]}, 400, "prompt must be a string, a list of token ids, or a list"),
    ("POST", "/v1/completions", {"prompt": "hi", "draft": 64}, 400, "draft must be in [0, 63], not 64"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400,
     "stream must be true or false"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": [1]}, 400,
     "stop must be a string or a list of strings"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5},
     400, "repetition_penalty"),
    ("POST", "/v1/completions", {"prompt": {"text": "hi"}}, 400, "prompt must be a string"),
    ("POST", "/v1/completions", {"prompt": [5, 99999]}, 400, "prompt token ids must be in [0, 4096)"),
    ("POST", "/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "tokenizer has no fill-in-the-middle tokens"),
    ("POST", "/v1/completions", {"prompt": "hi", "seed": -2}, 400, "seed must be >= 0, or -1 for a random one"),
    ("POST", "/v1/completions", {"prompt": "hi", "top_p": 1e999}, 400, "top_p must be a finite number"),
    ("POST", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt is not valid Unicode"),
    ("POST", "/v1/completions", b'{"prompt": "\xff"}', 400, "not valid JSON"),
    ("GET", "/v1/nothing", None, 404, "no such endpoint"),
    ("GET", "/v1/models/gpt-4", None, 404, "does not exist"),
    ("GET", "/v1/chat/completions", None, 405, "takes POST, not GET"),
    ("DELETE", "/v1/models", None, 405, "takes GET, not DELETE"),
]


@pytest.mark.parametrize("method,path,body,status,message", ERROR_CASES)
def test_bad_input_gets_openai_style_errors(server, method, path, body, status, message):
    port, _, lines = server
    raw = body if isinstance(body, bytes) else None
    got, payload, _ = request(port, method, path, body=None if raw else body, raw=raw)
    assert got == status
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
    assert message in payload["error"]["message"]
    assert payload["error"]["type"] == "invalid_request_error"
    assert logged(lines, f'"{method} {path}" {status} | error: {payload["error"]["message"]}')


VALUE_CASES = [({"temperature": -1}, "temperature", "temperature must be >= 0"),
               ({"temperature": "hot"}, "temperature", "temperature must be a finite number"),
               ({"top_p": 2}, "top_p", "top_p must be in (0, 1]"),
               ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
               ({"min_p": 5}, "min_p", "min_p must be in [0, 1]"),
               ({"top_k": -3}, "top_k", "top_k must be >= 0"),
               ({"top_k": 1.5}, "top_k", "top_k must be an integer"),
               ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be > 0"),
               ({"seed": -5}, "seed", "seed must be >= 0, or -1 for a random one; not -5"),
               ({"seed": 0.5}, "seed", "seed must be an integer"),
               ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields,param,message", VALUE_CASES)
def test_a_value_out_of_range_names_its_param(server, path, fields, param, message):
    port, _, _ = server
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], **fields}
    status, payload, _ = request(port, "POST", path, body)
    assert status == 400 and payload["error"]["param"] == param and payload["error"]["message"].startswith(message)


@pytest.mark.slow
def test_seed_minus_one_asks_for_a_random_seed_over_the_server_default(model):
    with running(model, params=SamplingParams(temperature=1.0, seed=7)) as (port, _, _):
        ask = lambda **seed: client(port).completions.create(model="x", prompt=ROMEO, max_tokens=20,  # noqa: E731
                                                             **seed).choices[0].text
        assert ask() == ask() == ask(seed=7)            # the server's --seed, for requests without one
        assert len({ask(seed=-1) for _ in range(4)}) > 1


@pytest.mark.parametrize("args, option, text", [
    (["--temperature", "-1"], "--temperature", "-1.0 is not in the range x>=0"),
    (["--temp", "-1"], "--temperature", "-1.0 is not in the range x>=0"),
    (["--temperature", "nan"], "--temperature", "'nan' is not a finite number"),
    (["--top-p", "2"], "--top-p", "2.0 is not in the range 0<x<=1"),
    (["--min-p", "5"], "--min-p", "5.0 is not in the range 0<=x<=1"),
    (["--top-k", "-3"], "--top-k", "-3 is not in the range x>=0"),
    (["--seed", "-5"], "--seed", "-5 is not a seed"),
    (["--threads", "0"], "--threads", "0 is not in the range x>=1"),
    (["--ctx", "4096"], "--ctx", "4096 is larger than the model's max_position_embeddings (1024)"),
    (["--cors-origin", "http://localhost:3000/"], "--cors-origin", "is not an origin"),
    (["--cors-origin", "localhost"], "--cors-origin", "is not an origin"),
])
def test_serve_options_are_usage_errors_before_any_weight_loads(no_loading, args, option, text):
    r = CliRunner().invoke(main, ["serve", "--port", "0", *args])
    assert r.exit_code == 2 and "Invalid value for " in r.stderr and f"'{option}'" in r.stderr and text in r.stderr
    assert r.stdout == ""


@pytest.mark.slow
def test_serve_options_reach_the_server(tmp_path, serving):
    """--alias, --system, --chat-template and --threads, through the command (serving stubbed)."""
    template = tmp_path / "template.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "[assistant]")
    seen = {}

    def serve_forever(server, state, thread=None, ready=None):
        if ready is not None:
            ready()                  # the ready line, logged once the real one's handlers are in place
        from threadpoolctl import threadpool_info
        seen.update(state=state, blas=[p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"],
                    cores=state.scheduler.model.executor.compute.machine.workers.n)
        server.shutdown()            # the port was bound, and served, before the model loaded
        server.server_close()

    serving(serve_forever)
    r = CliRunner().invoke(main, ["serve", "--port", "0", "--alias", "my-model", "--system", "Answer in French.",
                                  "--chat-template", str(template), "--threads", "1", "--temp", "0", "--seed", "-1",
                                  "--cors-origin", "http://localhost:3000", "--cors-origin", "*"])
    assert r.exit_code == 0, r.stderr
    assert re.match(r"ds2 serve: my-model \(loaded in", r.stderr)
    state = seen["state"]
    assert state.model_id == "my-model" and state.defaults.system == "Answer in French."
    assert state.cors_origins == ("http://localhost:3000", "*")
    assert state.defaults.params.temperature == 0 and state.defaults.params.seed is None
    assert set(seen["blas"]) == {1} and seen["cores"] == 1
    tok = state.scheduler.model.tokenizer
    assert tok.decode(tok.encode_chat([{"role": "user", "content": "hi"}])).endswith("[user] hi\n[assistant]")


@pytest.mark.slow
@pytest.mark.parametrize("slash", ["", "/"])
def test_a_model_is_served_under_its_directory_name_not_its_path(tmp_path, slash, serving):
    """-m PATH: /v1/models, a response's `model` and the start line say the directory's name, as
    llama-server says its file's basename."""
    import shutil
    from ds2cli.weights.source import bundled_model_dir
    target = tmp_path / "models" / "my-tiny"
    shutil.copytree(bundled_model_dir(), target)
    seen = {}

    def serve_forever(server, state, thread=None, ready=None):
        ready()
        port = server.server_address[1]
        seen["models"] = request(port, "GET", "/v1/models")[1]
        seen["reply"] = request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})[1]
        server.shutdown()
        server.server_close()

    serving(serve_forever)
    r = CliRunner().invoke(main, ["serve", "--port", "0", "-m", str(target) + slash])
    assert r.exit_code == 0, r.stderr
    assert [m["id"] for m in seen["models"]["data"]] == ["my-tiny"] and seen["reply"]["model"] == "my-tiny"
    assert r.stderr.startswith("ds2 serve: my-tiny (loaded in")


def test_the_served_name_of_an_id_a_path_and_no_model(tmp_path):
    (tmp_path / "V2-Lite-q4").mkdir()
    assert serve_module.served_name(tmp_path / "V2-Lite-q4") == "V2-Lite-q4"
    assert serve_module.served_name("deepseek-ai/DeepSeek-V2-Lite-Chat") == "deepseek-ai/DeepSeek-V2-Lite-Chat"
    assert serve_module.served_name(None) == "ds2-tiny"


@pytest.mark.slow
def test_system_default_goes_before_chats_that_bring_none(model):
    system = "You are terse."
    with running(model, system=system) as (port, _, _):
        ask = lambda messages: client(port).chat.completions.create(  # noqa: E731
            model="x", messages=messages, temperature=0, max_tokens=30)
        user = {"role": "user", "content": "What is 2 + 3?"}
        defaulted = ask([user])
        own = ask([{"role": "developer", "content": "Be brief."}, user])
    ids = model.tokenizer.encode_chat([{"role": "system", "content": system}, user], add_generation_prompt=True)
    assert defaulted.usage.prompt_tokens == len(ids)
    assert defaulted.choices[0].message.content == fresh_greedy(model, ids, 30, chat=True)[0]
    theirs = model.tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, user],
                                         add_generation_prompt=True)
    assert own.usage.prompt_tokens == len(theirs)


def test_a_prompt_longer_than_the_context_is_refused_with_the_counts(model):
    with running(model, ctx=16) as (port, _, _):
        status, payload, _ = request(port, "POST", "/v1/completions", {"prompt": "one two three " * 10})
    n = len(model.tokenizer.encode("one two three " * 10))
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded"
    # counted in slices that stop past the context (jobs.check_length): a lower bound, bos not counted
    at_least = int(payload["error"]["message"].removeprefix("prompt is at least ").split()[0])
    assert payload["error"]["message"] == f"prompt is at least {at_least} tokens, more than the context of 16 tokens"
    assert 16 < at_least <= n


def test_api_key_is_required_when_set(server):
    port, _, _ = server
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + KEY}):
        status, payload, r = request(port, "GET", "/v1/models", headers=headers)
        assert status == 401 and payload["error"]["code"] == "invalid_api_key"
        assert r.getheader("WWW-Authenticate") == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        client(port, key="wrong").models.list()


def test_oversized_body_gets_413_without_being_read(server):
    port, _, lines = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1) + b"{" * 1000)
        response = s.makefile("rb").read()       # the server answers and closes without the rest
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"Connection: close" in head
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert str(MAX_BODY_BYTES) in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("headers,status", [({"Transfer-Encoding": "chunked"}, 411), ({}, 411),
                                            ({"Content-Length": "-5"}, 400), ({"Content-Length": "abc"}, 400),
                                            ({"Content-Length": "1_0"}, 400)])
def test_bodies_without_a_usable_length(server, headers, status):
    port, _, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\n" + extra + b"Connection: close\r\n\r\n")
        head, _, body = s.makefile("rb").read().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status) and "error" in json.loads(body)


def test_http_layer_errors_are_json_too(server):
    port, _, lines = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = s.makefile("rb").read().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 501") and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_keep_alive_serves_requests_after_an_error(server):
    port, _, _ = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    auth = {"Authorization": f"Bearer {KEY}"}
    conn.request("POST", "/v1/completions", body=b'{"prompt": 5}', headers=auth)
    assert conn.getresponse().read() and conn.sock is not None
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "What", "max_tokens": 3}), headers=auth)
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 3
    conn.close()


def test_internal_errors_are_one_line_without_traceback(server, monkeypatch):
    port, state, lines = server
    model = state.scheduler.model

    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(model, "forward_batch", broken)
    status, payload, _ = request(port, "POST", "/v1/completions", {"prompt": "hi"})
    assert status == 500 and payload["error"]["type"] == "server_error"
    assert payload["error"]["message"] == "internal error: RuntimeError: boom second line"
    assert logged(lines, "500 | error: internal error: RuntimeError: boom second line")
    monkeypatch.undo()

    real = model.forward_batch

    def nan_midway(steps, *args, **kwargs):    # the prefill is fine, the first decode step is not
        out = real(steps, *args, **kwargs)
        return [np.full_like(o, np.nan) if len(s.ids) == 1 else o for s, o in zip(steps, out)]

    monkeypatch.setattr(model, "forward_batch", nan_midway)
    events = sse(port, {"prompt": "1, 2, 3,", "stream": True, "temperature": 0})
    assert events[0]["choices"][0]["text"]
    assert "non-finite logits" in events[1]["error"]["message"] and events[2] == "[DONE]"


def logged(lines, text, timeout=60):
    """Whether a log line containing `text` appears (it is written just after the response)."""
    deadline = time.monotonic() + timeout
    while not any(text in unpacked(line) for line in lines):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def sse(port, body, path="/v1/completions"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body=json.dumps(body), headers={"Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
    events = [line[6:] for line in r.read().decode().split("\n\n") if line.startswith("data: ")]
    conn.close()
    return [e if e == "[DONE]" else json.loads(e) for e in events]


# ---- queueing, disconnects ----
@pytest.mark.slow
def test_requests_queue_in_order_and_beyond_the_queue_get_503(model):
    with running(model, max_queue=1) as (port, state, lines):
        results = []
        with holding(state.scheduler):      # the test holds the scheduler, as a long request would
            waiter = threading.Thread(target=lambda: results.append(
                request(port, "POST", "/v1/completions", {"prompt": "What", "max_tokens": 2, "temperature": 0})))
            waiter.start()
            deadline = time.monotonic() + 60
            while state.scheduler.waiting() < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            status, payload, r = request(port, "POST", "/v1/completions", {"prompt": "What", "max_tokens": 2})
            assert status == 503 and payload["error"]["code"] == "queue_full" and r.getheader("Retry-After")
            assert results == []                        # the queued one waits for its turn
        waiter.join(60)
        assert results[0][0] == 200 and results[0][1]["usage"]["completion_tokens"] == 2


@pytest.mark.slow
def test_a_client_that_hangs_up_mid_stream_stops_its_generation(model, monkeypatch):
    # decode steps wait until the client has hung up: the generation cannot run ahead of it
    hung_up, forward = threading.Event(), model.forward_batch

    def held_forward(steps, *args, **kwargs):
        if len(steps[0].ids) == 1:
            hung_up.wait(60)
        return forward(steps, *args, **kwargs)
    monkeypatch.setattr(model, "forward_batch", held_forward)
    with running(model) as (port, state, lines):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        body = json.dumps({"prompt": ROMEO, "max_tokens": 1000, "temperature": 0, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        f = s.makefile("rb")
        while b"data: " not in f.readline():
            pass
        s.shutdown(socket.SHUT_RDWR)
        s.close()
        hung_up.set()
        assert logged(lines, "client gone"), lines
        gone = [line for line in lines if "client gone" in line]
        chunks = int(re.search(r"client gone after (\d+) chunks", gone[0]).group(1))
        assert chunks < 20                              # far from the 1000 asked for
        # a reset of an idle keep-alive connection is no request: nothing is logged for it
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)
        idle.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        idle.close()                                    # linger 0: the close sends a reset
        # the server goes on serving, and kept the prompt's cache
        status, payload, _ = request(port, "POST", "/v1/completions", {"prompt": ROMEO, "max_tokens": 5})
        usage = payload["usage"]
        assert status == 200 and usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        deadline = time.monotonic() + 60                # its log line comes just after the response
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not logged(lines, "connection error", timeout=0.5) and len(lines) == 2


@contextmanager
def serve_process(*args):
    """`ds2 serve` in a subprocess; yields (process, port, a streaming response of 200 or 1000 tokens)."""
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "ds2cli", "serve", "--port", "0", "--temperature", "0", *args],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", proc.stderr.readline()).group(1))
        yield proc, port
    finally:
        proc.kill()
        proc.wait()


def start_stream(port, max_tokens, **sampling):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"prompt": ROMEO, "max_tokens": max_tokens, "stream": True, **sampling}
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    r = conn.getresponse()
    assert r.status == 200 and r.read(6) == b"data: "
    return r


@pytest.mark.slow
def test_sigterm_stops_accepting_finishes_the_running_request_and_exits_0():
    with serve_process() as (proc, port):
        r = start_stream(port, 200)
        proc.send_signal(signal.SIGTERM)
        rest = r.read().decode()
        assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in rest
        assert proc.wait(60) == 0
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        log = proc.stderr.read()
    assert "stopping" in log and "stopped" in log and "Traceback" not in log
    assert re.search(r'"POST /v1/completions" 200 \| prompt \d+ tok, 0 cached \| gen 200 tok', unpacked(log))


@pytest.mark.slow
def test_a_second_sigint_ends_the_running_stream_properly_and_still_exits_0():
    with serve_process("--quantize", "8") as (proc, port):     # serve loads as generate does
        # sampled, not greedy: greedy 8-bit ds2-tiny ends this prompt with eos after 26 tokens,
        # before the second signal; this seed runs to 1000 (ds2 generate --quantize 8 --seed 0)
        r = start_stream(port, 1000, temperature=1.0, seed=0, stream_options={"include_usage": True})
        proc.send_signal(signal.SIGINT)
        seen = []                                           # the first signal is handled: stopping
        while not (seen and "stopping" in seen[-1]):
            seen.append(proc.stderr.readline())
            assert seen[-1], f"ds2 serve ended before stopping: {seen}"
        # still listening while the request runs: to say so
        status, body, _ = request(port, "GET", "/health")
        assert status == 503 and body["status"] == "shutting down" and body["requests_running"] == 1
        status, body, _ = request(port, "POST", "/v1/completions", {"prompt": "hi"})
        assert status == 503 and body["error"]["code"] == "shutting_down"
        proc.send_signal(signal.SIGINT)
        events = [e for e in ("data: " + r.read().decode()).split("\n\n") if e]   # ends, not cut
        assert proc.wait(60) == 0
        log = "".join(seen) + proc.stderr.read()
    assert events[-1] == "data: [DONE]"
    final, usage = json.loads(events[-3][6:]), json.loads(events[-2][6:])["usage"]
    assert final["choices"][0]["finish_reason"] == "length" and usage["completion_tokens"] < 1000
    assert re.search(r'"POST /v1/completions" 200 \| prompt \d+ tok, 0 cached \| gen \d+ tok, [\d.]+ tok/s \| aborted',
                     unpacked(log)), log
    assert "client gone" not in log and "stopped" in log and "Traceback" not in log


@pytest.mark.slow
def test_a_second_sigint_after_the_last_request_still_exits_0():
    # later signals land while the server shuts down (nothing left to cut): still a clean stop
    with serve_process("--quantize", "8") as (proc, port):
        start_stream(port, 5).read()
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:   # Ctrl-C, again and again
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
        assert proc.wait(1) == 0
        log = proc.stderr.read()
    assert "stopped" in log and "Traceback" not in log


@pytest.mark.slow
def test_stopping_answers_503_until_the_running_request_ends_then_closes(model):
    server, state, lines = make_server(model, api_key=None)
    port, stop = server.server_address[1], threading.Event()
    stopping = threading.Thread(target=serve_module.serve_until, args=(server, state, stop))
    stopping.start()
    with holding(state.scheduler):      # the test holds the scheduler, as a running request would
        stop.set()
        assert logged(lines, "ds2 serve: stopping")
        status, body, r = request(port, "GET", "/health")
        assert status == 503 and body["status"] == "shutting down" and r.getheader("Connection") == "close"
        for path in ("/v1/completions", "/v1/chat/completions"):
            body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
            status, body, _ = request(port, "POST", path, body)
            assert status == 503 and body["error"]["code"] == "shutting_down"
        assert request(port, "GET", "/v1/models")[0] == 200
        assert stopping.is_alive()
    stopping.join(10)
    assert not stopping.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)


def test_abort_ends_a_stream_with_its_final_chunk_and_done(model):
    with running(model, api_key=None) as (port, state, lines):
        r = start_stream(port, 1000, temperature=0, stream_options={"include_usage": True})
        state.scheduler.abort()
        events = [e[6:] for e in ("data: " + r.read().decode()).split("\n\n") if e]
        assert events[-1] == "[DONE]"
        final, usage = json.loads(events[-3]), json.loads(events[-2])["usage"]
        assert final["choices"][0]["finish_reason"] == "length" and 0 < usage["completion_tokens"] < 1000
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
        ids = model.tokenizer.encode(ROMEO)
        assert fresh_greedy(model, ids, usage["completion_tokens"], chat=False)[0].startswith(text)
        assert logged(lines, f"gen {usage['completion_tokens']} tok")
        assert re.search(r"\| aborted \| [\d.]+s$", lines[-1]) and "client gone" not in lines[-1]


def test_abort_answers_a_whole_request_with_its_text_so_far(model):
    with running(model, api_key=None) as (port, state, lines):
        answers = []
        asking = threading.Thread(target=lambda: answers.append(request(
            port, "POST", "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 1000,
             "temperature": 1.0, "seed": 0})))
        asking.start()
        while state.scheduler.running() == 0 and asking.is_alive():
            time.sleep(0.01)
        state.scheduler.abort()
        asking.join(30)
        status, body, _ = answers[0]
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] < 1000 and isinstance(body["choices"][0]["message"]["content"], str)
        assert logged(lines, "| aborted") and not any("client gone" in line for line in lines)


# ---- the prompt cache on its own ----
def test_prompt_cache_hands_over_full_matches_and_copies_partial_ones(model):
    nbytes = model.new_cache(64).nbytes
    pool = PromptCache(lambda: model.new_cache(64), nbytes, 3 * nbytes)
    assert pool.slots == 3
    a = model.tokenizer.encode("System prompt. Question one")
    b = model.tokenizer.encode("System prompt. Question two")
    cache, keep = pool.take(a)
    assert keep == 0
    model.forward(a, cache)
    pool.put(a, cache)
    # a partial match is copied from (the entry stays for its own conversation) ...
    cache_b, keep = pool.take(b)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert keep == shared and cache_b is not cache and len(pool.entries) == 1
    logits = model.forward(b[keep:], cache_b)
    reference = model.new_cache(64)             # the same computation, on the entry's own cache
    model.forward(a, reference)
    reference.truncate(keep)
    np.testing.assert_array_equal(logits, model.forward(b[keep:], reference))
    np.testing.assert_allclose(logits, model.forward(b, model.new_cache(64)), atol=1e-4)  # split prefill
    pool.put(b, cache_b)
    # ... a full match is handed over
    cache_a, keep = pool.take(a + [5])
    assert cache_a is cache and keep == len(a) and len(pool.entries) == 1
    pool.put(a + [5], cache_a)
    assert pool.cached_tokens == len(a) + len(b)


def test_common_prefix():
    a = np.array([1, 2, 3, 4])
    for b, n in (([1, 2, 3, 4], 4), ([1, 2, 9, 4], 2), ([9], 0), ([1, 2], 2), ([1, 2, 3, 4, 5], 4), ([], 0)):
        assert common_prefix(a, np.array(b, dtype=np.int64)) == n


def test_prompt_cache_budget_evicts_least_recently_used_and_zero_keeps_nothing(model):
    nbytes = model.new_cache(16).nbytes
    pool = PromptCache(lambda: model.new_cache(16), nbytes, 2 * nbytes + 1)
    for prompt in ([3, 4, 5], [6, 7, 8], [9, 10, 11]):
        cache, _ = pool.take(prompt)
        model.forward(prompt, cache)
        pool.put(prompt, cache)
    assert [e.ids.tolist() for e in pool.entries] == [[6, 7, 8], [9, 10, 11]]
    # with one slot, a partial match cannot be copied: the entry is handed over and cut
    one = PromptCache(lambda: model.new_cache(16), nbytes, nbytes)
    cache, _ = one.take([3, 4, 5, 6])
    model.forward([3, 4, 5, 6], cache)
    one.put([3, 4, 5, 6], cache)
    again, keep = one.take([3, 4, 9])
    assert again is cache and keep == 2 and again.length == 2 and one.entries == []
    none = PromptCache(lambda: model.new_cache(16), nbytes, nbytes - 1)
    cache, _ = none.take([3, 4])
    none.put([3, 4], cache)
    assert none.slots == 0 and none.entries == [] and none.take([3, 4])[1] == 0


def test_serve_refuses_a_port_in_use_with_one_error_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = CliRunner().invoke(main, ["serve", "--port", str(taken.getsockname()[1])])
    assert r.exit_code == 1 and r.stdout == ""
    assert re.fullmatch(r"error: cannot listen on 127\.0\.0\.1:\d+: .+\n", r.stderr)
