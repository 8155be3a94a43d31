"""logprobs, top_logprobs and echo in ds2 serve, on ds2-tiny: every figure is checked against a
float64 log-softmax of ds2's own forward pass (as examples/score.py computes it), within a
float32 rounding bound, and lm-eval's loglikelihood requests are replayed as it sends them."""

import numpy as np
import pytest

from ds2cli.generation import logprobs as lp_module
from ds2cli.generation.generate import Generation, stream_generate
from ds2cli.generation.logprobs import TextOffsets, TokenLogprobs, entry
from ds2cli.generation.sampling import SamplingParams, make_sampler
from test_serve import client, request, running, sse

TOL = 2e-4          # float32 logits through different BLAS call shapes, then float64 log-softmax
QUESTION = [{"role": "user", "content": "What is 451 - 123?"}]


@pytest.fixture(scope="module")
def model():
    import ds2cli
    return ds2cli.load()


@pytest.fixture(scope="module")
def server(model):
    with running(model) as s:
        yield s


def direct(model, ids):
    """log p(ids[i] | ids[:i]) for i >= 1, and each position's arg max, from one forward pass."""
    logits = model.forward(ids, model.new_cache(len(ids)), all_logits=True).astype(np.float64)   # (T, V)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return logp                                                                                    # row i predicts ids[i+1]


# ---- the pieces ----
def test_entry_is_the_raw_log_softmax_with_the_top_ones_in_order(model):
    row = model.forward(model.tokenizer.encode("ROMEO:\n"), model.new_cache(16))
    e = entry(row, 7, 5)
    ref = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64) - row.max()).sum()) - row.max()
    assert abs(e.logprob - ref[7]) < 1e-9
    best = np.argsort(-ref, kind="stable")[:5]
    assert [t for t, _ in e.top] == list(best)
    assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
    assert np.isclose(np.exp(ref).sum(), 1.0)
    huge = np.array([1e30, 0.0, -1e30], dtype=np.float32)   # no overflow: the max is subtracted first
    assert entry(huge, 0, 1).logprob == 0.0 and entry(huge, 1, 0).logprob == -float(huge[0])


def score_prompt(model, ids, top_n, chunk):
    """A prompt's entries as the scheduler scores an echo prompt: a Generation whose prompt rows,
    `chunk` tokens a pass, are each reduced to the entry of the token they predict."""
    got, cache = [None], model.new_cache(len(ids))
    gen = Generation(model, ids, cache, make_sampler(SamplingParams(temperature=0)), 0,
                     prompt_rows=lambda rows, tokens: got.extend(entry(r, t, top_n) for r, t in zip(rows, tokens)),
                     prompt_rows_chunk=chunk)
    while not gen.done:
        gen.take(model.forward_batch([gen.step()])[0])
    return got, cache


def test_score_prompt_in_chunks_equals_one_forward_pass(model):
    ids = model.tokenizer.encode("To be, or not to be, that is the question: whether 'tis nobler in the mind")
    ref = direct(model, ids)
    for chunk in (1, 7, 256):
        got, cache = score_prompt(model, ids, 2, chunk)
        assert got[0] is None and len(got) == len(ids) and cache.length == len(ids)
        for i, e in enumerate(got[1:]):
            assert e.token == ids[i + 1] and abs(e.logprob - ref[i, ids[i + 1]]) < TOL


@pytest.mark.slow
def test_each_generated_token_gets_its_entry_once_in_order_through_stop_strings(model):
    """Stop strings hold text back, eos is not part of the reply: the entries still follow the
    generated tokens one for one, and each one's logprob is its row's."""
    ids = model.tokenizer.encode("ROMEO:\n")
    for stop in ([], ["\n\n"], ["e", "the"]):
        rows, sample = [], make_sampler(SamplingParams(temperature=1.0, seed=3))
        tracker = TokenLogprobs(3)

        def sampler(logits, history):
            token = sample(logits, history)
            rows.append(logits.copy())
            tracker.observe(logits, token)
            return token
        chunks = list(tracker.attach(stream_generate(model, ids, model.new_cache(128), sampler, 30, stop)))
        sent = [e for c in chunks for e in c.logprobs]
        generated = chunks[-1].tokens
        kept = generated[:-1] if chunks[-1].finish_reason == "eos" else generated
        assert [e.token for e in sent] == kept
        for e, row in zip(sent, rows):
            assert e.logprob == entry(row, e.token, 0).logprob


