"""Ask ds2-tiny random two-digit additions through its chat template, greedily, and print
the accuracy: the end-to-end proof that the engine's math is right.

    python examples/arithmetic.py --n 100 --seed 0
"""

import argparse
import random

import numpy as np

import ds2cli


def ask(model, question: str, max_new_tokens: int = 24) -> str:
    ids = model.tokenizer.encode_chat([{"role": "user", "content": question}], add_generation_prompt=True)
    cache = model.new_cache(len(ids) + max_new_tokens)
    logits, out = model.forward(ids, cache), []
    for _ in range(max_new_tokens):
        token = int(np.argmax(logits))
        if token in model.eos_token_ids:
            break
        out.append(token)
        logits = model.forward([token], cache)
    return model.tokenizer.decode(out).strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    model, rng = ds2cli.load(args.model), random.Random(args.seed)
    correct = 0
    for _ in range(args.n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        answer = ask(model, f"What is {a} + {b}?")
        ok = answer == f"{a} + {b} = {a + b}."
        correct += ok
        if not ok:
            print(f"wrong: {a} + {b} -> {answer!r}")
    print(f"accuracy: {correct}/{args.n} = {100 * correct / args.n:.1f}%")


if __name__ == "__main__":
    main()
