"""A stage's experts spread over a Ray cluster's nodes (--ray-spread experts): each node holds a
contiguous range of every MoE layer's routed experts (cluster/placement.plan_experts), and the
stage computing a MoE layer sends each other node the hidden rows of the tokens routed to its
experts, one call a node and a layer, all of them at once, computes its own experts and the
shared ones meanwhile (its local experts part: resident or streamed), then waits.

The math is the same as on one process: moe.py routes, asks its executor for the experts'
outputs, and sums them in expert order; only where each expert runs changes, so the logits
equal one process's within float rounding. A node answers with each expert's output over its
tokens, concatenated; the asking stage splits them again, in the order moe.py asked for them.
"""

from __future__ import annotations

import time

import numpy as np

from ds2cli.execution.experts import Experts


def empty_traffic() -> dict:
    """What a stage's expert calls cost: calls made, bytes of hidden rows sent and of outputs
    received, seconds the stage waited for them after computing its own experts."""
    return {"expert_calls": 0, "expert_bytes": 0, "expert_seconds": 0.0}


class RemoteExperts(Experts):
    """A stage's experts part when the model is spread by experts: a MoE layer's routed experts
    where the placement put them, this node's own (`own`, stacked from 0 in its weights)
    computed by its `local` experts part (resident, or streamed), the others' asked of their
    nodes' stage actors."""

    def __init__(self, own: range, local: Experts | None = None):
        self.own = own                       # the routed experts this node holds (of every MoE layer)
        self.local = local or Experts()
        self.peers: list[tuple[range, object]] = []    # (experts, stage actor) of every other node
        self.traffic = empty_traffic()

    def start(self, model, compute) -> None:
        super().start(model, compute)
        self.local.start(model, compute)

    def stop(self) -> None:
        self.local.stop()

    def stats(self) -> dict:
        return self.local.stats()

    def forward_pass(self) -> None:
        self.local.forward_pass()

    def connect(self, peers: list[tuple[range, object]]) -> None:
        self.peers = [(r, a) for r, a in peers if len(r)]

    def take_traffic(self) -> dict:
        out, self.traffic = self.traffic, empty_traffic()
        return out

    def run(self, layer: int, w, ids, xs, shared: np.ndarray | None) -> list[np.ndarray]:
        import ray
        ids = np.asarray(ids, dtype=np.int64)
        calls = []
        for experts, actor in self.peers:
            sel = np.flatnonzero((ids >= experts.start) & (ids < experts.stop))
            if not len(sel):
                continue
            rows, where = unique_rows(xs, sel)
            calls.append((sel, [len(wh) for wh in where],
                          actor.experts.remote(layer, ids[sel] - experts.start, rows, where)))
            self.traffic["expert_calls"] += 1
            self.traffic["expert_bytes"] += rows.nbytes + sum(len(wh) for wh in where) * rows.shape[1] * 4
        mine = np.flatnonzero((ids >= self.own.start) & (ids < self.own.stop))
        local = self.local.run(layer, w, ids[mine] - self.own.start, [xs[j] for j in mine], shared) \
            if len(mine) or shared is not None else []
        outs: list = [None] * len(ids)
        for j, y in zip(mine, local):
            outs[j] = y
        if calls:
            t0 = time.perf_counter()
            answers = ray.get([ref for _, _, ref in calls])
            self.traffic["expert_seconds"] += time.perf_counter() - t0
            for (sel, sizes, _), y in zip(calls, answers):
                for j, part in zip(sel, np.split(y, np.cumsum(sizes)[:-1])):
                    outs[j] = part
        missing = [int(ids[j]) for j in range(len(ids)) if outs[j] is None]
        if missing:
            raise RuntimeError(f"no node holds experts {missing[:8]} of layer {layer}")
        return outs + (local[len(mine):] if shared is not None else [])

    def answer(self, layer: int, w, ids: np.ndarray, rows: np.ndarray, where: list[np.ndarray]) -> np.ndarray:
        """On the node holding them, for another node: its experts `ids` (counted from its
        first) of MoE layer `layer` (weights w), expert j over rows[where[j]], their outputs
        concatenated in that order."""
        return np.concatenate(self.local.run(layer, w, ids, [rows[wh] for wh in where], None))


def unique_rows(xs, sel: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """The distinct rows the experts `sel` read, once each, and where each expert's rows are in
    them: a token routed to two experts of a node travels there once."""
    tokens = getattr(xs, "tokens", None)
    if tokens is None:                       # rows given as arrays: sent as they are
        parts = [np.asarray(xs[j], np.float32) for j in sel]
        sizes = np.cumsum([0] + [len(p) for p in parts])
        return np.concatenate(parts), [np.arange(sizes[i], sizes[i + 1]) for i in range(len(parts))]
    picked = np.unique(np.concatenate([tokens[j] for j in sel]))
    return np.ascontiguousarray(xs.x[picked], np.float32), [np.searchsorted(picked, tokens[j]) for j in sel]
