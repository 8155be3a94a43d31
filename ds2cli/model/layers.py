"""A decoder layer's weights as typed objects, Hugging Face's names as field names (prepared at
load by weights/loader.py: RoPE rows de-interleaved, kv_b_proj split into w_uk and w_uv, each
MLP's gate_proj and up_proj fused into gate_up, the routed experts stacked).

Every matrix is a weight you can multiply by (linear.py); norms, the router gate and V3's
router bias are arrays. `items()` lists a part's fields that are set, for code that walks them
(the file layout, the accounting)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator


class Part:
    """A layer's part whose fields are its weights, some of which may be absent (None)."""

    def items(self) -> Iterator[tuple[str, Any]]:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                yield f.name, value

    def keys(self) -> list[str]:
        return [k for k, _ in self.items()]

    def __contains__(self, key: str) -> bool:
        return getattr(self, key, None) is not None

    def __getitem__(self, key: str):
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value) -> None:
        if key not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(key)
        setattr(self, key, value)

    def values(self) -> list:
        return [v for _, v in self.items()]


@dataclasses.dataclass(eq=False)
class Attention(Part):
    """DeepseekV2Attention (self_attn): q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj when
    q_lora_rank is set; kv_a_proj_with_mqa (C+R, D); kv_a_layernorm (C,); kv_b_proj as
    w_uk (H, d, C) and w_uv (H, C, v), stacks of per-head matrices (linear.Heads); o_proj (D, H*v)."""
    kv_a_proj_with_mqa: Any = None
    kv_a_layernorm: Any = None
    w_uk: Any = None
    w_uv: Any = None
    o_proj: Any = None
    q_proj: Any = None
    q_a_proj: Any = None
    q_a_layernorm: Any = None
    q_b_proj: Any = None


@dataclasses.dataclass(eq=False)
class MLP(Part):
    """DeepseekV2MLP of a dense layer: gate_up (2I, D) = [gate_proj; up_proj], down_proj (D, I)."""
    gate_up: Any = None
    down_proj: Any = None


@dataclasses.dataclass(eq=False)
class MoE(Part):
    """DeepseekV2MoE: the router gate (E, D) (and V3's e_score_correction_bias (E,)), the routed
    experts stacked as experts_gate_up (E, 2I, D) and experts_down (E, D, I), the shared experts
    as one MLP, shared_gate_up (2I_s, D) and shared_down (D, I_s), when the model has them."""
    gate: Any = None
    experts_gate_up: Any = None
    experts_down: Any = None
    e_score_correction_bias: Any = None
    shared_gate_up: Any = None
    shared_down: Any = None


@dataclasses.dataclass(eq=False)
class Layer:
    """DeepseekV2DecoderLayer: input_layernorm -> self_attn -> post_attention_layernorm -> mlp."""
    input_layernorm: Any
    self_attn: Attention
    post_attention_layernorm: Any
    mlp: MLP | MoE

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoE)

    def parts(self) -> Iterator[tuple[str, Part]]:
        """("attn", self_attn), ("mlp", mlp): the parts as ds2's file layout names them."""
        yield "attn", self.self_attn
        yield "mlp", self.mlp

    def part(self, name: str) -> Part:
        return self.self_attn if name == "attn" else self.mlp


def new_part(name: str, moe: bool) -> Part:
    """An empty part for ds2's file layout's name of it ("attn" or "mlp")."""
    return Attention() if name == "attn" else MoE() if moe else MLP()


@dataclasses.dataclass(eq=False)
class Weights:
    """A whole model's weights: model.embed_tokens (V, D), the decoder layers, model.norm (D,)
    and lm_head (V, D) (the embedding itself when tied)."""
    embed_tokens: Any
    layers: list[Layer]
    norm: Any
    lm_head: Any
    streamed: Any = None      # the routed experts' cache (weights/expert_cache.py) when they are
                              # read from disk as they are needed (--memory-budget), else None
