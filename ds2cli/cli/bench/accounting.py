"""Bytes and FLOPs a forward needs, counted from the loaded model.

What one decode step must read, in bytes (float32, 4 bytes a parameter): the token's embedding
row; in every layer the two norms and every attention weight (the absorbed path multiplies by all
of w_uk and w_uv), then the dense MLP, or the router, the shared experts and the routed experts
the gate picked (counted once each per layer and step); the final norm and lm_head; plus the
latent cache of every position attended to (latent and k_pe of every layer, read once).
A prefill reads the same weights once for all its tokens, with every expert any token picked, so
a short prompt is bound by bytes (held against the matvec probe) and a long one by FLOPs (held
against the GEMM probe).
"""

from __future__ import annotations

import math

from ds2cli.model.attention import absorbed_cost, expanded_cost
from ds2cli.model.config import DeepseekV2Config
from ds2cli.model.layers import Layer
from ds2cli.model.transformer import Model


def params_of(w) -> int:
    return math.prod(w.shape)


def layer_weights(layer: Layer) -> list:
    """Everything every token reads in this layer, routed experts aside (absorbed decode reads
    all of w_uk and w_uv): arrays and weight objects (weights/formats) alike."""
    mlp = [a for name, a in layer.mlp.items() if not name.startswith("experts_")]
    return [layer.input_layernorm, layer.post_attention_layernorm, *layer.self_attn.values(), *mlp]


def layer_params(layer: Layer, matrices_only: bool = False) -> int:
    """Parameters of layer_weights; matrices_only leaves out the norm weights, for counting
    multiply-adds."""
    return sum(params_of(a) for a in layer_weights(layer) if len(a.shape) >= 2 or not matrices_only)


def routed_expert(model: Model) -> list:
    """One routed expert's weights (gate_up, down); none without MoE layers."""
    mlp = next((layer.mlp for layer in model.layers if layer.is_moe), None)
    return [] if mlp is None else [mlp.experts_gate_up[0], mlp.experts_down[0]]


def expert_params(model: Model) -> int:
    """Parameters of one routed expert (gate_proj, up_proj, down_proj); 0 without MoE layers."""
    return sum(params_of(w) for w in routed_expert(model))


def forward_weight_bytes(model: Model, routed_experts: float, tokens: int = 1) -> float:
    """Weight bytes one forward of `tokens` tokens reads when its gates picked `routed_experts`
    distinct routed experts, summed over the MoE layers; each weight is read once per forward,
    in the form it is stored (float32 or low-bit)."""
    embed_row = model.embed_tokens.nbytes / len(model.embed_tokens)
    fixed = (tokens * embed_row + model.norm.nbytes + model.lm_head.nbytes
             + sum(w.nbytes for layer in model.layers for w in layer_weights(layer)))
    return fixed + routed_experts * sum(w.nbytes for w in routed_expert(model))


def storage_format(w) -> str:
    """How a weight is stored, in the ceiling probe's names: a low-bit QuantMatrix's format (q8b
    counts as q8: int8 values, a scale per 32), bfloat16 arrays as bf16, the rest f32; a
    weight made of parts (a stack) as its first part's."""
    if hasattr(w, "parts"):
        return storage_format(w.parts[0])
    f = getattr(w, "f", None)
    if f is not None:
        return "q8" if f.name == "q8b" else f.name
    dtype = getattr(getattr(w, "w", w), "dtype", None)
    return "bf16" if dtype is not None and dtype.name == "bfloat16" else "f32"


def forward_values_by_format(model: Model, routed_experts: float) -> dict[str, float]:
    """Weights one decode step widens and multiplies, by storage format (the embedding row and
    the norms aside: a lookup and vectors): what the ceiling probe's rates divide."""
    out: dict[str, float] = {}
    fixed = [model.lm_head] + [w for layer in model.layers for w in layer_weights(layer) if len(w.shape) >= 2]
    for w in fixed:
        out[storage_format(w)] = out.get(storage_format(w), 0.0) + params_of(w)
    for w in routed_expert(model):
        out[storage_format(w)] = out.get(storage_format(w), 0.0) + routed_experts * params_of(w)
    return out


def ceiling_tok_per_s(values: dict[str, float], rates: dict) -> float:
    """The decode tok/s NumPy's own widen-and-multiply allows for these weights: the time each
    format's values take at its ceiling rate (G weights/s), summed."""
    seconds = sum(n / (rates[f] * 1e9) for f, n in values.items())
    return 1.0 / seconds if seconds > 0 else float("inf")


def attention_macs(cfg: DeepseekV2Config, tokens: int) -> int:
    """Multiply-adds of one layer's attention over `tokens` new tokens into an empty cache, in the
    form the engine picks, less the kv_b_proj work the parameter count already holds."""
    H, C, R = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    d, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    dims = (tokens, tokens, H, C, R, d, v)
    return min(absorbed_cost(*dims), expanded_cost(*dims)) - tokens * H * C * (d + v)


def prefill_flops(model: Model, tokens: int) -> float:
    """2 x multiply-adds of prefilling `tokens` into an empty cache: every token through every
    layer's matrices with top-k routed experts, attention, and lm_head once (forward returns the
    last position's logits only)."""
    cfg = model.config
    per_token = (sum(layer_params(layer, matrices_only=True) for layer in model.layers)
                 + len(cfg.moe_layers) * (cfg.num_experts_per_tok or 0) * expert_params(model))
    attention = cfg.num_hidden_layers * attention_macs(cfg, tokens)
    return 2.0 * (tokens * per_token + attention + params_of(model.lm_head))


def all_weights(model: Model) -> list:
    arrays = [model.embed_tokens, model.norm, model.lm_head]
    for layer in model.layers:
        arrays += [layer.input_layernorm, layer.post_attention_layernorm,
                   *layer.self_attn.values(), *layer.mlp.values()]
    return list({id(a): a for a in arrays}.values())   # a tied lm_head is the embedding, once


def weight_nbytes(model: Model) -> int:
    """Bytes the loaded model's weights hold, in their stored form."""
    return sum(a.nbytes for a in all_weights(model))


def total_params(model: Model) -> int:
    return sum(params_of(a) for a in all_weights(model))
