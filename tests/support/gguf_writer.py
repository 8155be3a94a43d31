"""Test helper: a Hugging Face checkpoint directory -> a GGUF file the way llama.cpp's
convert_hf_to_gguf.py (DeepseekV2Model) writes it, with gguf's own GGUFWriter and its NumPy
quantizers (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16). `layout="split"` is today's converter
(attn_k_b transposed + attn_v_b, key/value_length_mla), `layout="combined"` the older one
(attn_kv_b, key_length = nope + rope). tests/data/gguf holds fixtures made by llama.cpp itself;
this writer makes the variants (every reference case, every type, broken files) in tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors import safe_open

from ds2cli.model.config import DeepseekV2Config

NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a",
         "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
         "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
         "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
         "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def read_hf(model_dir: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as s:
            for k in s.keys():
                out[k] = s.get_tensor(k).astype(np.float32)
    return out


def gguf_tensors(model_dir: Path, cfg: DeepseekV2Config, layout: str) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in NumPy order (gguf's writer reverses it into GGUF's)."""
    hf, out = read_hf(model_dir), {}
    for name, g in TOP.items():
        if name in hf:
            out[g] = hf[name]
    H, d, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf_key, g in NAMES.items():
            w = hf.get(p + hf_key + ".weight")
            if w is None:
                continue
            if g == "attn_kv_b" and layout == "split":
                kv_b = w.reshape(H, d + v, -1)
                out[f"blk.{i}.attn_k_b.weight"] = np.ascontiguousarray(kv_b[:, :d].transpose(0, 2, 1))  # (H,C,d)
                out[f"blk.{i}.attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, d:])                     # (H,v,C)
            else:
                out[f"blk.{i}.{g}.weight"] = w
        if cfg.is_moe_layer(i):
            for kind, g in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                out[f"blk.{i}.{g}.weight"] = np.stack(
                    [hf[f"{p}mlp.experts.{e}.{kind}.weight"] for e in range(cfg.n_routed_experts)])
            if p + "mlp.gate.e_score_correction_bias" in hf:
                out[f"blk.{i}.exp_probs_b.bias"] = hf[p + "mlp.gate.e_score_correction_bias"]
    return out


def add_metadata(w: gguf.GGUFWriter, cfg: DeepseekV2Config, layout: str) -> None:
    a = "deepseek2."
    w.add_uint32(a + "block_count", cfg.num_hidden_layers)
    w.add_uint32(a + "context_length", cfg.max_position_embeddings)
    w.add_uint32(a + "embedding_length", cfg.hidden_size)
    w.add_uint32(a + "feed_forward_length", cfg.intermediate_size)
    w.add_uint32(a + "attention.head_count", cfg.num_attention_heads)
    w.add_uint32(a + "attention.head_count_kv", 1 if layout == "split" else cfg.num_attention_heads)
    w.add_float32(a + "rope.freq_base", cfg.rope_theta)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(a + "expert_count", cfg.n_routed_experts)
    w.add_uint32(a + "expert_used_count", cfg.num_experts_per_tok)
    if cfg.n_group:
        w.add_uint32(a + "expert_group_count", cfg.n_group)
        w.add_uint32(a + "expert_group_used_count", cfg.topk_group)
    w.add_uint32(a + "expert_gating_func", 1 if cfg.scoring_func == "softmax" else 2)
    R = cfg.qk_rope_head_dim
    if layout == "split":
        w.add_uint32(a + "attention.key_length", cfg.kv_lora_rank + R)
        w.add_uint32(a + "attention.value_length", cfg.kv_lora_rank)
        w.add_uint32(a + "attention.key_length_mla", cfg.qk_nope_head_dim + R)
        w.add_uint32(a + "attention.value_length_mla", cfg.v_head_dim)
    else:
        w.add_uint32(a + "attention.key_length", cfg.qk_nope_head_dim + R)
        w.add_uint32(a + "attention.value_length", cfg.v_head_dim)
    w.add_uint32(a + "leading_dense_block_count", cfg.first_k_dense_replace)
    w.add_uint32(a + "vocab_size", cfg.vocab_size)
    if cfg.q_lora_rank:
        w.add_uint32(a + "attention.q_lora_rank", cfg.q_lora_rank)
    w.add_uint32(a + "attention.kv_lora_rank", cfg.kv_lora_rank)
    w.add_uint32(a + "expert_feed_forward_length", cfg.moe_intermediate_size)
    w.add_uint32(a + "expert_shared_count", cfg.n_shared_experts)
    w.add_float32(a + "expert_weights_scale", cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_bool(a + "expert_weights_norm", True)
    w.add_uint32(a + "rope.dimension_count", R)
    rs = cfg.rope_scaling
    if rs:
        w.add_string(a + "rope.scaling.type", "yarn")
        w.add_float32(a + "rope.scaling.factor", rs["factor"])
        w.add_uint32(a + "rope.scaling.original_context_length", rs["original_max_position_embeddings"])
        w.add_float32(a + "rope.scaling.yarn_beta_fast", rs.get("beta_fast", 32))
        w.add_float32(a + "rope.scaling.yarn_beta_slow", rs.get("beta_slow", 1))
        w.add_float32(a + "rope.scaling.yarn_log_multiplier", 0.1 * rs["mscale_all_dim"])


def add_tokenizer(w: gguf.GGUFWriter, model_dir: Path, vocab_size: int, pre: str = "deepseek-llm") -> None:
    """tokenizer.json -> tokenizer.ggml.*, as the converter's _set_vocab_gpt2 does it."""
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    cfg_path = model_dir / "tokenizer_config.json"
    tc = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    vocab = dict(tj["model"]["vocab"])
    added = {t["content"]: t for t in tj["added_tokens"]}
    vocab.update({t: a["id"] for t, a in added.items()})
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]"), types.append(gguf.TokenType.UNUSED)
        elif t in added:
            tokens.append(t), types.append(gguf.TokenType.CONTROL if added[t]["special"] else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(t), types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id)):
        tok = tc.get(key)
        tok = tok.get("content") if isinstance(tok, dict) else tok
        if tok in vocab:
            add(vocab[tok])
    if "add_bos_token" in tc:
        w.add_add_bos_token(bool(tc["add_bos_token"]))
    if tc.get("chat_template"):
        w.add_chat_template(tc["chat_template"])


def quantized(name: str, x: np.ndarray, qtype: str):
    """(data, raw_dtype) of x in qtype where its rows allow it; 1-D tensors, the router and rows
    shorter than a block stay float32, as llama-quantize leaves or falls back on them."""
    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if qtype == "F32" or x.ndim < 2 or "ffn_gate_inp" in name or x.shape[-1] % block:
        return x.astype(np.float32), None
    if qtype == "F16":
        return x.astype(np.float16), None
    return gguf.quants.quantize(x, kind), kind


def write_gguf(model_dir: Path, out: Path, qtype: str = "F32", layout: str = "split",
               drop: tuple[str, ...] = (), split_max_tensors: int = 0, pre: str = "deepseek-llm",
               metadata=None) -> Path:
    """`metadata(writer)`, when given, adds or replaces keys after the converter's own."""
    cfg = DeepseekV2Config.from_file(model_dir / "config.json")
    w = gguf.GGUFWriter(out, "deepseek2", split_max_tensors=split_max_tensors)
    add_metadata(w, cfg, layout)
    add_tokenizer(w, model_dir, cfg.vocab_size, pre)
    if metadata is not None:
        metadata(w)
    for name, x in gguf_tensors(model_dir, cfg, layout).items():
        if name in drop:
            continue
        data, raw = quantized(name, x, qtype)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
