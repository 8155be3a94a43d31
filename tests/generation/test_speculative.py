"""Prompt-lookup speculative decoding (generate.stream_generate with draft > 0): drafts verified
in one pass of k tokens. Greedy output equals plain decoding; sampled output has exactly the
plain sampler's distribution; stops, eos, limits, the context's end and Ctrl-C behave as without."""

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import ds2cli
from ds2cli.cli.main import main
from ds2cli.generation.draft import DraftLength, PromptLookup
from ds2cli.generation.generate import stream_generate
from ds2cli.generation.sampling import SamplingParams, TokenSampler, make_sampler

pytestmark = pytest.mark.slow      # left out of `pytest -m "not slow"` (docs/internals.md, Tests)

REFERENCE = Path(__file__).parents[1] / "data" / "reference"
TOL = 1e-3      # the engine's agreement with the reference logits (tests/model/test_parity.py)

CHAT_PROMPTS = ["What is 451 - 123?", "Count from 3 to 9.", "Who are you?", "What is 17 + 25?",
                "Count from 12 to 20.", "What is 99 - 9?", "Say something.", "Count from 1 to 5, then from 1 to 5 again."]
RAW_PROMPTS = ["ROMEO:\n", "To be, or not to be, that is the question:\n", "KING HENRY.\nNow, lords,",
               "1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"]


@pytest.fixture(scope="module")
def tiny():
    return ds2cli.load()


def run(model, ids, *, draft=0, drafts=None, params=SamplingParams(temperature=0), n=40, stop=(), ctx=None,
        eos_ids=None):
    cache = model.new_cache(ctx or len(ids) + n)
    chunks = list(stream_generate(model, ids, cache, make_sampler(params), n, stop, eos_ids=eos_ids,
                                  draft=draft, drafts=drafts))
    return "".join(c.text for c in chunks), chunks[-1], cache


class Oracle:
    """A test-only draft source: proposes a known continuation (the plain greedy output), with
    every `wrong`-th drafted token replaced by a wrong one."""

    def __init__(self, prompt, continuation, wrong=0):
        self.text, self.wrong, self.proposed = list(prompt) + list(continuation), wrong, 0

    def propose(self, history, n):
        at = len(history)
        out = []
        for t in self.text[at:at + n]:
            self.proposed += 1
            out.append((t + 1) % 4096 if self.wrong and self.proposed % self.wrong == 0 else t)
        return out


def prompts(model):
    tok = model.tokenizer
    return ([tok.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True) for p in CHAT_PROMPTS]
            + [tok.encode(p) for p in RAW_PROMPTS])


@pytest.fixture(scope="module")
def plain_greedy(tiny):
    """Each prompt's plain greedy run (text, last chunk, cache), decoded once for the module:
    plain decoding is deterministic and nothing below writes to these, so every test that compares
    against it reads the same run instead of decoding the same 40 tokens again (~15 s saved)."""
    return [(ids, *run(tiny, ids)) for ids in prompts(tiny)]


@pytest.mark.parametrize("draft", [1, 4, 63])
def test_greedy_with_drafts_is_plain_greedy_on_ds2_tiny(tiny, plain_greedy, draft):
    for ids, plain, last, cache in plain_greedy:
        spec, slast, scache = run(tiny, ids, draft=draft)
        assert spec == plain and slast.tokens == last.tokens and slast.finish_reason == last.finish_reason
        assert scache.length == cache.length
        n = cache.length
        np.testing.assert_allclose(scache.latent[:, :n], cache.latent[:, :n], rtol=0, atol=1e-4)


@pytest.mark.parametrize("wrong", [0, 1, 2, 3])
def test_every_acceptance_pattern_gives_plain_output(tiny, plain_greedy, wrong):
    """All drafts right, all wrong, every other one wrong: the same tokens and the same cache."""
    for ids, plain, last, cache in plain_greedy[:6]:
        oracle = Oracle(ids, last.tokens, wrong)
        spec, slast, scache = run(tiny, ids, draft=6, drafts=oracle)
        assert slast.tokens == last.tokens and spec == plain and scache.length == cache.length
        assert slast.drafted > 0 and (slast.accepted == 0) == (wrong == 1)
        if wrong == 0:
            assert slast.accepted == slast.drafted


@pytest.mark.parametrize("case", ["lite_like_plainq_yarn", "v2_like_loraq_grouplimited", "normtopk_layerfreq2",
                                  "plain_rope_tied_fp16"])
