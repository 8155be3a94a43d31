"""Constrained output: grammar.py's token masks (llguidance) on ds2's tokenizers and the sampler
that applies them (drafts included); tests/server/test_response_format.py drives the same through
ds2 serve. ds2-tiny at temperature 1 writes near-random text, so a reply that parses and validates
shows the mask did the work."""

import json
from pathlib import Path

import numpy as np
import pytest

import ds2cli
from ds2cli.generation import grammar as grammars
from ds2cli.server.responses import finish_reason
from ds2cli.generation.generate import stream_generate
from ds2cli.generation.sampling import SamplingParams, make_sampler
from ds2cli.text.tokenizer import Tokenizer
from support.schemas import LIST, NESTED, PERSON

pytest.importorskip("llguidance", reason="the grammar extra: pip install '.[grammar]'")
jsonschema = pytest.importorskip("jsonschema")

TOKENIZERS = Path(__file__).parents[1] / "data" / "tokenizers"


@pytest.fixture(scope="module")
def model():
    return ds2cli.load()



# ---- the masks, without a model ----
@pytest.mark.slow
@pytest.mark.parametrize("tokenizer_dir, vocab_size", [("ds2-tiny", 4096), ("deepseek-v2", 102400)])
def test_random_walks_under_the_mask_are_valid_json(tokenizer_dir, vocab_size):
    """Any path through the allowed tokens ends in a document that validates (uniform choices:
    the worst case for a grammar, since nothing steers towards closing)."""
    tokenizer = Tokenizer.load(TOKENIZERS / tokenizer_dir)
    vocab = grammars.vocabulary(tokenizer, vocab_size, tokenizer.eos_token_ids)
    eos = tokenizer.eos_token_ids[0]
    for seed in range(3):
        constraint, rng, ids = grammars.Constraint(grammars.json_schema_grammar(NESTED), vocab), \
            np.random.default_rng(seed), []
        while not constraint.done and len(ids) < 400:
            allowed = constraint.allowed_mask()
            assert allowed.shape == (vocab_size,)
            assert allowed[eos] == constraint.is_accepting()          # eos only where the grammar accepts
            choices = np.flatnonzero(allowed)
            short = [t for t in choices if len(tokenizer.token_bytes(int(t))) <= 2 and t != eos]
            token = int(rng.choice(short if short and rng.random() < 0.7 else choices))
            constraint.advance(token)
            ids.append(token)
        assert constraint.done, "the walk did not complete"
        jsonschema.validate(json.loads(tokenizer.decode(ids)), NESTED)


def test_rollback_restores_the_state_exactly():
    tokenizer = Tokenizer.load(TOKENIZERS / "ds2-tiny")
    vocab = grammars.vocabulary(tokenizer, 4096, tokenizer.eos_token_ids)
    constraint = grammars.Constraint(grammars.json_schema_grammar(PERSON), vocab)
    text_ids = tokenizer.encode('{"name":"ab","age":7', add_special_tokens=False)
    masks = []
    for token in text_ids:
        masks.append(constraint.allowed_mask())
        constraint.advance(token)
    for k in range(len(text_ids), 0, -1):         # back one token at a time, then forward again
        constraint.rollback(1)
        assert np.array_equal(constraint.allowed_mask(), masks[k - 1])
    for token in text_ids[:3]:
        constraint.advance(token)
    constraint.rollback(3)
    assert np.array_equal(constraint.allowed_mask(), masks[0])
    bad = tokenizer.encode("x", add_special_tokens=False)
    assert constraint.valid_prefix(text_ids + bad) == len(text_ids)        # checked, not taken
    assert np.array_equal(constraint.allowed_mask(), masks[0])
    with pytest.raises(grammars.GrammarError, match="not allowed"):
        constraint.advance(tokenizer.encode("x", add_special_tokens=False)[0])


@pytest.mark.parametrize("schema", [{"type": "foo"}, {"type": "object", "properties": 3},
                                    {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                                    {"type": "string", "pattern": "(["}, ["not", "an", "object"]])
def test_a_bad_schema_names_its_fault(schema):
    with pytest.raises(grammars.GrammarError) as e:
        grammars.json_schema_grammar(schema)
    assert str(e.value)


# ---- the sampler and the generation loop ----
@pytest.mark.slow
def test_drafts_keep_the_grammar_in_step(model):
    """Speculative decoding verifies prompt-lookup drafts against masked logits: the output is
    the one plain constrained sampling gives with the same seed, and it validates."""
    grammar = grammars.json_schema_grammar(NESTED)
    prompt = model.tokenizer.encode('{"id": 12, "owner": {"name": "ab", "ok": true}} {"id": 12, "owner": ')
    outputs = []
    for draft in (0, 4):
        constraint = grammars.Constraint.for_model(grammar, model)
        sampler = make_sampler(SamplingParams(temperature=1.0, seed=3), constraint)
        chunks = list(stream_generate(model, prompt, model.new_cache(256), sampler, 120, draft=draft,
                                      finished=lambda c=constraint: c.done))
        outputs.append(("".join(c.text for c in chunks), chunks[-1]))
    (text, last), (drafted_text, drafted_last) = outputs
    assert drafted_text == text and drafted_last.tokens == last.tokens
    assert drafted_last.drafted > 0
    assert last.finish_reason == "grammar" and finish_reason(last) == "stop"
    jsonschema.validate(json.loads(text), NESTED)
