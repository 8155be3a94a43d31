"""The passes part: where a forward pass's layers run. `Passes` runs every layer here, in this
process (block.run_layers through Model.compute); stages.RayPasses runs ranges of them on a Ray
cluster's nodes, each a stage with compute and experts parts of its own."""

from __future__ import annotations

from typing import Callable

import numpy as np

from ds2cli.model.cache import LatentCache


class Passes:
    """Every layer here, one pass at a time."""

    def start(self, model) -> None:
        """The model exists: set up where its layers run."""

    def stop(self) -> None:
        """Release what start set up."""

    def stats(self) -> dict:
        """What running the layers elsewhere cost beyond computing (their nodes' experts read)."""
        return {}

    def health(self) -> str | None:
        """None while everything the layers run on is there; else what is missing (a lost node)."""
        return None

    def run_pass(self, model, p) -> np.ndarray | None:
        """Pass p through every layer: the picked rows' logits (M, V), or None."""
        return model.compute(p, range(model.config.num_hidden_layers))

    def pipeline_depth(self) -> int:
        """How many passes may be under way at once (start_pass)."""
        return 1

    def start_pass(self, model, p) -> Callable[[], np.ndarray | None]:
        """Pass p begun; the call returned waits for its logits. Here it runs at once."""
        logits = self.run_pass(model, p)
        return lambda: logits

    def new_cache(self, model, capacity: int):
        """A latent cache of `capacity` positions, held where the layers are."""
        cfg = model.config
        return LatentCache(cfg.num_hidden_layers, capacity, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
