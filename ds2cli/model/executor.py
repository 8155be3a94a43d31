"""The executor: what the math asks for when it has work, and where that work runs.

attention.py, moe.py and block.py are handed an executor (the Model's) and ask it for
  matmul_all(products)        independent products [(w, x)], computed together
  heads(w, x)                 a stack of per-head matrices applied head by head (linear.Heads)
  attend_latent(q_lat, ...)   one sequence's absorbed attention against its cache (attention.py)
  attend_expanded(q, ...)     one sequence's expanded attention against its cache
  experts(i, w, ids, xs, sh)  MoE layer i's routed experts `ids` over their rows, then its shared
                              experts over `sh`: their outputs, wherever the experts live
  after_attention(i, x)       layer i's attention is added to x (a streamed run reads ahead)
  after_layer(i, x)           layer i's output is x
and, for the pass as a whole (transformer.py, passes.py),
  forward_pass(tokens)        the context one pass of `tokens` tokens runs in
  run_pass(model, p)          one forward pass: its layers where they live (block.run_layers)
  start_pass(model, p)        run_pass begun: a call that waits for its logits; pipeline_depth()
                              passes may be under way at once (a cluster's stages)
  new_cache(model, n)         a latent cache of n positions, held where the layers are
The math states each piece whole; how it is cut (rows, heads, keys) and where it runs is the
executor's. This class is the reference: everything on the calling thread, in order, each
product through its weight's own `matmul`. ds2cli/execution composes the others from parts
(compute, experts, passes), never an edit to the math.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np

from ds2cli.model import attention
from ds2cli.model.cache import LatentCache
from ds2cli.model.moe import swiglu_all


class ReferenceCompute:
    """Products, heads and attention on the calling thread, in order, each product through its
    weight's own `matmul` (execution/compute.py builds the cores' on it)."""

    def matmul_all(self, products) -> list[np.ndarray]:
        """[w.matmul(x) for w, x in products], for products that do not depend on each other."""
        return [w.matmul(x) for w, x in products]

    def heads(self, w, x: np.ndarray) -> np.ndarray:
        return w.heads(x)

    def attend_latent(self, q_lat, q_pe, latent, k_pe, scale) -> np.ndarray:
        return attention.attend_latent(q_lat, q_pe, latent, k_pe, scale)

    def attend_expanded(self, q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale) -> np.ndarray:
        return attention.attend_expanded(q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale)


class ReferencePasses:
    """Every layer here, one pass at a time (execution/passes.py builds on it)."""

    def run_pass(self, model, p) -> np.ndarray | None:
        """Pass p through every layer, here: the picked rows' logits (M, V), or None."""
        return model.compute(p, range(model.config.num_hidden_layers))

    def pipeline_depth(self) -> int:
        """How many passes may be under way at once (start_pass): one here."""
        return 1

    def start_pass(self, model, p) -> Callable[[], np.ndarray | None]:
        """Pass p begun; the call returned waits for it and gives run_pass's logits. Here it
        runs at once."""
        logits = self.run_pass(model, p)
        return lambda: logits

    def new_cache(self, model, capacity: int):
        """A latent cache of `capacity` positions, held where the layers are."""
        cfg = model.config
        return LatentCache(cfg.num_hidden_layers, capacity, cfg.kv_lora_rank, cfg.qk_rope_head_dim)


class Lifecycle:
    """What is set up once the model's weights exist, released after, and reported meanwhile:
    nothing, here (the executor, and execution/'s parts, say otherwise)."""

    def start(self, model) -> None:
        """Called once the model's weights exist."""

    def stop(self) -> None:
        """Release what start set up."""

    def stats(self) -> dict:
        """What running the model cost beyond computing (a streamed run: experts read from disk)."""
        return {}

    def health(self) -> str | None:
        """None while everything the model runs on is there; else what is missing (a lost node)."""
        return None


class Executor(Lifecycle, ReferenceCompute, ReferencePasses):
    """Everything on the calling thread: the reference path for tests and readers."""

    def forward_pass(self, tokens: int):
        return contextlib.nullcontext()

    def experts(self, i: int, w, ids, xs, shared: np.ndarray | None) -> list[np.ndarray]:
        """MoE layer i's (weights w) routed experts `ids`, each over its rows xs[j] (moe.Routed),
        then its shared experts over `shared` (None: none): their outputs in that order."""
        tasks = [(x, w.experts_gate_up[e], w.experts_down[e]) for e, x in zip(ids, xs)]
        if shared is not None:
            tasks.append((shared, w.shared_gate_up, w.shared_down))
        return swiglu_all(self, tasks)

    def after_attention(self, i: int, x: np.ndarray) -> None:
        """Layer i's attention is added to x, the residual its MLP reads."""

    def after_layer(self, i: int, x: np.ndarray) -> None:
        """Layer i's output is x."""
