"""`ds2 bench --profile`: where a decode step's time goes. Decode steps run with timers around
the products (by storage format and shape, the helper processes' messages and waits inside
them), attention, the router and the embedding and head, each counted exclusive of what it
calls; the rest of the step is the Python between them. The sum is the step's measured time.

The timers wrap the classes' methods (Dense.matmul, QuantMatrix.matmul) and the model module's
functions for the duration of the profile only, so the engine carries no instrumentation."""

from __future__ import annotations

import contextlib
import time

from ds2cli.cli.bench.accounting import storage_format
from ds2cli.model import linear, moe, transformer
from ds2cli.model.transformer import Model
from ds2cli.weights import quant


class Clock:
    """Exclusive time by label: a region's time less the regions timed inside it."""

    def __init__(self):
        self.spent: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[list] = []          # [label, start, time of the regions inside]

    def timed(self, label_of, fn):
        def run(*args, **kwargs):
            label = label_of(*args)
            self.stack.append([label, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                lab, t0, inner = self.stack.pop()
                took = time.perf_counter() - t0
                self.spent[lab] = self.spent.get(lab, 0.0) + took - inner
                self.calls[lab] = self.calls.get(lab, 0) + 1
                if self.stack:
                    self.stack[-1][2] += took
        return run


def product_label(w, x) -> str:
    kind = "1 token" if len(x) == 1 else f"{len(x)} tokens"
    return f"products {storage_format(w)} ({kind})"


@contextlib.contextmanager
def instrumented(clock: Clock):
    """The timers in place for the block, the originals restored after."""
    patches = [(linear.Dense, "matmul", lambda self, x: product_label(self, x)),
               (quant.QuantMatrix, "matmul", lambda self, x: product_label(self, x)),
               (transformer, "mla", lambda *a: "attention (latent cache, heads)"),
               (moe, "route", lambda *a: "router")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, label in patches:
            setattr(owner, name, clock.timed(label, getattr(owner, name)))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def profile_decode(model: Model, cache, context: int, steps: int, rng) -> dict:
    """Seconds a decode step spends where, over `steps` steps after `context` tokens."""
    clock = Clock()
    cache.truncate(context)
    ids = rng.integers(model.config.vocab_size, size=steps)
    with instrumented(clock):
        t0 = time.perf_counter()
        for token in ids:
            model.forward(token[None], cache)
        total = time.perf_counter() - t0
    cache.truncate(context)
    rows = [{"what": label, "per_step_s": s / steps, "share": s / total, "calls_per_step": clock.calls[label] / steps}
            for label, s in sorted(clock.spent.items(), key=lambda kv: -kv[1])]
    rest = total - sum(clock.spent.values())
    rows.append({"what": "the rest: Python between them (norms, residuals, routing's gathers)",
                 "per_step_s": rest / steps, "share": rest / total, "calls_per_step": None})
    return {"context": context, "steps": steps, "step_s": total / steps, "rows": rows}
