"""A model that writes a given reply: the real forward pass runs (the caches, the scheduler, the
timings are what they always are), then each row of logits is replaced by one that makes the
reply's next token certain, and eos after its last. The tests of reasoning use it to make
ds2-tiny "write" `<think>...</think>answer`, which it was never trained to.

Which token comes next is read from the tokens the sequence's cache holds: the longest tail of
them that is a beginning of the reply says how much of it is written (so it works for any
prompt, every turn of a chat, and a cache that the server's prompt cache hands on)."""

from __future__ import annotations

import weakref

import numpy as np

from ds2cli.model.transformer import Model

CERTAIN = 30.0       # the scripted token's logit; every other token's is -CERTAIN


class Script:
    def __init__(self, reply: str):
        self.reply = reply
        self.fed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # cache -> the tokens it holds
        self.ids: list[int] | None = None

    def install(self, monkeypatch) -> "Script":
        """Every Model of this process writes the reply until the test ends."""
        real = Model.forward_batch
        script = self

        def forward_batch(model, steps, *args, **kwargs):
            for s in steps:                 # what each cache will hold; a copied prefix is unknown (-1)
                held = script.fed.get(s.cache, [])[:s.cache.length]
                script.fed[s.cache] = held + [-1] * (s.cache.length - len(held)) + [int(t) for t in s.ids]
            rows = real(model, steps, *args, **kwargs)
            return [script.rewrite(model, s, r) for s, r in zip(steps, rows)]

        monkeypatch.setattr(Model, "forward_batch", forward_batch)
        return self

    def rewrite(self, model: Model, step, rows: np.ndarray | None) -> np.ndarray | None:
        if rows is None:
            return None
        if self.ids is None:
            self.ids = model.tokenizer.encode(self.reply, add_special_tokens=False)
        seq = self.fed[step.cache]
        if rows.ndim == 1:
            return self.row(model, seq, rows)
        start = len(seq) - len(rows)        # "all": row i follows the first start + i + 1 tokens
        return np.stack([self.row(model, seq[:start + i + 1], r) for i, r in enumerate(rows)])

    def row(self, model: Model, seq: list[int], row: np.ndarray) -> np.ndarray:
        ids = self.ids
        written = max(k for k in range(min(len(ids), len(seq)) + 1) if k == 0 or seq[-k:] == ids[:k])
        token = ids[written] if written < len(ids) else model.eos_token_ids[0]
        out = np.full_like(row, -CERTAIN)
        out[token] = CERTAIN
        return out
