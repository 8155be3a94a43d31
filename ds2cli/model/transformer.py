"""The DeepSeek-V2 model: embed -> blocks (MLA + dense MLP or MoE) -> norm -> lm_head over a
LatentCache, computed by the executor it is handed. weights/loader.py builds it from a checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ds2cli.model import rope
from ds2cli.model.attention import Span, mla, rms_norm
from ds2cli.model.cache import LatentCache
from ds2cli.model.config import DeepseekV2Config
from ds2cli.errors import ContextFullError, Ds2Error
from ds2cli.model.executor import Executor
from ds2cli.model.layers import Layer, Weights
from ds2cli.model.moe import moe, swiglu

# The memory chunk: no pass runs more than this many tokens, so a prompt of any length is read in
# passes whose activations, router and attention working memory stay bounded (attention.py's
# budget covers the scores). Every caller gets it here, generate, chat, serve, bench and the
# library alike. 1,024 keeps each product a large GEMM: prefill tok/s is flat from 512 tokens on.
PREFILL_CHUNK = 1024


@dataclasses.dataclass
class Step:
    """One sequence's part of a forward pass: `ids` run after what `cache` holds, and which
    logits come back for them: "last" (V,), "all" (T, V), or "none" (a prompt chunk)."""
    ids: Sequence[int]
    cache: LatentCache
    logits: str = "last"


class Model:
    """A loaded DeepSeek-V2 checkpoint. `forward` appends tokens to a LatentCache and returns logits.

    `weights` (layers.Weights): embed_tokens and lm_head (weights you can multiply by, linear.py;
    a tied head is the embedding itself), norm (D,), and the decoder layers. `executor` runs the math's
    parallel work (executor.py; default: the reference, on the calling thread); it is started
    here, once the weights exist (the default of ds2cli.load forks its helper processes then)."""

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
        self.executor.start(self)          # its weights exist: the executor sets up what it runs on

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
        More than PREFILL_CHUNK tokens run as several passes in order; `progress(done, total)`
        hears of each. An error leaves every cache at the length it had; an interrupt (Ctrl-C,
        SIGTERM) leaves each holding the passes it finished, so that what was read can be kept
        (a chat's session, a prompt cache)."""
        ids = self._checked_steps(steps)
        total = sum(map(len, ids))
        if total <= PREFILL_CHUNK:
            with self.executor.forward_pass(total):
                return self._forward(ids, steps, trace)
        lengths = [s.cache.length for s in steps]
        try:
            return self._forward_in_chunks(ids, steps, trace, progress)
        except Exception:
            for s, n in zip(steps, lengths):
                s.cache.length = n
            raise

    def _forward_in_chunks(self, ids: list[np.ndarray], steps: Sequence[Step], trace: list | None,
                           progress: Callable[[int, int], None] | None) -> list:
        """Passes of at most PREFILL_CHUNK tokens, each step's tokens in order: a step's "last"
        logits come from its final piece, its "all" logits are its pieces' rows in order."""
        total, done = sum(map(len, ids)), 0
        at = [0] * len(steps)
        pieces: list[list[np.ndarray]] = [[] for _ in steps]
        while done < total:
            room, part = PREFILL_CHUNK, []
            for i, (s, t) in enumerate(zip(steps, ids)):
                n = min(len(t) - at[i], room)
                if n > 0:
                    final = at[i] + n == len(t)
                    mode = "all" if s.logits == "all" else "last" if s.logits == "last" and final else "none"
                    part.append((i, Step(t[at[i]:at[i] + n], s.cache, mode)))
                    at[i], room = at[i] + n, room - n
            n_part = sum(len(st.ids) for _, st in part)
            with self.executor.forward_pass(n_part):
                out = self._forward([st.ids for _, st in part], [st for _, st in part], trace)
            for (i, _), logits in zip(part, out):
                if logits is not None:
                    pieces[i].append(logits)
            done += n_part
            if progress is not None:
                progress(done, total)
        return [None if s.logits == "none" else pieces[i][-1] if s.logits == "last" else np.concatenate(pieces[i])
                for i, s in enumerate(steps)]

    def _checked_steps(self, steps, ids: list | None = None) -> list:
        """Each step's ids, checked (unless given so), then the steps themselves: distinct
        caches, a known `logits`, room in each cache."""
        ids = ids if ids is not None else [self._check_ids(s.ids) for s in steps]
        if len({id(s.cache) for s in steps}) < len(steps):
            raise Ds2Error("a forward pass got the same cache twice")
        for s, t in zip(steps, ids):
            if s.logits not in ("last", "all", "none"):
                raise Ds2Error(f"a step's logits must be 'last', 'all' or 'none', not {s.logits!r}")
            s.cache.check_room(len(t))
        return ids

    def _check_ids(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids).reshape(-1)
        if len(ids) == 0:
            raise Ds2Error("forward needs at least one token")
        if ids.dtype.kind not in "iu":                       # 5.0 or "5" is a caller's bug, not token 5
            raise Ds2Error(f"token ids must be integers, got {ids.dtype} values")
        ids = ids.astype(np.int64)
        V = self.config.vocab_size
        if ids.min() < 0 or ids.max() >= V:
            raise Ds2Error(f"token id out of range [0, {V}): {int(ids.max() if ids.max() >= V else ids.min())}")
        return ids

    def start_batch(self, steps: Sequence[Step]) -> Callable[[], list[np.ndarray | None]]:
        """forward_batch(steps) begun: the call returned waits for it and gives its logits.
        Where the executor runs passes on several machines at once (a cluster's stages by
        layers: pipeline_depth() > 1), this pass's stages run while an earlier pass is still
        on later stages, so stages are kept busy with different sequences; until the call, no
        other pass may use these steps' caches. Elsewhere, or for more than PREFILL_CHUNK
        tokens, it is forward_batch, run at once."""
        ids = [self._check_ids(s.ids) for s in steps]
        if self.executor.pipeline_depth() < 2 or sum(map(len, ids)) > PREFILL_CHUNK:
            out = self.forward_batch(steps)
            return lambda: out
        self._checked_steps(steps, ids)
        p = Pass.of(ids, steps, None)
        wait = self.executor.start_pass(self, p)
        return lambda: self._take(ids, steps, p, wait())

    def _forward(self, ids: list[np.ndarray], steps: Sequence[Step], trace: list | None) -> list:
        p = Pass.of(ids, steps, trace)
        return self._take(ids, steps, p, self.executor.run_pass(self, p))  # (M, V) or None

    def _take(self, ids: list[np.ndarray], steps: Sequence[Step], p: "Pass", logits) -> list:
        """Each step's logits out of a pass's, its cache now holding the pass's tokens."""
        for s, t, start in zip(steps, ids, p.starts):
            s.cache.length = start + len(t)
        out, at = [], 0
        for s, n in zip(steps, p.wanted):
            part = logits[at:at + n] if n else None
            out.append(None if s.logits == "none" else part[0] if s.logits == "last" else part)
            at += n
        return out

    def compute(self, p: "Pass", layers: range, x: np.ndarray | None = None) -> np.ndarray | None:
        """Decoder layers `layers` of pass p over x (N, D): the embedding first when they start
        at layer 0, the final norm and the head when they end at the last, which return the
        picked rows' logits (M, V) (None: no row wanted). The executor runs all of them here, or
        each range where its layers live (a node of a cluster: its own weights and caches)."""
        cfg, ex, eps = self.config, self.executor, self.config.rms_norm_eps
        if layers.start == 0:
            x = self.embed_tokens.rows(p.tokens)                             # (N, D)
        cos, sin = rope.cos_sin(p.positions, self.inv_freq, self.rope_scale)  # (N, R/2) each
        rows = p.rows                                                        # each sequence's rows
        for i in layers:
            layer = self.layers[i]
            spans = [Span(r, *c.layer(i), start) for r, c, start in zip(rows, p.caches, p.starts)]
            x = x + mla(ex, rms_norm(x, layer.input_layernorm, eps), layer.self_attn, spans, cos, sin, eps,
                        self.softmax_scale)
            ex.after_attention(i, x)
            h = rms_norm(x, layer.post_attention_layernorm, eps)
            x = x + (moe(ex, h, layer.mlp, cfg, p.trace) if layer.is_moe else
                     swiglu(ex, h, layer.mlp.gate_up, layer.mlp.down_proj))
            ex.after_layer(i, x)
        if layers.stop < cfg.num_hidden_layers:
            return x
        picked = p.picked
        if len(picked) == 0:
            return None
        # the head runs only on the rows whose logits are wanted
        logits, = ex.matmul_all([(self.lm_head, rms_norm(x[picked], self.norm, eps))])   # (M, V)
        return logits


