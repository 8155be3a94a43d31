"""A decoder block, and a range of them over a pass: what the forward pass, a cluster's stage and
calibration all run.

    x = x + MLA(RMSNorm(x))
    x = x + MoE(RMSNorm(x))      (a dense SwiGLU MLP in the first_k_dense_replace layers)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ds2cli.model import rope
from ds2cli.model.attention import Span, mla, rms_norm
from ds2cli.model.config import DeepseekV2Config
from ds2cli.model.layers import Layer
from ds2cli.model.moe import moe, swiglu

if TYPE_CHECKING:
    from ds2cli.model.executor import Executor
    from ds2cli.model.passes import Pass


def block(ex: Executor, i: int, layer: Layer, x: np.ndarray, spans: list[Span], cos, sin,
          cfg: DeepseekV2Config, scale: float, trace: list | None = None) -> np.ndarray:
    """Decoder layer i over x (N, D), each sequence's rows attending to its cache slots (spans)."""
    eps = cfg.rms_norm_eps
    x = x + mla(ex, rms_norm(x, layer.input_layernorm, eps), layer.self_attn, spans, cos, sin, eps, scale)   # (N, D)
    ex.after_attention(i, x)
    h = rms_norm(x, layer.post_attention_layernorm, eps)                    # (N, D)
    w = layer.mlp
    x = x + (moe(ex, i, h, w, cfg, trace) if layer.is_moe else swiglu(ex, h, w.gate_up, w.down_proj))   # (N, D)
    ex.after_layer(i, x)
    return x


def run_layers(model, p: Pass, layers: range, x: np.ndarray | None = None) -> np.ndarray | None:
    """Decoder layers `layers` of pass p over x (N, D): the embedding first when they start at
    layer 0, the final norm and the head when they end at the last, which return the picked
    rows' logits (M, V) (None: no row wanted). The executor runs all of them here, or each
    range where its layers live (a node of a cluster: its own weights and caches)."""
    cfg, ex = model.config, model.executor
    if layers.start == 0:
        x = model.embed_tokens.rows(p.tokens)                               # (N, D)
    cos, sin = rope.cos_sin(p.positions, model.inv_freq, model.rope_scale)  # (N, R/2) each
    for i in layers:
        spans = [Span(r, *c.layer(i), start) for r, c, start in zip(p.rows, p.caches, p.starts)]
        x = block(ex, i, model.layers[i], x, spans, cos, sin, cfg, model.softmax_scale, p.trace)
    if layers.stop < cfg.num_hidden_layers:
        return x
    picked = p.picked
    if len(picked) == 0:
        return None
    # the head runs only on the rows whose logits are wanted
    logits, = ex.matmul_all([(model.lm_head, rms_norm(x[picked], model.norm, cfg.rms_norm_eps))])   # (M, V)
    return logits
