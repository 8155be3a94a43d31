"""The compute part: products, heads and attention's pieces, on the calling thread (`Compute`, the
reference) or over this machine's cores and helper processes (`CoreCompute`).

How the math's requests map onto the cores (cores.py, helpers.py):
  - a product goes as its weight's rows (`w.product(x)`, linear.Rows) to `Workers.split`: in a
    few-token low-bit pass between this process and the helpers, in one plan with the products
    asked for together; in a long pass between threads, or whole on one thread inside a part;
    a float32 weight's product is one BLAS call on BLAS's own threads;
  - a sequence's attention is cut by heads across the cores in a long low-bit pass, and a long
    cache's keys across the cores in a few-token one (their running sums merge: attention.merge_sums).
`start(model)` enters every weight of the model in the machine's registry, then forks the helpers.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ds2cli.execution.machine import Machine
from ds2cli.model import attention
from ds2cli.model.executor import ReferenceCompute
from ds2cli.model.linear import Rows


class Compute(ReferenceCompute):
    """Everything on the calling thread, in order: each product through its weight's `matmul`
    (the reference's products, heads and attention, model/executor.py)."""

    def start(self, model) -> None:
        """The model's weights exist: set up what the products run on."""

    def stop(self) -> None:
        """Release what start set up."""

    def forward_pass(self, tokens: int):
        return contextlib.nullcontext()

    def helper_bytes(self) -> int:
        """Resident memory of helper processes that this one does not also map: none here."""
        return 0


class CoreCompute(Compute):
    """This machine's cores (a Machine): a thread pool and, over low-bit weights, helper processes."""

    def __init__(self, machine: Machine):
        self.machine = machine
        self.low_bit = False

    def start(self, model) -> None:
        """Name the model's weights to the helper processes and fork them (low-bit weights only:
        float32 products run on BLAS's own threads)."""
        self.low_bit = model.quantization is not None
        if self.low_bit:
            self.machine.register(model_weights(model))
            self.machine.start_helpers()

    def stop(self) -> None:
        self.machine.stop_helpers()

    def forward_pass(self, tokens: int):
        return self.machine.forward_pass(self.low_bit, tokens)

    def helper_bytes(self) -> int:
        return self.machine.helper_private_bytes()

    def matmul_all(self, products) -> list[np.ndarray]:
        workers = self.machine.workers
        with workers.together():
            outs = workers.map_costliest(lambda p: self.start_product(*p), products,
                                         [len(x) * w.shape[-1] * w.shape[-2] for w, x in products])
        return [o.result() if isinstance(o, Rows) else o for o in outs]

    def start_product(self, w, x: np.ndarray):
        """The product started: its Rows (complete when the `together` block ends) or its array."""
        p = w.product(x) if hasattr(w, "product") else None
        if p is None:
            return w.matmul(x)
        self.machine.workers.split(p)
        return p

    def heads(self, w, x: np.ndarray) -> np.ndarray:
        p = w.product(x)
        if self.machine.workers.held:
            self.machine.workers.split(p)   # a low-bit pass: its heads shared out like any product's rows
        else:
            p.span(0, p.rows)               # float32 weights: one batched product, BLAS on its own threads
        return p.result()

    def attend_latent(self, q_lat, q_pe, latent, k_pe, scale) -> np.ndarray:
        """attention.attend_latent, its heads over the cores in a long pass, and within them a
        long cache's keys over the cores in a few-token one (their running sums merged)."""
        T, H, C = q_lat.shape
        workers = self.machine.workers

        def heads(h: slice) -> np.ndarray:
            parts = workers.spread(lambda keys: attention.absorbed_sums(q_lat[:, h], q_pe[:, h], latent, k_pe,
                                                                        scale, keys),
                                   workers.key_slices(len(latent), T))
            _, l, acc = attention.merge_sums(parts)
            return (acc / l[:, None]).reshape(T, h.stop - h.start, C)     # (T, h, C)
        outs = workers.map(heads, workers.heads(H, T))
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=1)   # (T, H, C)

    def attend_expanded(self, q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale) -> np.ndarray:
        """attention.attend_expanded, its heads over the cores in a long pass."""
        workers = self.machine.workers
        outs = workers.map(lambda h: attention.attend_expanded(q_nope[:, h], q_pe[:, h], latent, k_pe,
                                                               w_uk[h], w_uv[h], scale),
                           workers.heads(q_nope.shape[1], len(q_nope)))
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=1)   # (T, H, v)


def model_weights(model):
    """Every weight object of a model: the embedding, the head, each layer's parts' values (a
    node of a cluster holds some of them: the rest are None)."""
    yield from (w for w in (model.embed_tokens, model.lm_head) if w is not None)
    for layer in model.layers:
        for _, part in layer.parts() if layer is not None else ():
            for w in part.values():     # a weight whose data lives elsewhere names what holds it
                yield from getattr(w, "stacks", (w,))
