"""ds2 serve at its edges: a browser SDK's preflight, the favicon, typed counts in /health, `n`
beyond what the server can ever hold, protocol errors that get an answer, and a listen backlog
sized for a burst."""

import http.client
import socket

import pytest

import ds2cli
from ds2cli.server import http_server
from test_serve import make_server, request, running

# what the official openai JavaScript SDK sends from a browser (v4/v5), lower-cased by the browser
SDK_HEADERS = ("authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,"
               "x-stainless-package-version,x-stainless-retry-count,x-stainless-runtime,"
               "x-stainless-runtime-version,x-stainless-timeout")


@pytest.fixture(scope="module")
def model():
    return ds2cli.load()


@pytest.fixture(scope="module")
def server(model):
    with running(model, cors_origins=("http://app.example",), max_queue=3, parallel=2) as s:
        yield s


def test_a_preflight_allows_the_headers_the_sdk_asks_for(server):
    port = server[0]
    status, _, r = request(port, "OPTIONS", "/v1/chat/completions",
                           headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                                    "Access-Control-Request-Headers": SDK_HEADERS})
    allowed = {h.strip().lower() for h in r.getheader("Access-Control-Allow-Headers").split(",")}
    assert status == 204 and set(SDK_HEADERS.split(",")) <= allowed
    assert r.getheader("Access-Control-Allow-Origin") == "http://app.example"


def test_a_preflight_echoes_only_header_names(server):
    status, _, r = request(server[0], "OPTIONS", "/v1/chat/completions",
                           headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                                    "Access-Control-Request-Headers": "x-ok, bad header, x\u00e9".encode().decode("latin-1")})
    allowed = r.getheader("Access-Control-Allow-Headers").lower()
    assert status == 204 and "x-ok" in allowed and "bad header" not in allowed


def test_an_origin_not_allowed_gets_no_cors_headers(server):
    status, _, r = request(server[0], "OPTIONS", "/v1/chat/completions",
                           headers={"Origin": "http://evil.example", "Access-Control-Request-Headers": "x-a"})
    assert r.getheader("Access-Control-Allow-Headers") is None and r.getheader("Access-Control-Allow-Origin") is None


def test_the_favicon_is_a_png_without_a_key(server):
    conn = http.client.HTTPConnection("127.0.0.1", server[0], timeout=30)
    conn.request("GET", "/favicon.ico")                  # no Authorization header
    r = conn.getresponse()
    body = r.read()
    conn.close()
    assert r.status == 200 and r.getheader("Content-Type") == "image/png"
    assert body.startswith(b"\x89PNG\r\n\x1a\n") and len(body) < 1024


def test_health_counts_are_typed(server):
    status, body, _ = request(server[0], "GET", "/health")
    assert status == 200 and body["requests_running"] == 0 and body["requests_waiting"] == 0
    assert "running" not in body and "waiting" not in body       # one pair of counts, the documented one
    assert (body["slots"], body["queue"]) == (2, 3)


def test_n_beyond_what_the_server_can_ever_hold_is_a_400_naming_n(server):
    status, body, r = request(server[0], "POST", "/v1/completions",
                              {"prompt": "hi", "max_tokens": 1, "n": 6})
    assert status == 400 and body["error"]["param"] == "n" and "--parallel" in body["error"]["message"]
    assert body["error"]["message"].startswith("n = 6 is more than this server can ever hold") and "best_of" not in body["error"]["message"]
    assert r.getheader("Retry-After") is None
    status, body, _ = request(server[0], "POST", "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 1, "n": 2})
    assert status == 400 and body["error"]["message"].startswith("3 prompts x n = 2 is 6 choices, more than")
    status, body, _ = request(server[0], "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 5})
    assert status == 200 and len(body["choices"]) == 5


@pytest.mark.parametrize("raw, status", [
    (b"\x16\x03\x01 garbage\r\n\r\n", 400),
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(120)) + b"\r\n", 431),
    (b"GET /health HTTP/1.1\r\nX-Long: " + b"a" * 100_000 + b"\r\n\r\n", 431),
], ids=["garbage_line", "long_uri", "many_headers", "long_header"])
def test_protocol_errors_get_an_answer(server, raw, status):
    with socket.create_connection(("127.0.0.1", server[0]), timeout=30) as s:
        s.sendall(raw)
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.") and answer.split()[1] == str(status).encode(), answer[:200]
    assert not any("has no attribute" in line for line in server[2])


@pytest.mark.parametrize("queue, parallel, wanted", [(300, 1, 301), (4, 1, 128)])
def test_the_backlog_has_room_for_every_request_the_server_holds(model, queue, parallel, wanted):
    """socketserver's 5 reset a burst of clients; the backlog is max(128, --queue + --parallel),
    capped by the kernel's somaxconn (which listen() would apply silently)."""
    server, *_ = make_server(model, max_queue=queue, parallel=parallel)
    try:
        assert server.request_queue_size == min(wanted, http_server.somaxconn())
    finally:
        server.server_close()


def test_echo_keeps_the_entry_of_a_generated_eos(server, model):
    """lm-eval scores a continuation with echo and max_tokens 1, taking the last entry for the
    generated token: when that token is eos (forced here by logit_bias) its entry must be there,
    or lm-eval drops a prompt token's logprob instead."""
    eos = model.eos_token_ids[0]
    prompt = model.tokenizer.encode("ROMEO: what light")
    status, body, _ = request(server[0], "POST", "/v1/completions",
                              {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1,
                               "temperature": 0, "logit_bias": {str(eos): 100}})
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop"
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt) + 1
    # the raw log-softmax, before logit_bias (as every entry): the model's own view of eos here
    assert lp["token_logprobs"][0] is None and -50 < lp["token_logprobs"][-1] < 0
    assert lp["tokens"][-1] == model.tokenizer.decode([eos])


def test_while_the_model_loads_health_says_so_and_the_api_asks_to_retry(model):
    """The port is bound before the model loads: meanwhile /health is 503 "loading" and the API
    503 with Retry-After; once the scheduler is in place both answer."""
    with running(model) as (port, state, _):
        scheduler, defaults = state.scheduler, state.defaults
        state.scheduler = state.defaults = None
        status, body, r = request(port, "GET", "/health")
        assert status == 503 and body["status"] == "loading" and r.getheader("Retry-After") == "1"
        status, body, r = request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 503 and body["error"]["code"] == "loading" and r.getheader("Retry-After") == "1"
        status, _, r = request(port, "GET", "/v1/models")
        assert status == 503
        state.defaults, state.scheduler = defaults, scheduler
        assert request(port, "GET", "/health")[0] == 200


def test_a_taken_port_is_an_error_before_any_weight_loads(no_loading):
    from click.testing import CliRunner
    from ds2cli.cli.main import main
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        r = CliRunner().invoke(main, ["serve", "--port", str(taken.getsockname()[1])])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: cannot listen on 127.0.0.1:")


@pytest.mark.parametrize("body, param", [
    (b'{"model": "x", "messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages"),
    (b'{"model": "x", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
     b'"function": {"name": "f\\udfff", "parameters": {}}}]}', "tools"),
    (b'{"model": "x", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud83d"]}', "stop"),
], ids=["content", "tool_name", "stop"])
def test_lone_surrogates_anywhere_are_a_400_naming_the_param(server, body, param):
    status, answer, _ = request(server[0], "POST", "/v1/chat/completions", raw=body,
                                headers={"Content-Type": "application/json"})
    assert status == 400 and answer["error"]["param"] == param and "surrogate" in answer["error"]["message"]
