"""How much a low-bit form of a model differs from its float32 self: mean KL divergence of the
next-token distribution, top-1 agreement and perplexity, over text sampled from the float32
model (or over the `ids` of a reference case's ref.npz).

    python examples/quant_quality.py --bits 8                 # ds2-tiny, 12 x 300 sampled tokens
    python examples/quant_quality.py --bits 4 --model ../shared/reference/lite_like_plainq_yarn
"""

import argparse
from pathlib import Path

import numpy as np

import ds2cli


def sample(model, n: int, length: int, seed: int) -> list[list[int]]:
    rng, seqs = np.random.default_rng(seed), []
    for k in range(n):
        ids = [model.tokenizer.encode("ROMEO:\n"), model.tokenizer.encode_chat(
            [{"role": "user", "content": f"What is {10 + k} + {30 + 2 * k}?"}], add_generation_prompt=True)][k % 2]
        cache = model.new_cache(len(ids) + length)
        logits, out = model.forward(ids, cache), list(ids)
        for _ in range(length):
            p = np.exp(logits - logits.max())
            out.append(int(rng.choice(len(p), p=p / p.sum())))
            logits = model.forward(out[-1:], cache)
        seqs.append(out)
    return seqs


def log_probs(model, seqs) -> np.ndarray:
    rows = []
    for s in seqs:
        x = model.forward(s, model.new_cache(len(s)), all_logits=True).astype(np.float64)
        x -= x.max(-1, keepdims=True)
        rows.append(x - np.log(np.exp(x).sum(-1, keepdims=True)))
    return np.concatenate(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, choices=(8, 4), required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=12, help="sampled sequences")
    ap.add_argument("--length", type=int, default=300, help="tokens sampled per sequence")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ref_file = Path(args.model or "", "ref.npz")
    base, low = ds2cli.load(args.model), ds2cli.load(args.model, quantize=args.bits)
    seqs = [np.load(ref_file)["ids"].tolist()] if args.model and ref_file.is_file() else \
        sample(base, args.n, args.length, args.seed)
    ref, got = log_probs(base, seqs), log_probs(low, seqs)
    kl = (np.exp(ref) * (ref - got)).sum(-1).mean()
    top1 = (ref.argmax(-1) == got.argmax(-1)).mean()
    # row t of a sequence predicts its token t + 1
    starts = np.cumsum([0] + [len(s) for s in seqs[:-1]])
    rows = np.concatenate([start + np.arange(len(s) - 1) for start, s in zip(starts, seqs)])
    targets = np.concatenate([s[1:] for s in seqs])
    ppl = lambda lp: float(np.exp(-lp[rows, targets].mean()))  # noqa: E731
    print(f"{args.bits}-bit vs float32 over {len(ref)} positions: mean KL {kl:.3g}, top-1 agreement "
          f"{top1:.1%}, perplexity {ppl(got):.3f} vs {ppl(ref):.3f}")


if __name__ == "__main__":
    main()
