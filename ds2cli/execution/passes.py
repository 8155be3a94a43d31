"""The passes part: where a forward pass's layers run. `Passes` runs every layer here, in this
process (block.run_layers through Model.compute); stages.RayPasses runs ranges of them on a Ray
cluster's nodes, each a stage with compute and experts parts of its own."""

from __future__ import annotations

from ds2cli.model.executor import Lifecycle, ReferencePasses


class Passes(Lifecycle, ReferencePasses):
    """Every layer here, one pass at a time: the reference's run_pass, pipeline_depth,
    start_pass and new_cache, and start, stop, stats and health that do nothing
    (model/executor.py); stages.RayPasses says otherwise."""
