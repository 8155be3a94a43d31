"""ds2 serve's smaller endpoints and fields, on ds2-tiny: /tokenize, /detokenize, /tokenizer_info,
logit_bias, continue_final_message, CORS, /metrics and the chat page's route."""

import http.client
import json
from pathlib import Path

import pytest

import ds2cli
from ds2cli.server.jobs import render_continuation
from ds2cli.text.tokenizer import Tokenizer
from test_serve import KEY, client, request, running

QUESTION = [{"role": "user", "content": "What is 451 - 123?"}]
TOKENIZERS = Path(__file__).parents[1] / "data" / "tokenizers"   # DeepSeek's own files, copied from ../shared


@pytest.fixture(scope="module")
def model():
    return ds2cli.load()


@pytest.fixture(scope="module")
def server(model):
    with running(model, cors_origins=("http://page.example",)) as s:
        yield s


def raw(port, method, path, body=None, headers=None):
    """(status, headers, body bytes) of one request, with exactly the headers given."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers or {})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, data


# ---- tokenizer endpoints ----
def test_tokenize_and_detokenize_in_llama_server_and_vllm_shapes(server, model):
    port, _, _ = server
    tok = model.tokenizer
    text = "Hello world, naïve ☃"
    status, got, _ = request(port, "POST", "/tokenize", {"content": text})
    assert status == 200 and got["tokens"] == tok.encode(text, add_special_tokens=False)   # llama-server: no bos
    status, vllm, _ = request(port, "POST", "/tokenize", {"prompt": text, "return_token_strs": True})
    assert vllm["tokens"] == tok.encode(text) and vllm["count"] == len(vllm["tokens"])     # vLLM: with bos
    assert vllm["max_model_len"] == 1024 and len(vllm["token_strs"]) == vllm["count"]
    _, pieces, _ = request(port, "POST", "/tokenize", {"content": text, "with_pieces": True, "add_special": True})
    assert [p["id"] for p in pieces["tokens"]] == tok.encode(text)
    assert b"".join(tok.token_bytes(p["id"]) for p in pieces["tokens"][1:]) == text.encode()
    _, chat, _ = request(port, "POST", "/tokenize", {"messages": QUESTION})
    assert chat["tokens"] == tok.encode_chat(QUESTION)
    status, back, _ = request(port, "POST", "/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and back["content"] == back["prompt"] == text


def test_tokenizer_info_answers_as_vllm_does(server, model):
    port, _, _ = server
    status, info, _ = request(port, "GET", "/tokenizer_info")
    config = json.loads((model.path / "tokenizer_config.json").read_text())
    assert status == 200 and info["tokenizer_class"] == config["tokenizer_class"]
    assert info["bos_token"] == model.tokenizer.bos_token and info["eos_token"] == model.tokenizer.eos_token
    assert info["chat_template"] == model.tokenizer.chat_template and info["model_max_length"] == 1024


@pytest.mark.parametrize("path,body,param,message", [
    ("/tokenize", {"content": 5}, "content", "give the text to tokenize"),
    ("/tokenize", {}, "prompt", "give the text to tokenize"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces", "with_pieces must be true or false"),
    ("/detokenize", {"tokens": "1 2"}, "tokens", "tokens must be a list of token ids"),
    ("/detokenize", {"tokens": [1, 4096]}, "tokens", "token ids must be in [0, 4096)"),
])
def test_tokenizer_endpoints_refuse_bad_input(server, path, body, param, message):
    status, payload, _ = request(server[0], "POST", path, body)
    assert status == 400 and payload["error"]["param"] == param and message in payload["error"]["message"]


# ---- logit_bias ----
def test_logit_bias_bans_and_forces_tokens(server, model):
    port, _, _ = server
    c = client(port)
    ask = dict(model="x", prompt="ROMEO:\n", max_tokens=8, temperature=0)
    plain = c.completions.create(**ask).choices[0].text
    first = model.tokenizer.encode(plain, add_special_tokens=False)[0]
    banned = c.completions.create(logit_bias={str(first): -100}, **ask).choices[0].text
    assert model.tokenizer.encode(banned, add_special_tokens=False)[0] != first
    forced_id = model.tokenizer.encode(" Verona", add_special_tokens=False)[0]
    forced = c.completions.create(logit_bias={str(forced_id): 100}, **{**ask, "max_tokens": 3}).choices[0]
    assert forced.text == model.tokenizer.decode([forced_id] * 3)
    hot = c.completions.create(logit_bias={str(forced_id): 100}, seed=5, **{**ask, "temperature": 1.0,
                                                                           "max_tokens": 3}).choices[0]
    assert hot.text == forced.text     # +100 makes every other token's probability negligible


@pytest.mark.parametrize("bias,message", [
    ({"4096": 1}, "is not a token id in [0, 4096)"), ({"-1": 1}, "is not a token id"),
    ({"x": 1}, "is not a token id"), ({"5": 101}, "must be a number in [-100, 100]"),
    ({"5": "1"}, "must be a number in [-100, 100]"), ({"5": True}, "must be a number"),
    ([5], "logit_bias must be an object"),
])
def test_bad_logit_bias_gets_a_400(server, bias, message):
    for path, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": QUESTION})):
        status, payload, _ = request(server[0], "POST", path, {**base, "logit_bias": bias})
        assert status == 400 and payload["error"]["param"] == "logit_bias" and message in payload["error"]["message"]


# ---- continue_final_message ----
@pytest.mark.slow
def test_continue_final_message_continues_the_assistant_s_text(server, model):
    port, _, _ = server
    c = client(port)
    whole = c.chat.completions.create(model="x", messages=QUESTION, temperature=0).choices[0].message.content
    head = whole[:9]
    messages = QUESTION + [{"role": "assistant", "content": head}]
    for extra in ({"continue_final_message": True}, {"add_generation_prompt": False}):
        r = c.chat.completions.create(model="x", messages=messages, temperature=0, extra_body=extra)
        assert head + r.choices[0].message.content == whole, extra
    new_turn = c.chat.completions.create(model="x", messages=messages, temperature=0).choices[0].message.content
    assert not (head + new_turn).startswith(whole)      # without either, a new turn follows the message


TEMPLATES = [("ds2-tiny", None), ("deepseek-v2", TOKENIZERS / "deepseek-v2"),
             ("deepseek-v2.5", TOKENIZERS / "deepseek-v2.5")]


@pytest.mark.parametrize("name,path", TEMPLATES, ids=[t[0] for t in TEMPLATES])
def test_a_continued_prompt_is_the_rendered_conversation_without_the_message_s_end(model, name, path):
    tok = model.tokenizer if path is None else Tokenizer.load(path)
    for content in ("451 - 123 =", ""):
        messages = [{"role": "system", "content": "Be brief."}, *QUESTION, {"role": "assistant", "content": content}]
        prompt = render_continuation(tok, messages)
        closed = tok.render_chat(messages, add_generation_prompt=False)
        assert prompt.endswith(content) and closed.startswith(prompt)
        assert closed[len(prompt):] == tok.eos_token       # DeepSeek templates end a reply with eos
        opened = tok.render_chat(messages[:-1], add_generation_prompt=True)
        assert prompt.startswith(opened.rstrip())


@pytest.mark.parametrize("fields,messages,message", [
    ({"continue_final_message": True}, QUESTION, "needs the last message to be the assistant's"),
    ({"continue_final_message": True, "add_generation_prompt": True},
     QUESTION + [{"role": "assistant", "content": "4"}], "cannot both be true"),
    ({"continue_final_message": 1}, QUESTION, "continue_final_message must be true or false"),
    ({"add_generation_prompt": "no"}, QUESTION, "add_generation_prompt must be true or false"),
])
def test_bad_continuation_fields_get_a_400(server, fields, messages, message):
    status, payload, _ = request(server[0], "POST", "/v1/chat/completions", {"messages": messages, **fields})
    assert status == 400 and message in payload["error"]["message"]
    assert payload["error"]["param"] in ("continue_final_message", "add_generation_prompt")


# ---- CORS ----
ORIGIN = {"Origin": "http://page.example"}


def test_preflight_is_answered_without_the_key_for_a_listed_origin(server):
    port, _, _ = server
    status, headers, body = raw(port, "OPTIONS", "/v1/chat/completions",
                                headers={**ORIGIN, "Access-Control-Request-Method": "POST",
                                         "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 204 and body == b""
    assert headers["access-control-allow-origin"] == "http://page.example"
    assert {"authorization", "content-type"} <= {h.strip().lower() for h in
                                                headers["access-control-allow-headers"].split(",")}
    assert "POST" in headers["access-control-allow-methods"]
    status, headers, _ = raw(port, "OPTIONS", "/v1/chat/completions", headers={"Origin": "http://other.example"})
    assert status == 405 and "access-control-allow-origin" not in headers


def test_every_answer_to_a_listed_origin_carries_the_cors_header(server):
    port, _, _ = server
    auth = {"Authorization": f"Bearer {KEY}", **ORIGIN}
    answers = [raw(port, "GET", "/v1/models", headers=auth),
               raw(port, "GET", "/v1/models", headers=ORIGIN),                       # 401
               raw(port, "POST", "/v1/completions", {"prompt": "hi", "top_p": 5}, auth),   # 400
               raw(port, "GET", "/nowhere", headers=auth),                           # 404
               raw(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}, auth)]
    assert [a[0] for a in answers] == [200, 401, 400, 404, 200]
    assert answers[-1][1]["content-type"] == "text/event-stream"
    assert all(a[1]["access-control-allow-origin"] == "http://page.example" for a in answers)
    assert "access-control-allow-origin" not in raw(port, "GET", "/v1/models", headers={
        "Authorization": f"Bearer {KEY}", "Origin": "http://other.example"})[1]


def test_cors_is_off_by_default_and_star_allows_any_origin(model):
    with running(model) as (port, _, _):
        status, headers, _ = raw(port, "OPTIONS", "/v1/models", headers=ORIGIN)
        assert status == 405 and "access-control-allow-origin" not in headers
    with running(model, cors_origins=("*",)) as (port, _, _):
        status, headers, _ = raw(port, "OPTIONS", "/v1/models", headers={"Origin": "http://any.example"})
        assert status == 204 and headers["access-control-allow-origin"] == "*"


# ---- /metrics and / ----
def test_metrics_count_requests_and_tokens_behind_the_key(model):
    with running(model) as (port, _, _):
        assert raw(port, "GET", "/metrics")[0] == 401
        c = client(port)
        c.chat.completions.create(model="x", messages=QUESTION, temperature=0, max_tokens=5)
        c.chat.completions.create(model="x", messages=QUESTION, temperature=0, max_tokens=5)
        status, headers, body = raw(port, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                  for line in body.decode().splitlines() if line and not line.startswith("#")}
        prompt = len(model.tokenizer.encode_chat(QUESTION))
        assert values['ds2_requests_total{endpoint="/v1/chat/completions",code="200"}'] == 2
        assert values['ds2_requests_total{endpoint="/metrics",code="401"}'] == 1
        assert values["ds2_prompt_tokens_total"] == 2 * prompt and values["ds2_generation_tokens_total"] == 10
        assert values["ds2_prompt_cache_hits_total"] == 1 and values["ds2_prompt_cache_cached_tokens_total"] == prompt - 1
        assert values["ds2_requests_running"] == 0 and values["ds2_requests_waiting"] == 0
        assert values["ds2_decode_seconds_total"] > 0 and values["ds2_last_decode_tokens_per_second"] > 0


def test_a_request_is_counted_before_its_answer_arrives(model, monkeypatch):
    """A client that reads an answer and at once asks /metrics finds that request counted, even
    when the thread that answered is held up right after its last write (as a busy machine may
    hold it): the count goes in as the answer goes out, not after."""
    import time
    from ds2cli.server.http_server import Handler
    sent = Handler.send_body

    def held_up(self, *args):
        sent(self, *args)
        if self.path == "/tokenizer_info":
            time.sleep(0.5)

    monkeypatch.setattr(Handler, "send_body", held_up)
    with running(model) as (port, _, _):
        assert raw(port, "GET", "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
        status, _, body = raw(port, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200
        assert 'ds2_requests_total{endpoint="/tokenizer_info",code="200"} 1' in body.decode().splitlines()


def test_the_chat_page_is_served_without_the_key(server):
    status, headers, body = raw(server[0], "GET", "/")
    assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
    assert b"<html" in body.lower() and b"/v1/chat/completions" in body
    assert b"http://" not in body and b"https://" not in body       # no CDN: nothing loads from elsewhere
