"""Fill-in-the-middle through ds2 serve: llama-server's POST /infill and OpenAI's `suffix` on
/v1/completions, on a small random model around DeepSeek's V2.5 tokenizer (its FIM tokens), raw
HTTP and the openai client, streamed and not; ds2-tiny, which has no FIM tokens, gets a 400
naming them; input_extra's limits are 400s before anything is tokenized."""

import http.client
import json

import pytest

import ds2cli
from ds2cli.generation.generate import stream_generate
from ds2cli.generation.sampling import SamplingParams, make_sampler
from ds2cli.text import fim
from support.coder_like import write_coder_like
from test_serve import KEY, client, request, running

pytestmark = pytest.mark.slow      # servers in threads, a model written and loaded

PREFIX, SUFFIX = "def area(r):\n    ", "\n    return a\n"
FILES = [{"filename": "geometry/consts.py", "text": "PI = 3.14159\n"}, {"filename": "units.py", "text": "M = 1"}]
N = 6


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    return ds2cli.load(str(write_coder_like(tmp_path_factory.mktemp("coder-like"))))


@pytest.fixture(scope="module")
def server(coder):
    with running(coder) as s:
        yield s


@pytest.fixture(scope="module")
def tiny_server():
    with running(ds2cli.load()) as s:
        yield s


def greedy(model, ids, n=N):
    """What ds2's generation loop writes for these ids alone (greedy, eos and the FIM tokens end it)."""
    ends = (*model.eos_token_ids, *fim.FimTokens.of(model.tokenizer).ends)
    chunks = list(stream_generate(model, ids, model.new_cache(len(ids) + n), make_sampler(SamplingParams(temperature=0)),
                                  n, eos_ids=ends))
    return "".join(c.text for c in chunks), chunks[-1]


