"""Samplers, stop strings and the generation loop's contract."""

import numpy as np
import pytest

import ds2cli
from ds2cli.errors import Ds2Error, GenerationError
from ds2cli.generation.generate import StopMatcher, check_logits, stream_generate
from ds2cli.generation.sampling import (SamplingParams, apply_repetition_penalty, filter_min_p, filter_top_k,
                             filter_top_p, make_sampler)


def test_stop_matcher_holds_back_prefixes_and_cuts_at_the_first_stop():
    m = StopMatcher(["END", "\n\n"])
    assert m.feed("abc E") == ("abc ", False)      # "E" might start "END"
    assert m.feed("N") == ("", False)
    assert m.feed("Dtail") == ("", True)           # "E"+"N"+"D" completes the stop: nothing after it
    m = StopMatcher(["END"])
    assert m.feed("xEy") == ("xEy", False) and m.flush() == ""
    m = StopMatcher(["\n\n", "B"])
    assert m.feed("a\n") == ("a", False) and m.feed("\nB") == ("", True)


def test_top_k_top_p_min_p_filters():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert np.isneginf(filter_top_k(logits, 2)[2:]).all() and np.isfinite(filter_top_k(logits, 2)[:2]).all()
    probs = np.exp(logits)
    np.testing.assert_array_equal(filter_top_p(probs, 0.8) > 0, [True, True, False, False])
    np.testing.assert_array_equal(filter_top_p(probs, 0.81) > 0, [True, True, True, False])
    np.testing.assert_array_equal(filter_min_p(probs, 0.5) > 0, [True, True, False, False])


def test_repetition_penalty_follows_hugging_face():
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0])
    assert logits[0] == 2.0  # the caller's array is untouched


def test_sampler_is_seeded_and_greedy_at_zero_temperature():
    logits = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    a = make_sampler(SamplingParams(temperature=1.0, seed=3))
    b = make_sampler(SamplingParams(temperature=1.0, seed=3))
    assert [a(logits, []) for _ in range(20)] == [b(logits, []) for _ in range(20)]
    c = make_sampler(SamplingParams(temperature=1.0, seed=4))
    assert [a(logits, []) for _ in range(20)] != [c(logits, []) for _ in range(20)]
    greedy = make_sampler(SamplingParams(temperature=0.0))
    assert greedy(logits, []) == int(np.argmax(logits))
    # top-k 1 is greedy at any temperature
    assert make_sampler(SamplingParams(temperature=2.0, top_k=1, seed=0))(logits, []) == int(np.argmax(logits))


def test_sampling_defaults_from_generation_config():
    p = SamplingParams.from_generation_config({"do_sample": True, "temperature": 0.3, "top_p": 0.95})
    assert (p.temperature, p.top_p, p.top_k) == (0.3, 0.95, 0)
    assert SamplingParams.from_generation_config({"do_sample": False, "temperature": 0.3}).temperature == 0.0
    assert SamplingParams.from_generation_config({"temperature": 0.3}, temperature=0.9).temperature == 0.9
    with pytest.raises(Ds2Error, match="top-p"):
        SamplingParams(top_p=0.0)


def test_non_finite_logits_are_an_error():
    with pytest.raises(GenerationError, match="non-finite"):
        check_logits(np.array([0.0, np.nan], dtype=np.float32))


def test_generation_leaves_the_cache_holding_prompt_and_fed_tokens():
    model = ds2cli.load()
    ids = model.tokenizer.encode("ROMEO:\n")
    cache = model.new_cache(64)
    chunks = list(stream_generate(model, ids, cache, make_sampler(SamplingParams(temperature=0)), 10))
    last = chunks[-1]
    assert last.finish_reason == "length" and last.generated_tokens == 10 == len(last.tokens)
    assert cache.length == len(ids) + 9      # the last sampled token is never fed back
    assert "".join(c.text for c in chunks) == model.tokenizer.decode(last.tokens)
