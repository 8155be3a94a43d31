"""The ds2_addition task's accuracy computed directly from ds2's log-likelihoods, without lm-eval
or a server: what `lm_eval --model local-completions` against `ds2 serve` must reproduce.

    python examples/lm_eval/direct.py [--model DIR]

Each choice is scored as lm-eval scores a multiple_choice request: the context and the
continuation (" " + choice) are tokenized as lm-eval's remote tokenizer does it (ds2 serve's
/tokenize, without special tokens), the whole is run through one forward pass, and the
continuation's log-probabilities are summed; the prediction is the arg max (the first on a tie).
"""

import argparse
import json
from pathlib import Path

import numpy as np

import ds2cli

HERE = Path(__file__).parent


def context_of(doc: dict) -> str:
    """doc_to_text of ds2_addition.yaml."""
    return f"Question: What is {doc['a']} + {doc['b']}?\nAnswer:"


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair for a causal model: trailing spaces of the context move
    to the continuation; the whole is encoded and split after the context's own tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def loglikelihood(model, ctx: list[int], cont: list[int]) -> float:
    ids = ctx + cont
    logits = model.forward(ids, model.new_cache(len(ids)), all_logits=True).astype(np.float64)   # (T, V)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(sum(logp[i - 1, ids[i]] for i in range(len(ctx), len(ids))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", default=str(HERE / "addition.jsonl"))
    args = ap.parse_args()
    model = ds2cli.load(args.model)
    docs = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    correct = 0
    for doc in docs:
        scores = [loglikelihood(model, *encode_pair(model.tokenizer, context_of(doc), " " + c)) for c in doc["choices"]]
        pred = int(np.argmax(scores))
        correct += pred == doc["label"]
        print(f"{doc['a']} + {doc['b']}: choices {doc['choices']} log-likelihoods "
              f"{[round(s, 6) for s in scores]} -> {doc['choices'][pred]} ({'right' if pred == doc['label'] else 'wrong'})")
    print(f"acc {correct / len(docs):.4f} ({correct}/{len(docs)})")


if __name__ == "__main__":
    main()
