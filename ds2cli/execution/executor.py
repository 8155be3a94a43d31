"""The executor a model is handed: three parts composed, each answering its share of what the
math asks (model/executor.py):
    compute   products, heads, attention's pieces   compute.Compute, compute.CoreCompute
    experts   where a layer's routed experts live   experts.Experts, experts.StreamedExperts,
                                                    remote.RemoteExperts
    passes    where a range of layers runs          passes.Passes, stages.RayPasses
Any compute with any experts with any passes: a way of running a model is a composition
(factory.py makes it from the options), never a subclass.
"""

from __future__ import annotations

import contextlib

from ds2cli.execution.compute import Compute
from ds2cli.execution.experts import Experts
from ds2cli.execution.passes import Passes
from ds2cli.model import executor as interface


class Executor(interface.Executor):
    """`compute`, `experts` and `passes` parts as one executor; the defaults run everything here,
    on the calling thread, the experts resident."""

    def __init__(self, compute: Compute | None = None, experts: Experts | None = None,
                 passes: Passes | None = None):
        self.compute = compute or Compute()
        self.experts_part = experts or Experts()
        self.passes = passes or Passes()

    def start(self, model) -> None:
        self.compute.start(model)
        self.experts_part.start(model, self.compute)
        self.passes.start(model)

    def stop(self) -> None:
        self.passes.stop()
        self.experts_part.stop()
        self.compute.stop()

    def stats(self) -> dict:
        return {**self.passes.stats(), **self.experts_part.stats()}

    def health(self) -> str | None:
        return self.passes.health()

    @contextlib.contextmanager
    def forward_pass(self, tokens: int):
        self.experts_part.forward_pass()
        with self.compute.forward_pass(tokens):
            yield

    # the math's requests, each to its part
    def matmul_all(self, products):
        return self.compute.matmul_all(products)

    def heads(self, w, x):
        return self.compute.heads(w, x)

    def attend_latent(self, q_lat, q_pe, latent, k_pe, scale):
        return self.compute.attend_latent(q_lat, q_pe, latent, k_pe, scale)

    def attend_expanded(self, q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale):
        return self.compute.attend_expanded(q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale)

    def experts(self, i: int, w, ids, xs, shared):
        return self.experts_part.run(i, w, ids, xs, shared)

    def after_attention(self, i: int, x) -> None:
        self.experts_part.after_attention(i, x)

    def after_layer(self, i: int, x) -> None:
        self.experts_part.after_layer(i, x)

    def run_pass(self, model, p):
        return self.passes.run_pass(model, p)

    def pipeline_depth(self) -> int:
        return self.passes.pipeline_depth()

    def start_pass(self, model, p):
        return self.passes.start_pass(model, p)

    def new_cache(self, model, capacity: int):
        return self.passes.new_cache(model, capacity)