@dataclasses.dataclass
class Pass:
    """One forward pass as every decoder layer sees it: all sequences' new tokens stacked
    (N = sum of T), where each sequence starts in its cache, and which rows the head computes.
    Whatever runs a range of layers gets this with its own caches (Pass.with_caches)."""
    tokens: np.ndarray            # (N,) new token ids, sequence after sequence
    lengths: list[int]            # each sequence's T
    starts: list[int]             # each sequence's cached length before the pass
    wanted: list[int]             # how many logits rows each sequence gets back
    caches: list                  # each sequence's LatentCache
    trace: list | None = None     # each MoE layer appends the expert ids it chose (T, k)

    @classmethod
    def of(cls, ids: list[np.ndarray], steps: Sequence[Step], trace: list | None) -> "Pass":
        lengths = [len(t) for t in ids]
        wanted = [n if s.logits == "all" else 1 if s.logits == "last" else 0 for s, n in zip(steps, lengths)]
        return cls(np.concatenate(ids), lengths, [s.cache.length for s in steps], wanted,
                   [s.cache for s in steps], trace)

    @property
    def rows(self) -> list[slice]:
        ends = np.cumsum(self.lengths)
        return [slice(int(e - n), int(e)) for n, e in zip(self.lengths, ends)]

    @property
    def positions(self) -> np.ndarray:
        return np.concatenate([np.arange(p, p + n) for p, n in zip(self.starts, self.lengths)])   # (N,)

    @property
    def picked(self) -> np.ndarray:
        """The rows the head computes: a sequence's last (wanted 1) or all of its rows."""
        return np.concatenate([np.arange(r.stop - w, r.stop) for r, w in zip(self.rows, self.wanted)]).astype(np.int64)

    def with_caches(self, caches: list, trace: list | None) -> "Pass":
        return dataclasses.replace(self, caches=caches, trace=trace)