def test_text_offsets_count_characters_of_the_decoded_text(model):
    """A token's offset is the count of characters its predecessors' bytes complete: a token
    that is whole characters sits at its text, one that ends a character begun before it sits
    where that character starts."""
    tok = model.tokenizer
    text = "naïve café ☃ ok"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_bytes(t) for t in ids]
    assert tok.decode(ids) == text and b"".join(pieces) == text.encode()
    assert any(_partial(p) for p in pieces), "the text should split a character across tokens"
    offsets = TextOffsets(tok)
    got = [offsets.next(t) for t in ids]
    before = b""
    for piece, at in zip(pieces, got):
        done = text[:at].encode()
        assert before.startswith(done) and len(before) - len(done) <= 3     # only an unfinished character waits
        if not _partial(piece) and len(before) == len(done):
            assert text[at:at + len(piece.decode())] == piece.decode()
        before += piece


def _partial(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


# ---- chat ----
@pytest.mark.slow
def test_chat_logprobs_are_the_model_s_own_whole_and_streamed(server, model):
    port, _, _ = server
    c = client(port)
    r = c.chat.completions.create(model="x", messages=QUESTION, temperature=0, logprobs=True, top_logprobs=5,
                                  max_tokens=20)
    content = r.choices[0].logprobs.content
    tokens = [e.token for e in content]
    assert "".join(tokens).lstrip() == r.choices[0].message.content     # the reply's leading space is stripped
    prompt = model.tokenizer.encode_chat(QUESTION)
    ids = prompt + [int(i) for i in _generated_ids(model, prompt, len(content))]
    ref = direct(model, ids)
    for i, e in enumerate(content):
        row = ref[len(prompt) - 1 + i]
        assert abs(e.logprob - row[ids[len(prompt) + i]]) < TOL
        assert bytes(e.bytes) == model.tokenizer.token_bytes(ids[len(prompt) + i])
        assert len(e.top_logprobs) == 5 and e.top_logprobs[0].logprob == e.logprob   # greedy: the top one
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    streamed = [ch.choices[0].logprobs.content for ch in c.chat.completions.create(
        model="x", messages=QUESTION, temperature=0, logprobs=True, top_logprobs=5, max_tokens=20, stream=True)
        if ch.choices and ch.choices[0].logprobs is not None]
    flat = [e for part in streamed for e in part]
    assert [e.token for e in flat] == tokens
    assert max(abs(a.logprob - b.logprob) for a, b in zip(flat, content)) < TOL


def _generated_ids(model, prompt, n):
    chunks = list(stream_generate(model, prompt, model.new_cache(len(prompt) + n + 1),
                                  make_sampler(SamplingParams(temperature=0)), n))
    return chunks[-1].tokens[:n]


def test_logprobs_report_the_raw_distribution_whatever_the_sampling(server):
    """A penalty (or a bias) that changes the first token leaves its figures those of the raw row."""
    port, _, _ = server
    ask = dict(model="x", prompt="ROMEO:\n", max_tokens=6, logprobs=5, temperature=0)
    greedy = client(port).completions.create(**ask).choices[0].logprobs
    hot = client(port).completions.create(extra_body={"top_k": 1, "repetition_penalty": 1.3}, **ask).choices[0].logprobs
    assert hot.tokens[0] != greedy.tokens[0] and hot.tokens[0] in greedy.top_logprobs[0]
    assert abs(hot.token_logprobs[0] - greedy.top_logprobs[0][hot.tokens[0]]) < TOL
    assert hot.top_logprobs[0].keys() == greedy.top_logprobs[0].keys()


# ---- completions and echo: lm-eval's requests ----
def lm_eval_request(port, context, continuation, model, as_ids, max_tokens=1):
    """What lm-eval's local-completions sends for one loglikelihood pair, and its own reading
    of the answer (lm_eval/models/openai_completions.py: sum of token_logprobs[ctxlen:-1])."""
    tok = model.tokenizer
    ctx_ids = tok.encode(context)
    ids = ctx_ids + tok.encode(continuation, add_special_tokens=False)
    body = {"model": "x", "prompt": ids if as_ids else tok.decode(ids[1:]), "max_tokens": max_tokens,
            "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    status, payload, _ = request(port, "POST", "/v1/completions", body)
    assert status == 200, payload
    lp = payload["choices"][0]["logprobs"]
    end = -1 if max_tokens == 1 else None
    ctxlen = len(ctx_ids)
    logprobs, tops = lp["token_logprobs"][ctxlen:end], lp["top_logprobs"][ctxlen:end]
    greedy = all(t == max(top.values()) for t, top in zip(logprobs, tops))
    return sum(logprobs), greedy, ids, payload


@pytest.mark.parametrize("as_ids,max_tokens", [(True, 1), (False, 1), (True, 0)])
def test_lm_eval_loglikelihood_requests_equal_ds2s_own_forward_pass(server, model, as_ids, max_tokens):
    port, _, _ = server
    for context, continuation in [("Question: What is 12 + 30?\nAnswer:", " 42"),
                                  ("ROMEO:\n", "What, shall this speech be spoke")]:
        total, greedy, ids, payload = lm_eval_request(port, context, continuation, model, as_ids, max_tokens)
        ctxlen = len(model.tokenizer.encode(context))
        ref = direct(model, ids)
        want = sum(ref[i - 1, ids[i]] for i in range(ctxlen, len(ids)))
        assert abs(total - want) < TOL * len(ids)
        assert greedy == all(ref[i - 1].argmax() == ids[i] for i in range(ctxlen, len(ids)))
        lp = payload["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["tokens"]) == len(ids) + max_tokens
        assert payload["usage"]["completion_tokens"] == max_tokens
        text = payload["choices"][0]["text"]
        assert text.startswith(model.tokenizer.decode(ids))
        for t, at in zip(lp["tokens"], lp["text_offset"]):
            assert "\ufffd" in t or text[at:at + len(t)] == t


def test_echo_recomputes_the_cached_prefix_and_streams_the_prompt_first(server, model):
    port, _, _ = server
    body = {"prompt": "ROMEO:\nWhat, shall this speech be spoke", "max_tokens": 4, "logprobs": 0,
            "echo": True, "temperature": 0}
    first = request(port, "POST", "/v1/completions", body)[1]
    again = request(port, "POST", "/v1/completions", body)[1]     # its prompt is in the prompt cache now
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    a, b = first["choices"][0]["logprobs"], again["choices"][0]["logprobs"]
    assert a["tokens"] == b["tokens"] and a["top_logprobs"] == b["top_logprobs"] == [None] + [{}] * (len(a["tokens"]) - 1)
    assert max(abs(x - y) for x, y in zip(a["token_logprobs"][1:], b["token_logprobs"][1:])) < TOL
    chunks = [e for e in sse(port, {**body, "stream": True}) if e != "[DONE]"]
    prompt_len = len(model.tokenizer.encode(body["prompt"]))
    assert chunks[0]["choices"][0]["text"] == model.tokenizer.decode(model.tokenizer.encode(body["prompt"]))
    assert len(chunks[0]["choices"][0]["logprobs"]["tokens"]) == prompt_len
    streamed = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    offsets = [o for c in chunks for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert streamed == a["tokens"] and offsets == a["text_offset"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == first["choices"][0]["text"]


def test_echo_without_logprobs_only_prefixes_the_text_and_keeps_the_prompt_cache(server, model):
    port, _, _ = server
    body = {"prompt": "ROMEO:\nWhat, shall", "max_tokens": 5, "temperature": 0}
    plain = request(port, "POST", "/v1/completions", body)[1]["choices"][0]
    echoed = request(port, "POST", "/v1/completions", {**body, "echo": True})[1]
    prompt = model.tokenizer.decode(model.tokenizer.encode(body["prompt"]))
    assert echoed["choices"][0]["text"] == prompt + plain["text"] and echoed["choices"][0]["logprobs"] is None
    assert echoed["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    events = [e for e in sse(port, {**body, "echo": True, "stream": True}) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == echoed["choices"][0]["text"]


# ---- bad input ----
BAD = [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be in [0, 20]"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs", "logprobs must be true or false"),
    ("/v1/chat/completions", {"echo": True}, "echo", "echo is only for /v1/completions"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "an integer in [0, 20]"),
    ("/v1/completions", {"logprobs": -1}, "logprobs", "an integer in [0, 20]"),
    ("/v1/completions", {"logprobs": "yes"}, "logprobs", "logprobs must be true, false or an integer"),
    ("/v1/completions", {"logprobs": 2, "top_logprobs": 3}, "top_logprobs", "disagree"),
    ("/v1/completions", {"top_logprobs": -1, "logprobs": True}, "top_logprobs", "top_logprobs must be in [0, 20]"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1 (0 only with echo)"),
    ("/v1/completions", {"max_tokens": -1, "echo": True}, "max_tokens", "max_tokens must be at least 1"),
    ("/v1/completions", {"echo": "yes"}, "echo", "echo must be true or false"),
]


@pytest.mark.parametrize("path,fields,param,message", BAD)
def test_bad_logprobs_fields_get_a_400_naming_the_param(server, path, fields, param, message):
    port, _, _ = server
    base = {"messages": QUESTION} if "chat" in path else {"prompt": "hi"}
    status, payload, _ = request(port, "POST", path, {**base, **fields})
    assert status == 400, payload
    assert payload["error"]["param"] == param and message in payload["error"]["message"]


def test_the_top_map_keeps_the_likelier_of_two_tokens_with_one_text(model):
    tok = model.tokenizer
    pieces = [t for t in range(tok.vocab_size) if tok.token_bytes(t) and tok.token_bytes(t)[0] >= 0xc0
              and len(tok.token_bytes(t)) == 1][:2]
    if len(pieces) < 2:
        pytest.skip("ds2-tiny has fewer than two lone UTF-8 lead bytes")
    e = lp_module.Entry(pieces[0], -0.5, ((pieces[0], -0.5), (pieces[1], -2.0)))
    assert lp_module.top_map(tok, e) == {"\ufffd": -0.5}
