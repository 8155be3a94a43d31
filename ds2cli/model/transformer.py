"""The DeepSeek-V2 model: embed -> blocks (MLA + dense MLP or MoE) -> norm -> lm_head over a
LatentCache, computed by the executor it is handed. weights/loader.py builds it from a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ds2cli.model import rope
from ds2cli.model.block import run_layers
from ds2cli.model.cache import LatentCache
from ds2cli.model.config import DeepseekV2Config
from ds2cli.errors import ContextFullError
from ds2cli.model.executor import Executor
from ds2cli.model.layers import Layer, Weights
from ds2cli.model.passes import PREFILL_CHUNK, Pass, Step, check_ids, check_steps, chunked

__all__ = ["Model", "Step", "Pass", "PREFILL_CHUNK"]


class Model:
    """A loaded DeepSeek-V2 checkpoint. `forward` appends tokens to a LatentCache and returns logits.

    `weights` (layers.Weights): embed_tokens and lm_head (weights you can multiply by, linear.py;
    a tied head is the embedding itself), norm (D,), and the decoder layers. `executor` runs the math's
    work (executor.py; default: the reference, on the calling thread). Constructing a Model
    starts nothing: whoever composes its executor starts it (ds2cli.load)."""

    def __init__(self, config: DeepseekV2Config, weights: Weights, tokenizer: Any,
                 generation_config: dict | None = None, path: Path | None = None,
                 executor: Executor | None = None, quantization: Any = None):
        self.config = config
        # text.tokenizer.Tokenizer or None, given by the loader: the math reads only its eos ids, so
        # the model package imports nothing of the text layer above it
        self.tokenizer = tokenizer
        self.generation_config = generation_config or {}
        self.path = path
        self.embed_tokens = weights.embed_tokens                            # (V, D)
        self.norm = weights.norm                                             # (D,)
        self.lm_head = weights.lm_head                                       # (V, D)
        self.layers: list[Layer] = weights.layers
        self.executor = executor or Executor()
        self.inv_freq = rope.inv_freq(config)                                # (R/2,)
        self.rope_scale = rope.cos_sin_scale(config.rope_scaling, config.is_v3)
        self.softmax_scale = rope.softmax_scale(config)
        self.quantization = quantization   # the QuantConfig of low-bit weights (weights/qcheckpoint.py)
        self.streamed = weights.streamed   # the routed experts' cache when they are read from disk
        self.prefill_chunk = PREFILL_CHUNK   # most tokens a pass runs (passes.py): the memory chunk

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: config, generation_config and tokenizer may each list some."""
        gen = self.generation_config.get("eos_token_id")
        gen = gen if isinstance(gen, list) else [gen] if isinstance(gen, int) else []
        tok = self.tokenizer.eos_token_ids if self.tokenizer else ()
        return tuple(dict.fromkeys([*self.config.eos_token_ids, *gen, *tok]))

    def new_cache(self, capacity: int | None = None) -> LatentCache:
        cfg = self.config
        capacity = cfg.max_position_embeddings if capacity is None else capacity
        if capacity > cfg.max_position_embeddings:
            raise ContextFullError(f"a cache of {capacity} tokens is larger than the model's "
                                   f"max_position_embeddings ({cfg.max_position_embeddings}); "
                                   f"refusing positions the model was never trained on")
        return self.executor.new_cache(self, capacity)

    def forward(self, token_ids, cache: LatentCache, all_logits: bool = False, trace: list | None = None,
                progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """Run `token_ids` after what `cache` holds; return float32 logits for the last position
        (V,), or for every new position (T, V) with all_logits. With `trace`, each MoE layer
        appends the expert ids its gate chose (T, k): what the forward pass read. A long prompt
        runs in passes of PREFILL_CHUNK tokens; `progress(done, total)` hears of each."""
        return self.forward_batch([Step(token_ids, cache, "all" if all_logits else "last")], trace, progress)[0]

    def forward_batch(self, steps: Sequence[Step], trace: list | None = None,
                      progress: Callable[[int, int], None] | None = None) -> list[np.ndarray | None]:
        """One pass for several sequences (B = len(steps)), each advancing its own cache by its
        own tokens: the projections, norms, router and experts run once on all their rows
        stacked, attention per sequence against its cache. Returns each step's logits.
        More than PREFILL_CHUNK tokens run as several passes in order (passes.chunked);
        `progress(done, total)` hears of each. An error leaves every cache at the length it
        had; an interrupt (Ctrl-C, SIGTERM) leaves each holding the passes it finished, so that
        what was read can be kept (a chat's session, a prompt cache)."""
        ids = check_steps(steps, self.config.vocab_size)
        if sum(map(len, ids)) <= self.prefill_chunk:
            return self._forward(ids, steps, trace)
        lengths = [s.cache.length for s in steps]
        try:
            return chunked(ids, steps, lambda i, s: self._forward(i, s, trace), self.prefill_chunk, progress)
        except Exception:
            for s, n in zip(steps, lengths):
                s.cache.length = n
            raise

    def start_batch(self, steps: Sequence[Step]) -> Callable[[], list[np.ndarray | None]]:
        """forward_batch(steps) begun: the call returned waits for it and gives its logits.
        Where the executor runs passes on several machines at once (a cluster's stages by
        layers: pipeline_depth() > 1), this pass's stages run while an earlier pass is still
        on later stages, so stages are kept busy with different sequences; until the call, no
        other pass may use these steps' caches. Elsewhere, or for more than PREFILL_CHUNK
        tokens, it is forward_batch, run at once."""
        ids = [check_ids(s.ids, self.config.vocab_size) for s in steps]
        if self.executor.pipeline_depth() < 2 or sum(map(len, ids)) > self.prefill_chunk:
            out = self.forward_batch(steps)
            return lambda: out
        check_steps(steps, self.config.vocab_size, ids)
        p = Pass.of(ids, steps, None)
        wait = self.executor.start_pass(self, p)
        return lambda: p.logits_of(ids, steps, wait())

    def _forward(self, ids: list[np.ndarray], steps: Sequence[Step], trace: list | None) -> list:
        p = Pass.of(ids, steps, trace)
        with self.executor.forward_pass(len(p.tokens)):
            return p.logits_of(ids, steps, self.executor.run_pass(self, p))   # (M, V) or None

    def compute(self, p: Pass, layers: range, x: np.ndarray | None = None) -> np.ndarray | None:
        """Layers `layers` of pass p here (block.run_layers): what an executor runs where they live."""
        return run_layers(self, p, layers, x)