def events(port, path, body):
    """A streamed answer's `data:` payloads, in order, as text."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
    out = [line[len("data: "):] for line in r.read().decode().split("\n") if line.startswith("data: ")]
    conn.close()
    return out


# ---- /infill ----
def test_infill_answers_in_llama_server_s_shape_with_the_documented_prompt(server, coder):
    port, _, _ = server
    tok = coder.tokenizer
    status, got, _ = request(port, "POST", "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX,
                                                       "n_predict": N, "temperature": 0})
    assert status == 200
    ids = fim.fim_ids(tok, fim.FimTokens.of(tok), PREFIX, SUFFIX)
    text, last = greedy(coder, ids)
    assert got["content"] == text and got["stop"] is True and got["tokens_predicted"] == last.generated_tokens
    assert got["prompt"] == f"<｜begin▁of▁sentence｜><｜fim▁begin｜>{PREFIX}<｜fim▁hole｜>{SUFFIX}<｜fim▁end｜>"
    assert got["tokens_evaluated"] == len(ids) and got["model"] == "ds2-tiny"
    assert got["stop_type"] == ("limit" if last.finish_reason == "length" else "eos")
    assert set(got["timings"]) == {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                                   "predicted_per_second"}
    assert got["timings"]["predicted_n"] == got["tokens_predicted"]


def test_infill_places_the_repository_files_and_the_prompt_as_documented(server, coder):
    port, _, _ = server
    status, got, _ = request(port, "POST", "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX,
                                                       "input_extra": FILES, "prompt": "a = ", "n_predict": 2})
    assert status == 200
    context = "# geometry/consts.py\nPI = 3.14159\n\n\n# units.py\nM = 1\n\n\n"
    assert got["prompt"] == (f"<｜begin▁of▁sentence｜><｜fim▁begin｜>{context}{PREFIX}a = <｜fim▁hole｜>{SUFFIX}"
                             f"<｜fim▁end｜>")
    tok = coder.tokenizer
    files = [(f["filename"], f["text"]) for f in FILES]
    assert got["tokens_evaluated"] == len(fim.fim_ids(tok, fim.FimTokens.of(tok), PREFIX + "a = ", SUFFIX, files))


def test_infill_streams_llama_server_events_without_done(server):
    port, _, _ = server
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": N, "temperature": 0}
    _, whole, _ = request(port, "POST", "/infill", body)
    data = events(port, "/infill", {**body, "stream": True})
    assert "[DONE]" not in data
    objs = [json.loads(d) for d in data]
    assert all(o["stop"] is False and set(o) == {"content", "stop"} for o in objs[:-1])
    assert objs[-1]["stop"] is True and objs[-1]["content"] == ""
    assert "".join(o["content"] for o in objs) == whole["content"]
    assert objs[-1]["tokens_predicted"] == whole["tokens_predicted"] and objs[-1]["prompt"] == whole["prompt"]


@pytest.mark.parametrize("token", ["<｜fim▁end｜>", "<｜fim▁hole｜>", "<｜end▁of▁sentence｜>"])
def test_a_fill_ends_at_a_fim_token_or_eos_which_is_not_written(server, coder, token):
    port, _, _ = server
    token_id = coder.tokenizer.added_token_id(token)
    status, got, _ = request(port, "POST", "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": N,
                                                       "logit_bias": {str(token_id): 100}})
    assert status == 200 and got["content"] == "" and got["stop_type"] == "eos" and got["tokens_predicted"] == 1
    status, got, _ = request(port, "POST", "/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": N,
                                                               "logit_bias": {str(token_id): 100}})
    assert status == 200 and got["choices"][0]["text"] == "" and got["choices"][0]["finish_reason"] == "stop"


def test_a_plain_completion_does_not_end_at_fim_tokens(server, coder):
    port, _, _ = server
    end = coder.tokenizer.added_token_id("<｜fim▁end｜>")
    status, got, _ = request(port, "POST", "/v1/completions", {"prompt": PREFIX, "max_tokens": 3,
                                                               "logit_bias": {str(end): 100}})
    assert status == 200 and got["choices"][0]["text"] == "<｜fim▁end｜>" * 3
    assert got["choices"][0]["finish_reason"] == "length"


# ---- suffix on /v1/completions ----
def test_suffix_through_the_openai_client_fills_the_same_middle(server, coder):
    port, _, _ = server
    c = client(port)
    _, infill, _ = request(port, "POST", "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX,
                                                     "n_predict": N, "temperature": 0})
    r = c.completions.create(model="x", prompt=PREFIX, suffix=SUFFIX, max_tokens=N, temperature=0)
    assert r.choices[0].text == infill["content"]
    assert r.usage.prompt_tokens == infill["tokens_evaluated"]
    assert r.usage.completion_tokens == infill["tokens_predicted"]
    streamed = c.completions.create(model="x", prompt=PREFIX, suffix=SUFFIX, max_tokens=N, temperature=0, stream=True)
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces) == infill["content"]
    assert pieces[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_suffix_fills_each_prompt_of_a_list(server, coder):
    port, _, _ = server
    r = client(port).completions.create(model="x", prompt=[PREFIX, "x = "], suffix=SUFFIX, max_tokens=3, temperature=0)
    tok = coder.tokenizer
    for choice, prefix in zip(sorted(r.choices, key=lambda c: c.index), [PREFIX, "x = "]):
        assert choice.text == greedy(coder, fim.fim_ids(tok, fim.FimTokens.of(tok), prefix, SUFFIX), 3)[0]


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": [1, 2, 3], "suffix": "x"}, "prompt", "with suffix, prompt must be a string or a list of strings"),
    ({"prompt": "a", "suffix": 5}, "suffix", "suffix must be a string"),
    ({"prompt": "a", "suffix": "b", "echo": True}, "echo", "echo cannot be combined with suffix"),
])
def test_bad_suffix_requests_get_a_400(server, body, param, message):
    status, got, _ = request(server[0], "POST", "/v1/completions", body)
    assert status == 400 and got["error"]["param"] == param and message in got["error"]["message"]


# ---- a model without FIM tokens ----
MISSING = "<｜fim▁begin｜>, <｜fim▁hole｜>, <｜fim▁end｜> missing"


def test_a_model_without_fim_tokens_gets_a_400_naming_them(tiny_server):
    port, _, _ = tiny_server
    for path, body, param in (("/infill", {"input_prefix": "a", "input_suffix": "b"}, "input_prefix"),
                              ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix")):
        status, got, _ = request(port, "POST", path, body)
        assert status == 400 and MISSING in got["error"]["message"], got
        assert got["error"]["param"] == param and got["error"]["code"] == "fim_unsupported"
    with pytest.raises(Exception) as e:
        client(port).completions.create(model="x", prompt="a", suffix="b", max_tokens=2)
    assert getattr(e.value, "status_code", None) == 400 and MISSING in str(e.value)


# ---- input_extra's limits and shape ----
@pytest.mark.parametrize("extra,message", [
    ([{"filename": "a.py", "text": ""}] * (fim.MAX_FILES + 1), f"more than the limit of {fim.MAX_FILES}"),
    ([{"filename": "a.py", "text": "x" * (fim.MAX_FILE_BYTES // 2)}] * 3, f"limit of {fim.MAX_FILE_BYTES} bytes"),
    ([{"filename": "a\nb.py", "text": "x"}], "path must be one line"),
    ([{"filename": "a.py"}], "input_extra[0] must be an object with a string \"text\""),
    ([{"filename": 3, "text": "x"}], "input_extra[0] must be an object"),
    ({"filename": "a.py", "text": "x"}, "input_extra must be a list"),
])
def test_input_extra_out_of_bounds_or_shape_gets_a_400(server, extra, message):
    status, got, _ = request(server[0], "POST", "/infill", {"input_prefix": "a", "input_suffix": "b",
                                                            "input_extra": extra})
    assert status == 400 and got["error"]["param"] == "input_extra" and message in got["error"]["message"], got


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": "a"}, "input_prefix", "needs input_prefix and input_suffix"),
    ({"input_prefix": 1, "input_suffix": "b"}, "input_prefix", "input_prefix must be a string"),
    ({"input_prefix": "a", "input_suffix": "b", "n": 2}, "n", "one prompt and n = 1"),
    ({"input_prefix": "a", "input_suffix": "b", "logprobs": 2}, "logprobs", "not supported by /infill"),
])
def test_bad_infill_requests_get_a_400(server, body, param, message):
    status, got, _ = request(server[0], "POST", "/infill", body)
    assert status == 400 and got["error"]["param"] == param and message in got["error"]["message"], got


def test_a_fill_longer_than_the_context_is_refused_before_it_is_tokenized(server):
    status, got, _ = request(server[0], "POST", "/infill", {"input_prefix": "a " * 3000, "input_suffix": "b"})
    assert status == 400 and got["error"]["code"] == "context_length_exceeded"
