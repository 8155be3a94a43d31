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

Streaming (`streamable`: a ds2 low-bit checkpoint or a Q8_0 GGUF): when the nodes cannot hold
their shares whole, or a budget is given (--memory-budget with --ray caps every node), a node
holds its share's always-used part and streams its routed experts from its own disk into as
many expert slots as the rest of what it offers admits (memory.streamed: the same accounting as
one process's --memory-budget). The shares are planned as before, each node's checked against
the least it needs streaming (its resident part and one token's experts); a node whose share
fits whole holds it whole unless a budget was given.
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
    fingerprint: str = ""        # its checkpoint at the path (ray_cluster.checkpoint_fingerprint), "" unknown

    @property
    def name(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"


@dataclasses.dataclass(frozen=True)
class Stage:
    node: Node
    layers: range
    need: dict                   # memory.required for this range: weights, cache, working, margin, total
    experts: range | None = None  # spread by experts: the routed experts it holds of every MoE layer
    stream: dict | None = None   # streaming its routed experts: memory.streamed's plan, and "budget"

    @property
    def budget(self) -> int | None:
        """The bytes its routed experts are streamed within (its stage's --memory-budget), or None."""
        return None if self.stream is None else self.stream["budget"]

    @property
    def share(self) -> str:
        """What it holds, in short (how a lost node's share is named): "layers 2-3"; spread by
        experts "layers 2-3, experts 3-4" ("no layers", "no experts" where it holds none)."""
        out = f"layers {self.layers.start}-{self.layers.stop - 1}" if len(self.layers) else "no layers"
        if self.experts is not None:
            out += f", experts {self.experts.start}-{self.experts.stop - 1}" if len(self.experts) else ", no experts"
        return out

    def describe(self, num_layers: int) -> str:
        first, last = self.layers.start, self.layers.stop - 1
        extra = (["embedding"] if first == 0 else []) + (["norm and head"] if last == num_layers - 1 else [])
        n = self.need
        offered = memory.gb(self.node.available) if self.node.available is not None else "unknown"
        held = f"layers {first}-{last}{' + ' + ', '.join(extra) if extra else ''}" if len(self.layers) else "no layers"
        if self.experts is not None:
            held += (f", experts {self.experts.start}-{self.experts.stop - 1} of each MoE layer" if len(self.experts)
                     else ", no experts")
        if self.stream is not None:
            st = self.stream
            share = 100 * st["slots"] / max(1, st["experts"])
            return (f"{self.node.name}: {held}, resident {memory.gb(st['resident'])} (cache "
                    f"{memory.gb(n['cache'])} at {n['context']} tokens), {st['slots']} expert slots "
                    f"({share:.0f}% of its {st['experts']} experts, streamed), needs {memory.gb(st['budget'])} "
                    f"of {offered}, {self.node.cpus} CPUs")
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
            # streaming: the budget its experts stream within, its resident bytes and its slots
            d["streamed"] = None if s.stream is None else {
                "budget_bytes": s.stream["budget"], "resident_bytes": s.stream["resident"],
                "expert_slots": s.stream["slots"], "experts": s.stream["experts"],
                "expert_bytes": s.stream["expert"]}
            out.append({**d, **{f"{k}_bytes" if k != "context" else k: v for k, v in s.need.items()}})
        return out

    @property
    def streams(self) -> bool:
        return any(s.stream is not None for s in self.stages)


def check_nodes(nodes: list[Node], ds2_version: str, ray_version: str, fingerprint: str = "") -> None:
    """One error naming each node that cannot take part: a problem its probe found (no
    checkpoint at the path), another ds2 or Ray version than the driver's, a checkpoint at the
    path whose fingerprint is not the driver's `fingerprint` (when it is given): other files,
    headers or recorded checksums, so other weights."""
    bad = []
    for n in nodes:
        if n.problem:
            bad.append(f"node {n.name}: {n.problem}")
        elif n.ds2_version != ds2_version:
            bad.append(f"node {n.name} runs ds2 {n.ds2_version}, the driver {ds2_version}")
        elif n.ray_version != ray_version:
            bad.append(f"node {n.name} runs Ray {n.ray_version}, the driver {ray_version}")
        elif fingerprint and n.fingerprint != fingerprint:
            bad.append(f"node {n.name} holds another checkpoint at the path than the driver (its config, "
                       f"tokenizer, index, checksums or shards' sizes and headers differ: docs/cluster.md)")
    if bad:
        raise PlacementError("; ".join(bad))


def plan(cfg: DeepseekV2Config, qc: QuantConfig | None, context: int | None, nodes: list[Node],
         quantize_at_load: bool = False, name: str = "the model", streamable: bool = False,
         budget: int | None = None) -> Placement:
    """Contiguous layer ranges over `nodes` (in their order), each node's share of the layers in
    proportion to what it offers, every range checked with memory.required; a PlacementError
    saying what is missing when the nodes together cannot hold the model. `streamable`: the
    checkpoint's routed experts can be streamed, so a node that cannot hold its range whole
    streams them (every node, within `budget` at most, when a budget is given)."""
    if not nodes:
        raise PlacementError("the cluster has no node with CPUs to place the model on")
    return Placement(*plan_range(cfg, qc, context, nodes, range(cfg.num_hidden_layers), quantize_at_load,
                                 streamable, name, budget, idle=True))


class Demand:
    """What a node's share needs: whole (memory.required), or streaming its routed experts
    (memory.streamed's least: its resident part and one token's experts); what a node offers
    (capped by `budget`)."""

    def __init__(self, cfg, qc, context, quantize_at_load: bool, budget: int | None, streaming: bool = False):
        self.cfg, self.qc, self.context, self.quantize_at_load = cfg, qc, context, quantize_at_load
        self.budget, self.streaming = budget, streaming

    def offered(self, n: Node) -> int:
        have = n.available if n.available is not None else 1 << 62   # unknown: not limited by ds2
        return have if self.budget is None else min(have, self.budget)

    def required(self, layers: range, experts: range | None = None) -> dict:
        return memory.required(self.cfg, self.qc, self.context, self.quantize_at_load, layers, experts)

    def __call__(self, layers: range, experts: range | None = None) -> dict:
        """{"total": the least it needs}: whole, or streaming (then never more than whole)."""
        whole = self.required(layers, experts)
        if not self.streaming:
            return whole
        least = memory.streamed(self.cfg, self.qc, self.context, 1 << 62, layers, experts)["least"]
        return {**whole, "total": min(whole["total"], least)}

    def stage(self, node: Node, layers: range, experts: range | None, forced: bool = False) -> Stage:
        """The stage for this share: streaming within what the node offers where its share does
        not fit whole (or `forced`: a budget was given) and it has routed experts to stream."""
        need = self.required(layers, experts)
        offered = self.offered(node)
        routed = memory.routed_share(self.cfg, self.qc, experts) if experts is not None else \
            memory.routed_bytes(self.cfg, self.qc, layers)
        if not self.streaming or not routed or (need["total"] <= offered and not forced):
            return Stage(node, layers, need, experts)
        budget = min(offered, 1 << 50)
        plan = memory.streamed(self.cfg, self.qc, self.context, budget, layers, experts)
        return Stage(node, layers, need, experts, {**plan, "budget": budget})


def plan_range(cfg: DeepseekV2Config, qc: QuantConfig | None, context: int | None, nodes: list[Node],
               layers: range, quantize_at_load: bool = False, streamable: bool = False,
               name: str = "the model", budget: int | None = None, idle: bool = False):
    """The decoder layers `layers` over `nodes` as `plan` shares out the whole (plan is this
    over every layer; execution/healing.py places a lost node's layers with it, each node
    offering what it has left): whole shares where they fit, else (`streamable`) streaming
    where a share does not fit whole; every node streams within `budget` when one is given.
    The stages, and with `idle` the nodes that hold nothing too."""
    whole = Demand(cfg, qc, context, quantize_at_load, None)
    if budget is None:
        try:
            stages, left = _ranges(cfg, nodes, whole, whole.offered, name, layers=layers)
            return (stages, left) if idle else stages
        except PlacementError:
            if not streamable:
                raise
    stream = Demand(cfg, qc, context, quantize_at_load, budget, streaming=True)
    shares, left = _ranges(cfg, nodes, stream, stream.offered, name, whole, layers=layers)
    stages = [stream.stage(s.node, s.layers, None, forced=budget is not None) for s in shares]
    return (stages, left) if idle else stages


def _ranges(cfg: DeepseekV2Config, nodes: list[Node], need, offered, name: str,
            whole=None, layers: range | None = None) -> tuple[list[Stage], list[Node]]:
    """Contiguous ranges of `layers` (default: all) over `nodes` (Stages with `need`'s dict)
    and the idle nodes; `whole`: the whole-model demand named in the error when streaming
    cannot place it either."""
    layers = range(cfg.num_hidden_layers) if layers is None else layers
    L = layers.stop
    # the bytes a layer costs where it lives (its weights and its part of the cache), for shares
    each = [0] * layers.start + [n["weights"] + n["cache"] for n in (need.required(range(i, i + 1)) for i in layers)]
    total_offered = sum(min(offered(n), 1 << 50) for n in nodes)
    stages, idle, at = [], [], layers.start
    for j, n in enumerate(nodes):
        if at == L:
            idle.append(n)
            continue
        share = min(offered(n), 1 << 50) / max(1, total_offered) * sum(each)
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
        model = (whole or need).required(layers)
        streaming = getattr(need, "streaming", False)
        least = ""
        if streaming:       # what the nodes would need streaming, the layers shared out evenly
            even = shares(len(layers), [1.0] * len(nodes))
            want = sum(need(range(layers.start + r.start, layers.start + r.stop))["total"] for r in even if len(r))
            have = sum(min(offered(n), 1 << 50) for n in nodes)
            least = (f"; streaming its routed experts, about {memory.gb(want)} over {len(nodes)} "
                     f"node{'s' if len(nodes) != 1 else ''}, {memory.gb(max(0, want - have))} more than they offer")
        raise PlacementError(
            f"the cluster cannot hold {name}: {len(nodes)} node{'s' if len(nodes) != 1 else ''} offer "
            f"{memory.gb(sum(min(offered(n), 1 << 50) for n in nodes))}, and layers {at}-{L - 1} found no room "
            f"(the whole model needs {memory.gb(model['total'])} with a cache of {model['context']} tokens{least}); "
            f"add nodes, use a smaller --ctx or a 4-bit copy")
    return stages, idle


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
                 quantize_at_load: bool = False, name: str = "the model", streamable: bool = False,
                 budget: int | None = None, layers: range | None = None, experts: range | None = None) -> Placement:
    """Every node a contiguous range of each MoE layer's routed experts and a contiguous range of
    layers (without their routed experts), both in proportion to what it offers; each node's
    share checked with memory.required; a PlacementError when one does not fit. `streamable`
    and `budget` as in `plan`: a node whose share does not fit whole streams its experts.
    `layers`, `experts`: only those (default: all) shared out, as plan_lost_experts does with a
    lost node's share."""
    E, L = cfg.n_routed_experts or 0, cfg.num_hidden_layers
    layers = range(L) if layers is None else layers
    experts = range(E) if experts is None else experts
    if not nodes:
        raise PlacementError("the cluster has no node with CPUs to place the model on")
    if not E or not any(cfg.is_moe_layer(i) for i in range(L)):
        raise PlacementError(f"{name} has no routed experts to spread: use --ray-spread layers")

    demand = Demand(cfg, qc, context, quantize_at_load, budget, streaming=streamable or budget is not None)
    weights = [min(demand.offered(n), 1 << 50) for n in nodes]
    expert_ranges = [range(experts.start + r.start, experts.start + r.stop) for r in shares(len(experts), weights)]
    owner = _layer_owners(cfg, qc, context, quantize_at_load, layers, weights)
    stages, idle, short = [], [], []
    for j, n in enumerate(nodes):
        mine = [i for i, o in zip(layers, owner) if o == j]
        held = range(mine[0], mine[-1] + 1) if mine else range(0)
        if not len(held) and not len(expert_ranges[j]):
            idle.append(n)
            continue
        need = demand(held, expert_ranges[j])
        if n.available is not None or budget is not None:
            if need["total"] > demand.offered(n):
                short.append(f"{n.name} would need {memory.gb(need['total'])}{' streaming' if demand.streaming else ''} "
                             f"and offers {memory.gb(demand.offered(n))}")
                continue
        stages.append(demand.stage(n, held, expert_ranges[j], forced=budget is not None))
    if short:
        raise PlacementError(f"the cluster cannot hold {name} spread by experts: " + "; ".join(short)
                             + "; add nodes, use a smaller --ctx, a 4-bit copy or --ray-spread layers")
    return Placement(stages, idle)


def _layer_owners(cfg: DeepseekV2Config, qc: QuantConfig | None, context: int | None, quantize_at_load: bool,
                  layers: range, weights: list[float]) -> list[int]:
    """Spread by experts, which node (an index of `weights`) holds each of `layers`: contiguous
    shares in proportion to the weights, by what a layer costs where it lives without its routed
    experts (its other weights and its cache)."""
    cost = [sum(memory.required(cfg, qc, context, quantize_at_load, range(i, i + 1), range(0))[k]
                for k in ("weights", "cache")) for i in layers]
    total, acc, owner, whole = sum(cost), 0.0, [], sum(weights) or 1
    bounds = [sum(weights[:j + 1]) / whole * total for j in range(len(weights))]
    for c in cost:
        middle = acc + c / 2
        owner.append(next((j for j, b in enumerate(bounds) if middle <= b), len(weights) - 1))
        acc += c
    return owner


def on_the_roomiest(demand: Demand, nodes: list[Node], layers: range, experts: range | None = None,
                    forced: bool = False) -> Stage | None:
    """A lost share whole on the node left with the most room, where `demand` says it fits there."""
    roomiest = max(nodes, key=lambda n: min(demand.offered(n), 1 << 50))
    if demand(layers, experts)["total"] <= demand.offered(roomiest):
        return demand.stage(roomiest, layers, experts, forced=forced)
    return None


def plan_lost_experts(cfg: DeepseekV2Config, qc: QuantConfig | None, context: int | None, nodes: list[Node],
                      layers: range, experts: range, quantize_at_load: bool = False, streamable: bool = False,
                      name: str = "the model", budget: int | None = None) -> list[Stage]:
    """Spread by experts, a lost node's share (its `layers`, maybe none, and its range `experts`
    of every MoE layer) over the `nodes` left, each offering what it has left: whole on the node
    with the most room where it fits there (else streaming its experts, when `streamable`), so
    that the other nodes gain one peer to ask; else shared out over them all as plan_experts
    shares out the whole. A PlacementError when neither fits."""
    if not nodes:
        raise PlacementError("the cluster has no node left to place the lost share on")
    demand = Demand(cfg, qc, context, quantize_at_load, budget, streaming=streamable or budget is not None)
    one = on_the_roomiest(demand, nodes, layers, experts, forced=budget is not None)
    if one is not None:
        return [one]
    return plan_experts(cfg, qc, context, nodes, quantize_at_load, name, streamable, budget, layers, experts).stages


def plan_lost(cfg: DeepseekV2Config, qc: QuantConfig | None, context: int | None, nodes: list[Node],
              layers: range, experts: range | None = None, quantize_at_load: bool = False, streamable: bool = False,
              name: str = "the model", budget: int | None = None) -> list[Stage]:
    """Where a lost stage's share goes over the `nodes` left (execution/healing.py): spread by
    layers its `layers` whole on the node with the most room where they fit there whole (one
    stage, so a token makes no more hops than before), else as plan_range shares them out;
    with `experts` (spread by experts) its layers and experts as plan_lost_experts places them."""
    if experts is None:
        one = on_the_roomiest(Demand(cfg, qc, context, quantize_at_load, None), nodes, layers) \
            if nodes and budget is None else None
        if one is not None:
            return [one]
        return plan_range(cfg, qc, context, nodes, layers, quantize_at_load, streamable, name, budget)
    return plan_lost_experts(cfg, qc, context, nodes, layers, experts, quantize_at_load, streamable, name, budget)
