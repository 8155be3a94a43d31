"""The executor: what the math asks for when it has work that may run at once, and where it runs.

attention.py, moe.py and transformer.py are handed an executor (the Model's) and ask it for
  matmul_all(products)   independent products [(w, x)] or [(w, x, heads)] computed together
  heads(w, x)            a stack of per-head matrices applied head by head (linear.Heads)
  map(fn, items, cost)   [fn(item) for item in items] for independent items (attention's pieces)
  split(n, tokens)       [0, n) as slices that may run at once (heads of a long pass)
  split_keys(S, tokens)  a cache's positions [0, S) as slices whose running sums merge (spread)
  spread(fn, items)      [fn(item) for item in items], an item a core
  experts(w, ...)        one MoE layer's routed experts (and shared ones) over their tokens
  run_pass(model, p)     one forward pass (transformer.Pass): its layers where they live,
                         model.compute(p, layers, x) for each range; `after_attention(i, x)` and
                         `after_layer(i, x)` in each layer
  start_pass(model, p)   run_pass begun: a call that waits for its logits; pipeline_depth()
                         passes may be under way at once (a cluster's stages, each busy with
                         another pass), 1 where run_pass is all there is
  new_cache(model, n)    a latent cache of n positions, held where the layers are
  forward_pass(tokens)   the context one pass of `tokens` tokens runs in
and know nothing of threads, processes, machines or where a weight lives. This class is the
reference: everything on the calling thread, in order, each product through its weight's own
`matmul`. parallel/executor.py shares the same work over the cores and helper processes; a
cluster or a run that streams experts from disk is another subclass, never an edit to the math.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np

from ds2cli.model.cache import LatentCache


class Executor:
    """Everything on the calling thread: the reference path for tests and readers."""

    def start(self, model) -> None:
        """Called once the model's weights exist (ds2cli.load): nothing to set up here."""

    def stop(self) -> None:
        """Release what start set up."""

    def stats(self) -> dict:
        """What running the model cost beyond computing (a streamed run: experts read from disk)."""
        return {}

    def health(self) -> str | None:
        """None while everything the model runs on is there; else what is missing (a lost node)."""
        return None

    def forward_pass(self, tokens: int):
        return contextlib.nullcontext()

    def matmul_all(self, products) -> list[np.ndarray]:
        """[w.matmul(x) for w, x in products], for products that do not depend on each other.
        A product (w, x, heads) is w's output read as H heads, each followed by heads[h] over its
        first n_in values (MLA's q and its fold through W_UK): the result holds, head by head,
        the product's own values and then the fold's, (T, H*(width+n_out))."""
        return [self.product(*p) for p in products]

    def product(self, w, x: np.ndarray, heads=None) -> np.ndarray:
        return w.matmul(x) if heads is None else self.fold(w, x, heads)

    def fold(self, w, x: np.ndarray, heads) -> np.ndarray:
        """The product (w, x, heads) as two: w's, then each head's first n_in values through
        heads[h], both asked of this executor."""
        H, n_in, n_out = heads.w.shape
        q = self.matmul_all([(w, x)])[0].reshape(len(x), H, -1)            # (T, H, width)
        folded = self.heads(heads, q[..., :n_in])                           # (T, H, n_out)
        return np.concatenate([q, folded], axis=-1).reshape(len(x), -1)     # (T, H*(width+n_out))

    def heads(self, w, x: np.ndarray) -> np.ndarray:
        return w.heads(x)

    def map(self, fn: Callable, items, cost=None) -> list:
        return [fn(item) for item in items]

    def split(self, n: int, tokens: int) -> list[slice]:
        return [slice(0, n)]

    def split_keys(self, S: int, tokens: int) -> list[slice]:
        return [slice(0, S)]

    def spread(self, fn: Callable, items) -> list:
        return [fn(item) for item in items]

    def experts(self, w, ids, xs, shared: np.ndarray | None, ffn: Callable) -> list[np.ndarray]:
        """MoE layer w's routed experts `ids`, each over its tokens xs[j] (a sequence of arrays;
        moe.Routed also says which rows of the layer's input they are), then its shared
        experts over `shared` (None: none): ffn(self, [(x, gate_up, down), ...]) computes a list
        of such MLPs. Where each expert runs is the executor's: here, all of them, at once."""
        tasks = [(x, w.experts_gate_up[e], w.experts_down[e]) for e, x in zip(ids, xs)]
        if shared is not None:
            tasks.append((shared, w.shared_gate_up, w.shared_down))
        return ffn(self, tasks)

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
        cfg = model.config
        return LatentCache(cfg.num_hidden_layers, capacity, cfg.kv_lora_rank, cfg.qk_rope_head_dim)

    def after_attention(self, i: int, x: np.ndarray) -> None:
        """Layer i's attention is added to x, the residual its MLP reads (a streamed run
        guesses from it what the next layer's experts will be and reads them ahead)."""

    def after_layer(self, i: int, x: np.ndarray) -> None:
        """Layer i's output is known (a streamed run reads the next layer's experts ahead)."""
