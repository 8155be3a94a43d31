"""`ds2 bench --profile`: where a decode step's time goes. Decode steps run with timers around
the products (by storage format: this process's part of their rows, in the call or in the units
of a plan it takes), the coordination with the helpers (writing a plan and its inputs, taking
each unit from the claims pipe, waiting for the units they took and reading their rows back),
attention and the router, each counted exclusive of what it calls; the rest of the step is the
Python between them. The sum is the step's measured time. Each product row also gives the rate
of ds2's own kernels, the weights its products multiplied a second (G w/s, all cores: the
rate of this process's own row spans, timed while the helpers run theirs, times the processes;
the units go to whoever is free, so one process's part of a format is not its share of the
cores), to set beside the ceiling probe's.

The timers wrap the classes' methods (Dense.matmul, QuantMatrix.matmul and .span, the helpers'
send, claim and finish) and the model module's functions for the duration of the profile only, so
the engine carries no instrumentation."""

from __future__ import annotations

import contextlib
import time

from ds2cli.cli.bench.accounting import storage_format
from ds2cli.cli.bench.probes import probe_step_shapes
from ds2cli.execution import helpers
from ds2cli.execution.compute import CoreCompute
from ds2cli.execution.cores import Workers
from ds2cli.model import block, linear, moe
from ds2cli.model.transformer import Model
from ds2cli.weights import formats


class Clock:
    """Exclusive time by label: a region's time less the regions timed inside it."""

    def __init__(self):
        self.spent: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.values: dict[str, float] = {}   # weights multiplied, by label (products)
        self.own: dict[str, float] = {}      # ... in this process's own row spans, x the processes
        self.weights: list = []              # the weight of each product, in order
        self.stack: list[list] = []          # [label, start, time of the regions inside]
        self.products = 0                    # product calls open: one inside another is its
                                             # product's, counted once

    def timed(self, label_of, fn, values_of=None, count: bool = True, own_of=None):
        """fn timed under label_of(*args), exclusive of the timed regions inside it; a call
        counted where `count`, values_of(*args) weights added to the label's (a product, asked
        of the compute part: (compute, w, x); its weight recorded too) and own_of(*args)
        to its own where given."""
        def run(*args, **kwargs):
            label = label_of(*args)
            outer = not (values_of is not None and self.products)
            if count and outer:
                self.calls[label] = self.calls.get(label, 0) + 1
            if values_of is not None and outer:
                self.values[label] = self.values.get(label, 0.0) + values_of(*args)
                self.weights.append(args[1])
            if own_of is not None:
                self.own[label] = self.own.get(label, 0.0) + own_of(*args)
            self.stack.append([label, time.perf_counter(), 0.0])
            self.products += values_of is not None
            try:
                return fn(*args, **kwargs)
            finally:
                self.products -= values_of is not None
                lab, t0, inner = self.stack.pop()
                took = time.perf_counter() - t0
                self.spent[lab] = self.spent.get(lab, 0.0) + took - inner
                if self.stack:
                    self.stack[-1][2] += took
        return run


def product_label(_executor, w, *_) -> str:
    return f"products {storage_format(w)}"


def product_values(_compute, w, x) -> float:
    return len(x) * w.shape[-1] * w.shape[-2]


def span_label(w, *_) -> str:
    return f"products {storage_format(w)}"


def span_values(pool: Workers):
    """A row span's weights x tokens, times the processes that run a plan's units meanwhile:
    this process's rate on its own units while every core works, scaled to all the cores."""
    def values(m, x, y, a: int, b: int) -> float:
        return (b - a) * (x.size // x.shape[-1]) * m.shape[-1] * min(pool.n, pool.using)
    return values


COORDINATION = "coordination: plans sent, helpers awaited"


@contextlib.contextmanager
def instrumented(clock: Clock, pool: Workers):
    """The timers in place for the block (`pool`: the cores of the model profiled), the
    originals restored after."""
    patches = [(CoreCompute, "start_product", product_label, product_values, True, None),
               (CoreCompute, "heads", product_label, product_values, True, None),            # w_uk, w_uv
               (formats.QuantMatrix, "span", span_label, None, False, span_values(pool)),  # the calls are the products'
               (linear.Heads, "span", span_label, None, False, span_values(pool)),
               (helpers.Helpers, "send", lambda *a: COORDINATION, None, True, None),
               (helpers.Helpers, "finish", lambda *a: COORDINATION, None, False, None),   # a plan: send's
               (helpers.Helpers, "claim", lambda *a: COORDINATION, None, False, None),    # each unit taken
               (block, "mla", lambda *a: "attention (latent cache, heads)", None, True, None),
               (moe, "route", lambda *a: "router", None, True, None)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, *_ in patches]
    try:
        for owner, name, label, values, count, own in patches:
            setattr(owner, name, clock.timed(label, getattr(owner, name), values, count, own))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


# The last few profiled steps' matrices are replayed by the step-shapes probe (probes.py):
# enough steps that their routed experts are a fair sample, few enough to take seconds.
REPLAY_STEPS = 4


def unmultiplied(model: Model) -> list:
    """The weights a decode step reads outside the products: each MoE layer's router gate."""
    return [layer.mlp.gate for layer in model.layers if layer.is_moe]


def profile_decode(model: Model, cache, context: int, steps: int, rng) -> dict:
    """Seconds a decode step spends where, over `steps` steps after `context` tokens; then plain
    NumPy over the last steps' own matrices (probes.probe_step_shapes), for the rates ds2's
    kernels could reach at those shapes."""
    clock = Clock()
    cache.truncate(context)
    ids = rng.integers(model.config.vocab_size, size=steps)
    marks = []
    with instrumented(clock, model.executor.compute.machine.workers):
        t0 = time.perf_counter()
        for token in ids:
            marks.append(len(clock.weights))
            model.forward(token[None], cache)
        total = time.perf_counter() - t0
    cache.truncate(context)
    rows = [{"what": label, "per_step_s": s / steps, "share": s / total,
             "calls_per_step": clock.calls[label] / steps if clock.calls.get(label) else None}
            | ({"g_weights_per_s": (clock.own.get(label) or clock.values[label]) / s / 1e9}
               if label in clock.values and s > 0 else {})
            for label, s in sorted(clock.spent.items(), key=lambda kv: -kv[1])]
    rest = total - sum(clock.spent.values())
    rows.append({"what": "the rest: Python between them (norms, residuals, routing's gathers)",
                 "per_step_s": rest / steps, "share": rest / total, "calls_per_step": None})
    replayed = min(REPLAY_STEPS, steps)
    matrices = clock.weights[marks[-replayed]:] + unmultiplied(model) * replayed
    return {"context": context, "steps": steps, "step_s": total / steps, "rows": rows,
            "numpy_at_step_shapes": probe_step_shapes(matrices, replayed)}
