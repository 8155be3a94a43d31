"""How much constrained output costs a token: llguidance (what ds2cli.generation.grammar uses) against
outlines-core, on ds2-tiny's 4096-token vocabulary and a DeepSeek tokenizer (102400 logits).

    python examples/grammar_masks.py [--tokenizer DIR] [--outlines]

Prints, for each library: the tokenizer set-up, the compile time of a 5-field schema, and the
per-token mask time over 5 seeded random walks (uniform over the allowed tokens, up to 400 steps),
then a rollback check. --outlines needs `pip install outlines-core` (not a ds2 dependency).
The figures in ds2cli/grammar.py's docstring came from this script."""

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from ds2cli.generation import grammar as grammars
from ds2cli.weights.source import bundled_model_dir
from ds2cli.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "color", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}}}}}


def summary(times):
    times = sorted(times)
    return (f"median {statistics.median(times) * 1e3:.3f} ms, p99 {times[int(0.99 * (len(times) - 1))] * 1e3:.3f} ms,"
            f" max {times[-1] * 1e3:.3f} ms (n={len(times)})")


def walks(start, allowed, advance, done, eos, seeds=5, steps=400):
    """Random walks through the grammar: (mask times, the last walk's tokens)."""
    times = []
    for seed in range(seeds):
        start()
        rng, tokens = np.random.default_rng(seed), []
        while not done() and len(tokens) < steps:
            t = time.perf_counter()
            ok = np.flatnonzero(allowed())
            times.append(time.perf_counter() - t)
            token = int(rng.choice(ok[ok != eos] if len(ok) > 1 else ok))
            if token == eos:
                break
            advance(token)
            tokens.append(token)
    return times, tokens


def llguidance(tokenizer, vocab_size):
    eos = tokenizer.eos_token_ids[0]
    t = time.perf_counter()
    vocab = grammars.vocabulary(tokenizer, vocab_size, (eos,))
    setup = time.perf_counter() - t
    t = time.perf_counter()
    grammar = grammars.json_schema_grammar(SCHEMA)
    box = [grammars.Constraint(grammar, vocab)]
    compile_s = time.perf_counter() - t
    logits = np.zeros(vocab_size, np.float32)
    times, tokens = walks(lambda: box.__setitem__(0, grammars.Constraint(grammar, vocab)),
                          lambda: np.isfinite(box[0].apply(logits)), lambda x: box[0].advance(x),
                          lambda: box[0].done, eos)
    c = grammars.Constraint(grammar, vocab)
    before = c.allowed_mask()
    for x in tokens[:10]:
        c.advance(x)
    c.rollback(min(10, len(tokens)))
    print(f"llguidance: tokenizer {setup * 1e3:.0f} ms, schema compile {compile_s * 1e3:.1f} ms; "
          f"Constraint.apply {summary(times)}; rollback restores the mask: {np.array_equal(before, c.allowed_mask())}")


def outlines(tokenizer, vocab_size):
    import outlines_core as oc
    eos = tokenizer.eos_token_ids[0]
    t = time.perf_counter()
    by_bytes = {}
    for i in range(tokenizer.vocab_size):
        if i != eos:
            by_bytes.setdefault(tokenizer.token_bytes(i), []).append(i)
    vocab = oc.Vocabulary(eos, by_bytes)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    index = oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA)), vocab)
    compile_s = time.perf_counter() - t
    guide = oc.Guide(index, max_rollback=64)
    mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed():
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        return np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)
    times, tokens = walks(guide.reset, allowed, lambda x: guide.advance(x, return_tokens=False),
                          guide.is_finished, eos)
    guide.reset()
    before = allowed().copy()
    for x in tokens[:10]:
        guide.advance(x, return_tokens=False)
    guide.rollback_state(min(10, len(tokens)))
    print(f"outlines-core: vocabulary {setup * 1e3:.0f} ms, schema compile (regex + Index) {compile_s * 1e3:.1f} ms; "
          f"mask {summary(times)}; rollback restores the mask: {np.array_equal(before, allowed())}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, help="a directory with tokenizer.json (default ds2-tiny's)")
    parser.add_argument("--vocab-size", type=int, help="the model's logits (default: 4096 for ds2-tiny, "
                                                       "102400 for another tokenizer)")
    parser.add_argument("--outlines", action="store_true", help="measure outlines-core too")
    args = parser.parse_args()
    tokenizer = Tokenizer.load(args.tokenizer or bundled_model_dir())
    vocab_size = args.vocab_size or (102400 if args.tokenizer else 4096)
    print(f"{args.tokenizer or 'ds2-tiny'}: {tokenizer.vocab_size} tokens, {vocab_size} logits")
    llguidance(tokenizer, vocab_size)
    if args.outlines:
        outlines(tokenizer, vocab_size)


if __name__ == "__main__":
    main()