def test_reference_cases_differ_only_at_near_ties(case):
    """Random weights give nearly flat next-token distributions: a k-token pass and k single
    steps may round differently in the last float32 bits. Each computes every logit within TOL
    of the reference math, so they can pick different tokens only where the top two logits of
    the plain run are within 2 * TOL of each other; anywhere else the tokens must agree."""
    model = ds2cli.load(REFERENCE / case)
    rng = np.random.default_rng(0)
    for trial in range(3):
        ids = [int(t) for t in rng.integers(0, model.config.vocab_size, 12)]
        cache = model.new_cache(64)
        logits = [model.forward(ids, cache)]
        plain = []
        for _ in range(24):                       # plain greedy, keeping each step's logits
            plain.append(int(np.argmax(logits[-1])))
            logits.append(model.forward([plain[-1]], cache))
        _, last, _ = run(model, ids, draft=5, drafts=Oracle(ids, plain, wrong=3), n=24, eos_ids=())
        for i, (a, b) in enumerate(zip(plain, last.tokens)):
            if a != b:
                top2 = np.sort(logits[i].astype(np.float64))[-2:]
                assert top2[1] - top2[0] <= 2 * TOL, (case, trial, i, top2)
                break


def test_the_acceptance_rule_keeps_the_samplers_distribution():
    """verify(draft) returns a token distributed exactly as a plain sample: the empirical
    distribution over many seeds matches the filtered target within a 5-sigma bound per token,
    for each draft token tried (likely, unlikely, filtered out), with every filter on."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(50) * 2).astype(np.float32)
    history = [3, 4, 4, 7]
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3)
    p = TokenSampler(params).distribution(logits, history)
    order = np.argsort(-p)
    N = 20000
    for draft in (int(order[0]), int(order[3]), int(order[-1])):
        sampler = TokenSampler(SamplingParams(**{**params.__dict__, "seed": 1}))
        counts = np.bincount([sampler.verify(logits, history, draft)[1] for _ in range(N)], minlength=50)
        sigma = np.sqrt(N * p * (1 - p)) + 1
        assert (np.abs(counts - N * p) <= 5 * sigma).all(), draft
        assert counts[p == 0].sum() == 0                  # a filtered-out token never comes back


def test_sampled_output_with_drafts_is_the_plain_samplers_own(tiny):
    """Each position takes one draw, drafted or not: with the same seed the sampled output is
    the very text plain sampling gives, whatever was drafted or accepted (so a fixed seed
    repeats itself however the draft length adapts), with every filter on."""
    ids = tiny.tokenizer.encode("1, 2, 3, 4, 1, 2, 3, 4, 1, 2,")
    drafted = accepted = 0
    for seed in range(12):
        params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.1,
                                seed=seed)
        plain = run(tiny, ids, params=params, n=24)[1]
        for draft, source in ((4, None), (8, Oracle(ids, plain.tokens)), (3, Oracle(ids, plain.tokens, wrong=2))):
            spec = run(tiny, ids, params=params, n=24, draft=draft, drafts=source)[1]
            assert spec.tokens == plain.tokens, (seed, draft)
            drafted, accepted = drafted + spec.drafted, accepted + spec.accepted
    assert drafted > accepted > 0


def test_a_stop_string_spanning_accepted_drafts_stops_where_plain_stops(tiny):
    ids = tiny.tokenizer.encode_chat([{"role": "user", "content": "Count from 3 to 9."}], add_generation_prompt=True)
    plain, last, cache = run(tiny, ids)
    for stop in [", 6,", "5, 6", "8, 9", " 4"]:
        a, la, ca = run(tiny, ids, stop=[stop])
        b, lb, cb = run(tiny, ids, stop=[stop], draft=6, drafts=Oracle(ids, last.tokens))
        assert (a, la.finish_reason, la.tokens, ca.length) == (b, lb.finish_reason, lb.tokens, cb.length)
        assert lb.accepted > 0


def test_limits_eos_and_the_end_of_the_context(tiny):
    ids = tiny.tokenizer.encode("1, 2, 3, 4, 1, 2, 3, 4, 1, 2,")
    for n in (1, 2, 5, 9):
        a, la, _ = run(tiny, ids, n=n)
        b, lb, _ = run(tiny, ids, n=n, draft=8)
        assert (a, la.tokens, la.finish_reason) == (b, lb.tokens, lb.finish_reason) and len(lb.tokens) <= n
    for room in (1, 2, 3, 7):              # the cache ends `room` tokens after the prompt
        a, la, ca = run(tiny, ids, n=30, ctx=len(ids) + room)
        b, lb, cb = run(tiny, ids, n=30, ctx=len(ids) + room, draft=8)
        assert (a, la.tokens, ca.length) == (b, lb.tokens, cb.length)
    chat = tiny.tokenizer.encode_chat([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True)
    a, la, _ = run(tiny, chat, n=60)
    b, lb, _ = run(tiny, chat, n=60, draft=8, drafts=Oracle(chat, la.tokens))
    assert la.finish_reason == lb.finish_reason == "eos" and la.tokens == lb.tokens


def test_ctrl_c_during_a_verification_pass_leaves_the_cache_consistent(tiny, monkeypatch):
    ids = tiny.tokenizer.encode("1, 2, 3, 4, 1, 2, 3, 4, 1, 2,")
    cache = tiny.new_cache(80)
    real, calls = tiny.forward_batch, []

    def forward_batch(steps, trace=None):
        calls.append(len(steps[0].ids))
        if len(calls) > 3 and len(steps[0].ids) > 1:
            raise KeyboardInterrupt                  # inside a verification pass
        return real(steps, trace)
    monkeypatch.setattr(tiny, "forward_batch", forward_batch)
    gen = stream_generate(tiny, ids, cache, make_sampler(SamplingParams(temperature=0)), 40, draft=4)
    shown = []
    with pytest.raises(KeyboardInterrupt):
        for chunk in gen:
            shown.append(chunk)
    monkeypatch.undo()
    generated = shown[-1].generated_tokens
    # what the cache holds is the prompt and every generated token shown but the last
    assert cache.length == len(ids) + generated - 1
    check = tiny.new_cache(80)
    tiny.forward(ids + [c.token for c in shown][:-1], check)
    np.testing.assert_allclose(cache.latent[:, :cache.length], check.latent[:, :cache.length], rtol=0, atol=1e-4)


def test_prompt_lookup_and_the_draft_length():
    look = PromptLookup()
    assert look.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert look.propose([1, 2, 3, 4, 5, 1, 2, 9], 3) == []
    assert look.propose([5, 1, 7, 5, 1, 8, 5, 1], 2) == [8, 5]       # the latest occurrence
    assert look.propose([4], 2) == [] and look.propose([], 2) == []
    length = DraftLength(8)
    assert length.next() == 4
    length.record(4, 0)                            # wholly rejected: a pause of plain steps
    assert [length.next() for _ in range(9)] == [0] * 8 + [2]
    length.record(2, 0)                            # again: twice as long
    assert [length.next() for _ in range(17)] == [0] * 16 + [1]
    length.record_step(0.01)
    length.record(1, 1, seconds=0.011)             # two tokens for 1.1 steps: it pays (gain 1.8 on average 0.8)
    length.record(1, 1, seconds=0.011)
    assert length.gain > 1 and length.next() > 1 and length.backoff == DraftLength.FIRST_PAUSE
    dear = DraftLength(8)
    dear.record_step(0.01)
    dear.record(4, 4, seconds=0.06)                # all taken, but 5 tokens for 6 steps: a loss
    assert dear.next() == 0


@pytest.mark.parametrize("value", ["-1", "64", "x"])
def test_draft_out_of_range_is_a_usage_error(value):
    r = CliRunner().invoke(main, ["generate", "hi", "--draft", value])
    assert r.exit_code == 2 and "--draft" in r.stderr


def test_stats_and_json_report_drafted_and_accepted_tokens():
    import json
    r = CliRunner().invoke(main, ["generate", "1, 2, 3, 4, 1, 2, 3, 4, 1, 2,", "-n", "30", "--temp", "0",
                                  "--draft", "6", "--json", "--stats"])
    out = json.loads(r.stdout)
    assert r.exit_code == 0 and out["drafted_tokens"] >= out["accepted_tokens"] >= 0 and out["drafted_tokens"] > 0
    assert f"draft {out['drafted_tokens']} tok, {out['accepted_tokens']} accepted" in r.stderr     # one part: never split
    plain = json.loads(CliRunner().invoke(main, ["generate", "1, 2, 3, 4, 1, 2, 3, 4, 1, 2,", "-n", "30",
                                                 "--temp", "0", "--json"]).stdout)
    assert plain["text"] == out["text"] and "drafted_tokens" not in plain
