"""A model's logits over a prompt fed a token at a time, then greedy one-token steps: the
decode steps whose products the helper processes share (tests/parallel)."""

import numpy as np


def decode(model, ids, steps=6):
    """Logits of the prompt fed a token at a time, then of each of `steps` greedy one-token steps:
    one-token steps split each matvec into the same spans with helpers as with threads."""
    cache = model.new_cache(64)
    for token in ids[:-1]:
        model.forward([token], cache)
    out = [model.forward(ids[-1:], cache)]
    for _ in range(steps):
        out.append(model.forward([int(out[-1].argmax())], cache))
    return np.stack(out)
