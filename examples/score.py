"""Score a text: per-token log-probabilities and perplexity under the model.

    python examples/score.py "To be, or not to be, that is the question"
"""

import argparse

import numpy as np

import ds2cli


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def score(model, text: str) -> list[tuple[str, float]]:
    """(token text, log p(token | everything before)) for every token after the first."""
    ids = model.tokenizer.encode(text)
    logits = model.forward(ids, model.new_cache(len(ids)), all_logits=True)   # (T, V)
    logp = log_softmax(logits[:-1])                                          # predicts ids[1:]
    return [(model.tokenizer.token_text(t), float(logp[i, t])) for i, t in enumerate(ids[1:])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("text", nargs="?", default="To be, or not to be, that is the question")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    model = ds2cli.load(args.model)
    rows = score(model, args.text)
    for token, lp in rows:
        print(f"{lp:9.4f}  {token!r}")
    nll = -np.mean([lp for _, lp in rows])
    print(f"tokens {len(rows)}  mean log-prob {-nll:.4f}  perplexity {np.exp(nll):.2f}")


if __name__ == "__main__":
    main()
