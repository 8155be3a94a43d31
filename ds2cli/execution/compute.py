"""The default executor: the math's parallel work over this machine's cores and the forked
helper processes (cores.py, processes.py), as `ds2cli.load` gives it to a Model.

What the math asks (model/executor.py) maps onto the cores so:
  - a product goes as its weight's rows (`w.product(x)`, linear.Rows) to `Workers.split`: in a
    few-token low-bit pass between this process and the helpers, in one plan with the products
    asked for together; in a long pass between threads, or whole on one thread inside a part;
    a float32 weight's product is one BLAS call on BLAS's own threads;
  - MLA's q and its fold through W_UK (a product with heads) go as one AbsorbedQuery;
  - independent items (experts, heads, attention's pieces) are shared across threads in a long
    low-bit pass (`cores.map`), a long cache's keys over the cores in a few-token one.
`start(model)` gives every weight of the model a key the helpers know it by, then forks them.
"""

from __future__ import annotations

import numpy as np

from ds2cli.model.executor import Executor
from ds2cli.model.linear import Rows
from ds2cli.parallel import cores
from ds2cli.parallel import processes
from ds2cli.parallel.absorbed import AbsorbedQuery


class CoreExecutor(Executor):
    """This machine's cores: a thread pool and, over low-bit weights, helper processes."""

    def __init__(self):
        self.low_bit = False

    def start(self, model) -> None:
        """Register the model's weights with the helper processes and fork them (low-bit
        weights only: float32 products run on BLAS's own threads)."""
        self.low_bit = model.quantization is not None
        if self.low_bit:
            processes.start_helpers(model_weights(model))

    def stop(self) -> None:
        processes.stop_helpers_now()

    def forward_pass(self, tokens: int):
        return cores.forward_pass(low_bit=self.low_bit, tokens=tokens)

    def matmul_all(self, products) -> list[np.ndarray]:
        products = [tuple(p) + (None,) * (3 - len(p)) for p in products]
        pool = cores.workers()
        # a fold that cannot be one product is q's product, then the heads': after the block
        chained = [p[2] is not None and not (pool.held and AbsorbedQuery.fits(p[0], p[2])) for p in products]
        with cores.together():
            outs = cores.map(lambda p: None if chained[p[0]] else self.start_product(*p[1]),
                             list(enumerate(products)), cost=[len(x) * w.shape[-1] * w.shape[-2] for w, x, _ in products])
        outs = [o.result() if isinstance(o, Rows) else o for o in outs]
        for j, (w, x, heads) in enumerate(products):
            if chained[j]:
                outs[j] = self.fold(w, x, heads)
        return outs

    def start_product(self, w, x: np.ndarray, heads=None):
        """The product started: its Rows (complete when the `together` block ends) or its array."""
        if heads is not None:
            m = AbsorbedQuery(w, heads)
            p = Rows(m, np.ascontiguousarray(x, np.float32), np.empty((len(x), m.shape[0]), np.float32),
                     align=m.align, depth=m.depth)
        else:
            p = w.product(x) if hasattr(w, "product") else None
            if p is None:
                return w.matmul(x)
        cores.workers().split(p)
        return p

    def heads(self, w, x: np.ndarray) -> np.ndarray:
        p = w.product(x)
        if cores.workers().held:
            cores.workers().split(p)    # a low-bit pass: its heads shared out like any product's rows
        else:
            p.span(0, p.rows)           # float32 weights: one batched product, BLAS on its own threads
        return p.result()

    def map(self, fn, items, cost=None) -> list:
        return cores.map(fn, items, cost)

    def split(self, n: int, tokens: int) -> list[slice]:
        return cores.split(n, tokens)

    def split_keys(self, S: int, tokens: int) -> list[slice]:
        return cores.split_keys(S, tokens)

    def spread(self, fn, items) -> list:
        return cores.spread(fn, items)


def model_weights(model):
    """Every weight object of a model: the embedding, the head, each layer's parts' values (a
    node of a cluster holds some of them: the rest are None)."""
    yield from (w for w in (model.embed_tokens, model.lm_head) if w is not None)
    for layer in model.layers:
        for _, part in layer.parts() if layer is not None else ():
            for w in part.values():     # a weight whose data lives elsewhere names what holds it
                yield from getattr(w, "stacks", (w,))
