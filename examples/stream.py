"""Stream a completion token by token with the library API.

    python examples/stream.py "ROMEO:" --max-new-tokens 60
"""

import argparse
import sys

import numpy as np

import ds2cli


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt", nargs="?", default="ROMEO:\n")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: bundled ds2-tiny)")
    ap.add_argument("--max-new-tokens", type=int, default=60)
    args = ap.parse_args()

    model = ds2cli.load(args.model)
    ids = model.tokenizer.encode(args.prompt)
    cache = model.new_cache(len(ids) + args.max_new_tokens)
    decoder = model.tokenizer.stream_decoder()     # holds back half-finished UTF-8 characters

    logits = model.forward(ids, cache)             # prefill: the whole prompt in one pass
    sys.stdout.write(args.prompt)
    for _ in range(args.max_new_tokens):
        token = int(np.argmax(logits))             # greedy
        if token in model.eos_token_ids:
            break
        sys.stdout.write(decoder.push(token))
        sys.stdout.flush()
        if cache.free == 0:
            break
        logits = model.forward([token], cache)     # decode: one token against the latent cache
    sys.stdout.write(decoder.flush() + "\n")


if __name__ == "__main__":
    main()
