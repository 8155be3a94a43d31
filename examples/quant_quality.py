"""How much a low-bit form of a model differs from its float32 self: mean, p99 and maximum KL
divergence of the next-token distribution, top-1 agreement and perplexity, over text sampled
from the float32 model at temperature 1 (raw text and chat, reported apart), plus 100 two-digit
additions in chat; or over the `ids` of a reference case's ref.npz.

    python examples/quant_quality.py --bits 8                  # ds2-tiny, the held-out prompts
    python examples/quant_quality.py --bits 4 --prompts tune   # the prompts the search was tuned on
    python examples/quant_quality.py --bits 4 --nearest        # today's round to nearest, for comparison
    python examples/quant_quality.py --quantized /tmp/tiny-q4  # a `ds2 quantize` output against its source
    python examples/quant_quality.py --bits 4 --model ../shared/reference/lite_like_plainq_yarn

The two prompt sets are disjoint. `tune` is what the scale search and the calibration were
developed against (and the prompts of tests/weights/test_quant.py); `heldout` was not looked at until the
figures were final. Neither overlaps ds2cli/calibration.txt, the default calibration text.
"""

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np

import ds2cli
from ds2cli.weights import scales

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arithmetic import ask  # noqa: E402

PROMPTS = {
    "tune": {"raw": ["ROMEO:\n", "KING.\n", "First Citizen:\n", "HAMLET:\n"],
             "chat": ["What is 12 + 34?", "Count from 3 to 9.", "Hello"]},
    "heldout": {"raw": ["JULIET:\n", "MACBETH.\nThe night is", "Enter a Messenger.\n\nMESSENGER:\n",
                        "O, what a noble", "LADY CAPULET:\n", "DUKE.\nGood morrow", "OTHELLO:\n",
                        "Second Gentleman:\n"],
                "chat": ["What is 57 - 19?", "Count from 2 to 8.", "Who are you?", "What is 64 + 27?"]},
}


def sample(model, prompt: str, chat: bool, length: int, rng) -> list[int]:
    ids = (model.tokenizer.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
           if chat else model.tokenizer.encode(prompt))
    cache = model.new_cache(len(ids) + length)
    logits, out = model.forward(ids, cache), list(ids)
    for _ in range(length):
        p = np.exp((logits - logits.max()).astype(np.float64))
        out.append(int(rng.choice(len(p), p=p / p.sum())))
        logits = model.forward(out[-1:], cache)
    return out


def log_probs(model, seqs) -> np.ndarray:
    rows = []
    for s in seqs:
        x = model.forward(s, model.new_cache(len(s)), all_logits=True).astype(np.float64)
        x -= x.max(-1, keepdims=True)
        rows.append(x - np.log(np.exp(x).sum(-1, keepdims=True)))
    return np.concatenate(rows)


def compare(base, low, seqs) -> dict:
    ref, got = log_probs(base, seqs), log_probs(low, seqs)
    kl = (np.exp(ref) * (ref - got)).sum(-1)
    # row t of a sequence predicts its token t + 1
    starts = np.cumsum([0] + [len(s) for s in seqs[:-1]])
    rows = np.concatenate([start + np.arange(len(s) - 1) for start, s in zip(starts, seqs)])
    targets = np.concatenate([s[1:] for s in seqs])
    ppl = lambda lp: float(np.exp(-lp[rows, targets].mean()))  # noqa: E731
    return {"positions": len(ref), "kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
            "kl_max": float(kl.max()), "top1": float((ref.argmax(-1) == got.argmax(-1)).mean()),
            "ppl": ppl(got), "ppl_float32": ppl(ref)}


def additions(model, n: int = 100, seed: int = 0) -> int:
    rng, ok = random.Random(seed), 0
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        ok += ask(model, f"What is {a} + {b}?") == f"{a} + {b} = {a + b}."
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, choices=(8, 4), help="quantize the float model as it loads")
    ap.add_argument("--quantized", default=None, help="a ds2 quantize output; its float source is --model")
    ap.add_argument("--model", default=None, help="the float model (default ds2-tiny) or a reference case")
    ap.add_argument("--prompts", choices=sorted(PROMPTS), default="heldout")
    ap.add_argument("--length", type=int, default=400, help="tokens sampled per raw prompt (chat: a third)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nearest", action="store_true", help="round to nearest, as ds2 did before the scale search")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if (args.bits is None) == (args.quantized is None):
        ap.error("give one of --bits and --quantized")
    if args.nearest:
        nearest = scales.quantize
        scales.quantize = lambda w, f, importance=None, search=True: nearest(w, f, importance, search=False)
    base = ds2cli.load(args.model)
    low = ds2cli.load(args.quantized) if args.quantized else ds2cli.load(args.model, quantize=args.bits)
    bits = low.quantization.bits
    ref_file = Path(args.model or "", "ref.npz")
    if args.model and ref_file.is_file():
        r = compare(base, low, [np.load(ref_file)["ids"].tolist()])
        print(json.dumps(r) if args.json else
              f"{bits}-bit vs float32 over {r['positions']} positions: mean KL {r['kl_mean']:.3g}, top-1 agreement "
              f"{r['top1']:.1%}, perplexity {r['ppl']:.3f} vs {r['ppl_float32']:.3f}")
        return
    rng, report = np.random.default_rng(args.seed), {}
    for kind, prompts in PROMPTS[args.prompts].items():
        length = args.length if kind == "raw" else args.length // 3
        seqs = [sample(base, p, kind == "chat", length, rng) for p in prompts]
        report[kind] = compare(base, low, seqs)
    report["additions"] = additions(low)
    if args.json:
        print(json.dumps(report))
        return
    for kind in PROMPTS[args.prompts]:
        r = report[kind]
        print(f"{bits}-bit vs float32, {kind} ({args.prompts} prompts, {r['positions']} positions): mean KL "
              f"{r['kl_mean']:.3g} (p99 {r['kl_p99']:.3g}, max {r['kl_max']:.3g}), top-1 agreement {r['top1']:.1%}, "
              f"perplexity {r['ppl']:.3f} vs {r['ppl_float32']:.3f}")
    print(f"{bits}-bit two-digit additions: {report['additions']}/100")


if __name__ == "__main__":
    main()
