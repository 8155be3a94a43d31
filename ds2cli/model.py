"""The DeepSeek-V2 model: embed -> blocks (MLA + dense MLP or MoE) -> norm -> lm_head over a
LatentCache. loader.py builds it from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ds2cli import cores, rope
from ds2cli.attention import mla, rms_norm
from ds2cli.cache import LatentCache
from ds2cli.config import DeepseekV2Config
from ds2cli.errors import ContextFullError, Ds2Error
from ds2cli.linear import as_weight
from ds2cli.moe import moe, swiglu
from ds2cli.tokenizer import Tokenizer


class Model:
    """A loaded DeepSeek-V2 checkpoint. `forward` appends tokens to a LatentCache and returns logits."""

    def __init__(self, config: DeepseekV2Config, weights: dict, tokenizer: Tokenizer | None,
                 generation_config: dict | None = None, path: Path | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.generation_config = generation_config or {}
        self.path = path
        self.embed_tokens = as_weight(weights["embed_tokens"])               # (V, D)
        self.norm = weights["norm"]                                          # (D,)
        # a tied head is the embedding itself, one object
        self.lm_head = (self.embed_tokens if weights["lm_head"] is weights["embed_tokens"]
                        else as_weight(weights["lm_head"]))                  # (V, D)
        self.layers = weights["layers"]
        self.inv_freq = rope.inv_freq(config)                                # (R/2,)
        self.rope_scale = rope.cos_sin_scale(config.rope_scaling, config.is_v3)
        self.softmax_scale = rope.softmax_scale(config)
        self.quantization = None     # the QuantConfig of low-bit weights (qcheckpoint.py), set by the loader

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
        return LatentCache(cfg.num_hidden_layers, capacity, cfg.kv_lora_rank, cfg.qk_rope_head_dim)

    def forward(self, token_ids, cache: LatentCache, all_logits: bool = False, trace: list | None = None) -> np.ndarray:
        """Run `token_ids` after what `cache` holds; return float32 logits for the last position
        (V,), or for every new position (T, V) with all_logits. With `trace`, each MoE layer
        appends the expert ids its gate chose (T, k): what the forward pass read."""
        cfg = self.config
        ids = np.asarray(token_ids).reshape(-1)
        if len(ids) == 0:
            raise Ds2Error("forward needs at least one token")
        if ids.dtype.kind not in "iu":                       # 5.0 or "5" is a caller's bug, not token 5
            raise Ds2Error(f"token ids must be integers, got {ids.dtype} values")
        ids = ids.astype(np.int64)
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise Ds2Error(f"token id out of range [0, {cfg.vocab_size}): {int(ids.max() if ids.max() >= cfg.vocab_size else ids.min())}")
        cache.check_room(len(ids))
        with cores.forward_pass(low_bit=self.quantization is not None, tokens=len(ids)):
            return self._forward(ids, cache, all_logits, trace)

    def _forward(self, ids: np.ndarray, cache: LatentCache, all_logits: bool, trace: list | None) -> np.ndarray:
        cfg = self.config
        start = cache.length
        cos, sin = rope.cos_sin(np.arange(start, start + len(ids)), self.inv_freq, self.rope_scale)
        x = self.embed_tokens.rows(ids)                                      # (T, D)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer["input_layernorm"], cfg.rms_norm_eps)
            x = x + mla(h, layer["attn"], cache.latent[i], cache.k_pe[i], start, cos, sin,
                        cfg.num_attention_heads, cfg.rms_norm_eps, self.softmax_scale)
            h = rms_norm(x, layer["post_attention_layernorm"], cfg.rms_norm_eps)
            w = layer["mlp"]
            x = x + (moe(h, w, cfg, trace) if layer["is_moe"] else swiglu(h, w["gate_up"], w["down_proj"]))
        cache.length = start + len(ids)
        x = rms_norm(x if all_logits else x[-1:], self.norm, cfg.rms_norm_eps)
        logits = self.lm_head.matmul(x)                                      # (T or 1, V)
        return logits if all_logits else logits[0]
