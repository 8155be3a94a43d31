"""Which node of a cluster holds which decoder layers: planned from each node's memory with the
same per-layer accounting as the memory check (weights/memory.py), before anything loads.

Each node holds a contiguous range of layers and its part of every latent cache; the first also
the embedding, the last the final norm and the head. Layers go to the nodes in order, each node
a share of them in proportion to the memory it offers, so every node is about as full as the
others; a node offered too little for one layer holds none. Nothing here knows of Ray: a node is
what its probe reported (cluster/ray_cluster.py asks each one).

Spread by experts (plan_experts), every node also holds a contiguous range of each MoE layer's
routed experts, in proportion to what it offers, and of its layers everything but their routed
experts: the layer ranges are shared out by what is left of each layer (attention, norms, the
router, the shared experts, a dense layer's MLP, its part of the cache).
"""

from __future__ import annotations

import dataclasses

from ds2cli.errors import Ds2Error
from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights import memory
from ds2cli.weights.qcheckpoint import QuantConfig


class PlacementError(Ds2Error):
    """The cluster cannot hold the model, or a node cannot take part."""


@dataclasses.dataclass(frozen=True)
class Node:
    """One node as its probe saw it: where it is, what it offers ds2, what it runs."""
    node_id: str
    address: str
    cpus: int
    available: int | None        # bytes a new process may take there (DS2_MEMORY_AVAILABLE, else MemAvailable)
    ds2_version: str = ""
    ray_version: str = ""
    python: str = ""
    problem: str = ""            # why it cannot take part ("" when it can)

    @property
    def name(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"


@dataclasses.dataclass(frozen=True)
class Stage:
    node: Node
    layers: range
    need: dict                   # memory.required for this range: weights, cache, working, margin, total
    experts: range | None = None  # spread by experts: the routed experts it holds of every MoE layer

    def describe(self, num_layers: int) -> str:
        first, last = self.layers.start, self.layers.stop - 1
        extra = (["embedding"] if first == 0 else []) + (["norm and head"] if last == num_layers - 1 else [])
        n = self.need
        offered = memory.gb(self.node.available) if self.node.available is not None else "unknown"
        held = f"layers {first}-{last}{' + ' + ', '.join(extra) if extra else ''}" if len(self.layers) else "no layers"
        if self.experts is not None:
            held += (f", experts {self.experts.start}-{self.experts.stop - 1} of each MoE layer" if len(self.experts)
                     else ", no experts")
        return (f"{self.node.name}: {held}, "
                f"weights {memory.gb(n['weights'])}, cache {memory.gb(n['cache'])} at {n['context']} tokens, "
                f"needs {memory.gb(n['total'])} of {offered}, {self.node.cpus} CPUs")


@dataclasses.dataclass(frozen=True)
class Placement:
    stages: list[Stage]
    idle: list[Node]             # nodes that hold nothing (too little memory, or not needed)

    def lines(self, num_layers: int) -> list[str]:
        out = [s.describe(num_layers) for s in self.stages]
        out += [f"{n.name}: holds nothing ({memory.gb(n.available or 0)} offered)" for n in self.idle]
        return out

    @property
    def spread(self) -> str:
        return "experts" if any(s.experts is not None for s in self.stages) else "layers"

    def to_json(self) -> list[dict]:
        """Each node's share; spread by experts, with its range of routed experts (first_expert,
        last_expert: null when it holds none) and maybe no layers (first_layer > last_layer)."""
        out = []
        for s in self.stages:
            d = {"node_id": s.node.node_id, "address": s.node.address, "first_layer": s.layers.start,
                 "last_layer": s.layers.stop - 1, "cpus": s.node.cpus, "available_bytes": s.node.available}
            if s.experts is not None:
                d["first_expert"] = s.experts.start if len(s.experts) else None
                d["last_expert"] = s.experts.stop - 1 if len(s.experts) else None
            out.append({**d, **{f"{k}_bytes" if k != "context" else k: v for k, v in s.need.items()}})
        return out


def check_nodes(nodes: list[Node], ds2_version: str, ray_version: str) -> None:
    """One error naming each node that cannot take part: a problem its probe found (no
    checkpoint at the path), another ds2 or Ray version than the driver's."""
    bad = []
    for n in nodes:
        if n.problem:
            bad.append(f"node {n.name}: {n.problem}")
        elif n.ds2_version != ds2_version:
            bad.append(f"node {n.name} runs ds2 {n.ds2_version}, the driver {ds2_version}")
        elif n.ray_version != ray_version:
            bad.append(f"node {n.name} runs Ray {n.ray_version}, the driver {ray_version}")
    if bad:
        raise PlacementError("; ".join(bad))


def plan(cfg: DeepseekV2Config, qc: QuantConfig | None, context: int | None, nodes: list[Node],
         quantize_at_load: bool = False, name: str = "the model") -> Placement:
    """Contiguous layer ranges over `nodes` (in their order), each node's share of the layers in
    proportion to what it offers, every range checked with memory.required; a PlacementError
    saying what is missing when the nodes together cannot hold the model."""
    L = cfg.num_hidden_layers
    if not nodes:
        raise PlacementError("the cluster has no node with CPUs to place the model on")

    def need(layers: range) -> dict:
        return memory.required(cfg, qc, context, quantize_at_load, layers)

    def offered(n: Node) -> int:
        return n.available if n.available is not None else 1 << 62   # unknown: not limited by ds2

    # the bytes a layer costs where it lives (its weights and its part of the cache), for shares
    each = [n["weights"] + n["cache"] for n in (need(range(i, i + 1)) for i in range(L))]
    total_offered = sum(min(offered(n), 1 << 50) for n in nodes)
    stages, idle, at = [], [], 0
    for j, n in enumerate(nodes):
        if at == L:
            idle.append(n)
            continue
        share = min(offered(n), 1 << 50) / total_offered * sum(each)
        stop, used = at, 0
        # the proportional share, then as many more as fit if later nodes cannot take the rest
        while stop < L and (used + each[stop] / 2 <= share or stop == at):
            used += each[stop]
            stop += 1
        while stop > at and need(range(at, stop))["total"] > offered(n):
            stop -= 1
        rest = nodes[j + 1:]
        while stop < L and need(range(at, stop + 1))["total"] <= offered(n) and not _rest_fits(need, range(stop, L), rest, offered):
            stop += 1
        if stop == at:
            idle.append(n)
            continue
        stages.append(Stage(n, range(at, stop), need(range(at, stop))))
        at = stop
    if at < L:
        whole = memory.required(cfg, qc, context, quantize_at_load)
        raise PlacementError(
            f"the cluster cannot hold {name}: {len(nodes)} node{'s' if len(nodes) != 1 else ''} offer "
            f"{memory.gb(sum(offered(n) for n in nodes))}, and layers {at}-{L - 1} found no room "
            f"(the whole model needs {memory.gb(whole['total'])} with a cache of {whole['context']} tokens); "
            f"add nodes, use a smaller --ctx or a 4-bit copy")
    return Placement(stages, idle)


def _rest_fits(need, layers: range, rest: list[Node], offered) -> bool:
    """Whether `rest`, filled greedily in order, holds `layers`."""
    at = layers.start
    for n in rest:
        stop = at
        while stop < layers.stop and need(range(at, stop + 1))["total"] <= offered(n):
            stop += 1
        at = stop
        if at == layers.stop:
            return True
    return at == layers.stop


SPREADS = ("layers", "experts")


def shares(total: int, weights: list[float]) -> list[range]:
    """[0, total) as contiguous ranges, one per weight, each about its weight's fraction."""
    whole, at, out, acc = sum(weights) or 1, 0, [], 0.0
    for w in weights:
        acc += w
        stop = round(total * acc / whole)
        out.append(range(at, max(at, stop)))
        at = max(at, stop)
    return out


def plan_experts(cfg: DeepseekV2Config, qc: QuantConfig | None, context: int | None, nodes: list[Node],
                 quantize_at_load: bool = False, name: str = "the model") -> Placement:
    """Every node a contiguous range of each MoE layer's routed experts and a contiguous range of
    layers (without their routed experts), both in proportion to what it offers; each node's
    share checked with memory.required; a PlacementError when one does not fit."""
    E, L = cfg.n_routed_experts or 0, cfg.num_hidden_layers
    if not nodes:
        raise PlacementError("the cluster has no node with CPUs to place the model on")
    if not E or not any(cfg.is_moe_layer(i) for i in range(L)):
        raise PlacementError(f"{name} has no routed experts to spread: use --ray-spread layers")

    def offered(n: Node) -> int:
        return min(n.available if n.available is not None else 1 << 62, 1 << 50)

    weights = [offered(n) for n in nodes]
    expert_ranges = shares(E, weights)
    # a layer's cost where it lives without its routed experts: its other weights and its cache
    cost = [sum(memory.required(cfg, qc, context, quantize_at_load, range(i, i + 1), range(0))[k]
                for k in ("weights", "cache")) for i in range(L)]
    total, acc, owner = sum(cost), 0.0, []
    bounds = [sum(weights[:j + 1]) / sum(weights) * total for j in range(len(nodes))]
    for i in range(L):
        middle = acc + cost[i] / 2
        owner.append(next((j for j, b in enumerate(bounds) if middle <= b), len(nodes) - 1))
        acc += cost[i]
    stages, idle, short = [], [], []
    for j, n in enumerate(nodes):
        mine = [i for i in range(L) if owner[i] == j]
        layers = range(mine[0], mine[-1] + 1) if mine else range(0)
        if not len(layers) and not len(expert_ranges[j]):
            idle.append(n)
            continue
        need = memory.required(cfg, qc, context, quantize_at_load, layers, expert_ranges[j])
        if n.available is not None and need["total"] > n.available:
            short.append(f"{n.name} would need {memory.gb(need['total'])} and offers {memory.gb(n.available)}")
        stages.append(Stage(n, layers, need, expert_ranges[j]))
    if short:
        raise PlacementError(f"the cluster cannot hold {name} spread by experts: " + "; ".join(short)
                             + "; add nodes, use a smaller --ctx, a 4-bit copy or --ray-spread layers")
    return Placement(stages, idle)
