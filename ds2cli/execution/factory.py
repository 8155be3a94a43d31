"""The one place the options become an executor: `--threads`, `--memory-budget`, `--ray` and
`--ray-spread` (and the library's keywords of the same names) pick the parts (executor.py), and
`load` loads a model and hands it the composed executor, started. `ds2cli.load` is this load.

    where the layers run     here: passes.Passes        --ray: stages.RayPasses
    where the experts live   resident: experts.Experts  --memory-budget: experts.StreamedExperts
                             a node of --ray-spread experts: remote.RemoteExperts over either
    what computes            compute.CoreCompute over a Machine of --threads cores
"""

from __future__ import annotations

import atexit
import functools
from typing import Callable

from ds2cli.errors import ConfigError
from ds2cli.execution.compute import Compute, CoreCompute
from ds2cli.execution.executor import Executor
from ds2cli.execution.experts import Experts, StreamedExperts
from ds2cli.execution.machine import Machine
from ds2cli.execution.remote import RemoteExperts
from ds2cli.model.layers import Weights
from ds2cli.model.transformer import Model
from ds2cli.weights import loader, memory
from ds2cli.weights.source import open_model


def load(path=None, progress=None, quantize: int | str | None = None, context: int | None = None,
         memory_check: bool = True, layers: range | None = None, experts: range | None = None,
         memory_budget: int | None = None, threads: int | None = None, machine: Machine | None = None,
         spread_experts: bool = False, ray: str | None = None, spread: str = "layers",
         show: Callable[[str], None] | None = None, executor: Executor | None = None, heal: bool = True) -> Model:
    """A model (default: the bundled ds2-tiny) loaded (weights/loader.py: `path`, `progress`,
    `quantize`, `context`, `memory_check`, `layers`, `experts`, `memory_budget` as there) and
    given its executor, started: this process's cores (`threads` at most, or the `machine`
    given), its routed experts resident or streamed from disk within `memory_budget`, and with
    `spread_experts` (a node of a cluster spread by experts) the other nodes' experts asked of
    them. `ray`: the model's layers over that Ray cluster's nodes instead (cluster_model).
    `executor`: one composed already (or any of model/executor.py's interface), used as given.
    `heal`: over a cluster, a lost node's share moves to the nodes left (healing.py)."""
    if ray is not None:
        return cluster_model(open_model(path), ray, quantize, context, show, memory_check, spread, memory_budget,
                             heal)
    if machine is not None and threads is not None:
        raise ConfigError("give threads= or a machine=, not both: a machine's cores are its own")
    model = loader.load(path, progress, quantize, context, memory_check, layers=layers,
                        memory_budget=memory_budget, experts=experts)
    if executor is None:
        own = Experts() if model.streamed is None else StreamedExperts(model.streamed)
        if spread_experts:
            own = RemoteExperts(experts, local=own)
        executor = Executor(CoreCompute(machine or Machine(threads)), own)
    model.executor = executor
    model.executor.start(model)
    return model


def cluster_model(source, address: str, quantize=None, context: int | None = None,
                  show: Callable[[str], None] | None = None, memory_check: bool = True, spread: str = "layers",
                  memory_budget: int | None = None, heal: bool = True) -> Model:
    """The model at `source` over the Ray cluster at `address`: the placement (shown line by line
    with `show` before any weight loads), a stage on each node that loads its own range from its
    own disk (its experts streamed within `memory_budget` when given), and the driver's Model,
    which holds no weights, over them. A node that cannot hold its share whole streams its
    routed experts (cluster/placement.py), every node within `memory_budget` when given. `heal`:
    a node lost mid-run has its share (its layers; spread by experts, its experts too) moved to
    the nodes left (healing.py), its lines shown with `show`."""
    from ds2cli.cluster import driver
    from ds2cli.cluster.placement import plan_lost
    from ds2cli.execution.stages import RayPasses
    ray, placement, bits, qc = driver.plan(source, address, quantize, context, memory_check, spread, memory_budget)
    for line in driver.describe(source, placement) if show else ():
        show(line)
    cfg = source.config
    replan = functools.partial(plan_lost, cfg, qc, context, quantize_at_load=source.stored is None and bits is not None,
                               streamable=loader.stream_problem(source, qc) is None,
                               name=memory.model_name(cfg, source.path), budget=memory_budget)
    passes = RayPasses(ray, placement, source.path, load, bits if quantize == "auto" else quantize, context,
                       heal=heal, show=show, replan=replan)
    weights = Weights(embed_tokens=None, layers=[None] * cfg.num_hidden_layers, norm=None, lm_head=None)
    model = Model(cfg, weights, source.tokenizer, source.generation_config, source.path,
                  executor=Executor(Compute(), Experts(), passes), quantization=qc)
    atexit.register(model.executor.stop)   # Ray also ends a driver's actors with it: this says so at once
    try:
        model.executor.start(model)
    except BaseException:
        model.executor.stop()
        raise
    return model
