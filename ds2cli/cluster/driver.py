"""The driver's side of `--ray`: the placement planned for a checkpoint and shown before anything
loads. execution/factory.cluster_model then makes the driver's Model, which holds no weights,
over the nodes' stages (execution/stages.py)."""

from __future__ import annotations

import dataclasses

from ds2cli.cluster import placement as placing
from ds2cli.cluster import ray_cluster
from ds2cli.errors import ConfigError
from ds2cli.weights import loader, memory
from ds2cli.weights.source import Source


def plan(source: Source, address: str, quantize=None, context: int | None = None, memory_check: bool = True,
         spread: str = "layers", memory_budget: int | None = None):
    """(ray, placement, bits, formats) for loading `source` over the cluster at `address`: every
    node probed (its memory, its ds2 and Ray, the checkpoint at the same path), the layers placed
    (without memory_check: as if every node's memory were unlimited, by their order alone);
    `spread` "experts": each MoE layer's routed experts shared out among the nodes too. A node
    that cannot hold its share whole streams its routed experts where the checkpoint allows it
    (every node, within `memory_budget`, when that is given)."""
    ray = ray_cluster.connect(address)
    bits, recipe = loader.load_form(source, None if quantize == "auto" else quantize, context)
    qc = loader.formats_of(source, bits, recipe)
    nodes = ray_cluster.nodes(ray, source.path)
    placing.check_nodes(nodes, ray_cluster.ds2cli.__version__, ray.__version__,
                        ray_cluster.checkpoint_fingerprint(source.path))
    if not memory_check:
        nodes = [dataclasses.replace(n, available=None) for n in nodes]
    problem = loader.stream_problem(source, qc)
    if memory_budget is not None and problem:
        raise ConfigError(problem)
    how = placing.plan_experts if spread == "experts" else placing.plan
    placement = how(source.config, qc, context, nodes, quantize_at_load=source.stored is None and bits is not None,
                    name=memory.model_name(source.config, source.path), streamable=problem is None,
                    budget=memory_budget)
    return ray, placement, bits, qc


def describe(source: Source, placement: placing.Placement) -> list[str]:
    cfg = source.config
    by = " by experts" if placement.spread == "experts" else ""
    return [f"placement of {memory.model_name(cfg, source.path)} over {len(placement.stages)} "
            f"node{'s' if len(placement.stages) != 1 else ''}{by}:"] + ["  " + line for line in placement.lines(cfg.num_hidden_layers)]
