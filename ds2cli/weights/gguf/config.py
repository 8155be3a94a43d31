"""A GGUF's `deepseek2.*` metadata -> ds2's DeepseekV2Config (the config.json field names).

What is required and what is defaulted follows llama.cpp's own loader (src/models/deepseek2.cpp
load_arch_hparams and llama_model::load_hparams), so that the older files it still loads load
here too:
  required  block_count, context_length, embedding_length, attention.head_count,
            attention.layer_norm_rms_epsilon, attention.kv_lora_rank, expert_feed_forward_length,
            expert_shared_count, rope.dimension_count (llama.cpp defaults it to the key length,
            which no deepseek2 file relies on: ds2 asks for it)
  defaulted leading_dense_block_count 0, expert_count 0 (no MoE), expert_weights_scale 1 (not
            scaled), expert_weights_norm false, expert_gating_func softmax (V2 and V2.5 files
            predate the key), rope.freq_base 10000, rope.scaling.type none, beta_fast 32,
            beta_slow 1, original_context_length = context_length, yarn_log_multiplier 0
Two layouts of head sizes: files written since llama.cpp's MLA rework store key_length_mla /
value_length_mla (nope+rope, v) and key_length / value_length as the latent's (C+R, C); older
files store key_length = nope+rope and value_length = v and no *_mla key.

Where llama.cpp needs attention.q_lora_rank (every file not of V2-Lite's 26/27 layers), ds2
reads the LoRA rank from the key when present and otherwise from attn_q_a's shape, and a file
with a plain attn_q needs none: ds2 runs the small plain-q slices llama.cpp refuses.

What GGUF cannot say, and what ds2 assumes (each is what llama.cpp computes):
  moe_layer_freq 1          every layer from leading_dense_block_count on is MoE
  mscale = mscale_all_dim   GGUF stores one YaRN factor, rope.scaling.yarn_log_multiplier =
                            0.1 * mscale_all_dim; a config.json with mscale != mscale_all_dim
                            (cos/sin scaled by their ratio) has no GGUF form
  topk_method               group_limited_greedy when expert_group_count > 1 and the gate is a
                            softmax (DeepSeek-V2); noaux_tc with sigmoid gating and exp_probs_b
                            (DeepSeek-V3, as model_type deepseek_v3); greedy otherwise
  hidden_act silu, attention_bias false, tie_word_embeddings = no output.weight stored
"""

from __future__ import annotations

from ds2cli.model.config import DeepseekV2Config
from ds2cli.errors import ConfigError
from ds2cli.weights.gguf.file import GGUFFile

ARCHITECTURE = "deepseek2"
GATING = {1: "softmax", 2: "sigmoid"}        # llama_expert_gating_func_type; 0: unset -> softmax
YARN_LOG_MUL_FACTOR = 0.1                     # convert_hf_to_gguf writes 0.1 * mscale_all_dim


class Metadata:
    """`deepseek2.<key>` lookups that name the key a file lacks or gets wrong."""

    def __init__(self, gf: GGUFFile):
        self.gf, self.fields = gf, gf.fields

    def get(self, key: str, default=None, kind: type = int, prefix: str = ARCHITECTURE + "."):
        name = prefix + key
        if name not in self.fields:
            if default is ConfigError:
                raise ConfigError(f"{self.gf.name}: GGUF metadata key {name} is missing (llama.cpp requires it too)")
            return default
        value = self.fields[name]
        if isinstance(value, list):
            if not value or any(v != value[0] for v in value):
                raise ConfigError(f"{self.gf.name}: GGUF metadata {name} differs between layers ({value[:8]}...), "
                                  f"which ds2 does not support")
            value = value[0]
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigError(f"{self.gf.name}: GGUF metadata {name} should be {kind.__name__}, got {value!r}")
        return value


def check_architecture(gf: GGUFFile) -> None:
    arch = gf.fields.get("general.architecture")
    if arch != ARCHITECTURE:
        raise ConfigError(f"{gf.name} is a GGUF of architecture {arch!r}; ds2 runs {ARCHITECTURE!r} "
                          f"(DeepSeek-V2, V2-Lite, V2.5, Coder-V2, V3)")


def config_from_gguf(gf: GGUFFile) -> DeepseekV2Config:
    """The config.json a GGUF's metadata stands for, checked by DeepseekV2Config's own validation
    (the tensors are checked against it by gguf_tensors.problems)."""
    check_architecture(gf)
    m, req = Metadata(gf), ConfigError
    layers = m.get("block_count", req) - m.get("nextn_predict_layers", 0)
    check_block_count(gf, m.get("block_count", req))
    D, H = m.get("embedding_length", req), m.get("attention.head_count", req)
    for key, value in (("embedding_length", D), ("attention.head_count", H)):
        if value < 1:
            raise ConfigError(f"{gf.name}: GGUF metadata {ARCHITECTURE}.{key} is {value}; it must be at least 1")
    C, R = m.get("attention.kv_lora_rank", req), m.get("rope.dimension_count", req)
    if m.get("attention.key_length_mla") is not None:
        k_len, v_len = m.get("attention.key_length_mla"), m.get("attention.value_length_mla", req)
    else:   # the older layout: key/value lengths are the per-head sizes
        k_len, v_len = m.get("attention.key_length", D // H), m.get("attention.value_length", D // H)
    experts = m.get("expert_count", 0)
    check_expert_count(gf, experts)
    gating = GATING.get(m.get("expert_gating_func", 0) or 1)   # 0 / absent: softmax, as llama.cpp
    if gating is None:
        raise ConfigError(f"{gf.name}: expert_gating_func {m.get('expert_gating_func')} is not softmax (1) "
                          f"or sigmoid (2)")
    groups, groups_used = m.get("expert_group_count"), m.get("expert_group_used_count")
    v3 = gating == "sigmoid" and any(n.endswith(".exp_probs_b.bias") for n in gf.tensors)
    d = {
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "vocab_size": vocab_size(gf, m),
        "hidden_size": D,
        "num_hidden_layers": layers,
        "num_attention_heads": H,
        "max_position_embeddings": m.get("context_length", req),
        "rms_norm_eps": m.get("attention.layer_norm_rms_epsilon", req, float),
        "kv_lora_rank": C,
        "qk_rope_head_dim": R,
        "qk_nope_head_dim": k_len - R,
        "v_head_dim": v_len,
        "q_lora_rank": q_lora_rank(gf, m),
        "first_k_dense_replace": m.get("leading_dense_block_count", 0),
        "moe_intermediate_size": m.get("expert_feed_forward_length", req),
        "n_shared_experts": m.get("expert_shared_count", req),
        "routed_scaling_factor": m.get("expert_weights_scale", 1.0, float) or 1.0,
        "norm_topk_prob": m.get("expert_weights_norm", False, bool),
        "scoring_func": gating,
        "rope_theta": m.get("rope.freq_base", 10000.0, float),
        "rope_scaling": rope_scaling(gf, m),
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "bos_token_id": gf.fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gf.fields.get("tokenizer.ggml.eos_token_id"),
    }
    if experts:
        d.update(n_routed_experts=experts, num_experts_per_tok=m.get("expert_used_count", req))
        if v3:
            d.update(topk_method="noaux_tc", n_group=groups or 1, topk_group=groups_used or 1)
        elif groups and groups > 1:
            d.update(topk_method="group_limited_greedy", n_group=groups, topk_group=groups_used or groups)
    # the dense layers' width; a file with no dense layer may omit it
    d["intermediate_size"] = m.get("feed_forward_length", req if d["first_k_dense_replace"] else
                                   d["moe_intermediate_size"])
    if v3:
        d.update(V3_FIELDS)
    return DeepseekV2Config.from_dict({k: v for k, v in d.items() if v is not None or k == "q_lora_rank"})


def check_block_count(gf: GGUFFile, blocks: int) -> None:
    """The layer count must be what the tensors hold (blk.0 .. blk.N-1): the checks and the loader
    build names per layer, so a count far beyond the tensors must stop here."""
    found = {int(n.split(".")[1]) for n in gf.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if blocks < 1 or (found and blocks > max(found) + 1) or (not found and gf.tensors):
        held = f"tensors for blk.0 to blk.{max(found)}" if found else "no blk.* tensors"
        raise ConfigError(f"{gf.name}: GGUF metadata {ARCHITECTURE}.block_count is {blocks}, but the file "
                          f"holds {held}")


def check_expert_count(gf: GGUFFile, experts: int) -> None:
    """The expert count must be what the stacked expert tensors hold: the loader and the checks
    build a name per expert and layer, so a count far beyond the tensors must stop here."""
    stacked = {int(t.shape[-1]) for n, t in gf.tensors.items() if n.endswith("_exps.weight") and len(t.shape) == 3}
    if experts < 0 or (experts and stacked != {experts}):
        held = f"the expert tensors hold {', '.join(map(str, sorted(stacked)))}" if stacked else \
            "the file holds no expert tensors"
        raise ConfigError(f"{gf.name}: GGUF metadata {ARCHITECTURE}.expert_count is {experts}, but {held}")


# config.json fields a V3 config may not omit, with the values DeepSeek-V3's own config holds
V3_FIELDS = {"num_nextn_predict_layers": 0}


def vocab_size(gf: GGUFFile, m: Metadata) -> int:
    """deepseek2.vocab_size, else the token list's length (as llama.cpp counts it), else the
    embedding's rows; any two that disagree are an error."""
    emb = gf.tensors.get("token_embd.weight")
    rows = int(emb.shape[1]) if emb is not None and len(emb.shape) == 2 else None
    tokens = gf.fields.get("tokenizer.ggml.tokens")
    n = m.get("vocab_size") or (len(tokens) if isinstance(tokens, list) else None) or rows
    if n is None:
        raise ConfigError(f"{gf.name}: no vocab_size, no tokenizer.ggml.tokens and no token_embd.weight")
    if rows is not None and rows != n:
        raise ConfigError(f"{gf.name}: the vocabulary has {n} tokens but token_embd.weight has {rows} rows")
    return n


def q_lora_rank(gf: GGUFFile, m: Metadata) -> int | None:
    """None for a plain attn_q; else the key, or attn_q_a's output width when the key is absent
    (gguf_tensors.problems checks the key against the shape)."""
    q_a = gf.tensors.get("blk.0.attn_q_a.weight")
    if q_a is None:
        return None
    return m.get("attention.q_lora_rank") or int(q_a.shape[1])


def rope_scaling(gf: GGUFFile, m: Metadata) -> dict | None:
    kind = m.get("rope.scaling.type", "none", str)
    factor = m.get("rope.scaling.factor", 0.0, float)
    if kind == "none" or (kind == "linear" and factor in (0.0, 1.0)):
        return None
    if kind != "yarn":
        raise ConfigError(f"{gf.name}: rope.scaling.type {kind!r} is not one ds2 runs for deepseek2 (yarn or none)")
    mscale = m.get("rope.scaling.yarn_log_multiplier", 0.0, float) / YARN_LOG_MUL_FACTOR
    return {"type": "yarn", "rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": m.get("rope.scaling.original_context_length",
                                                      m.get("context_length")),
            "beta_fast": m.get("rope.scaling.yarn_beta_fast", 32.0, float),
            "beta_slow": m.get("rope.scaling.yarn_beta_slow", 1.0, float),
            "mscale": mscale, "mscale_all_dim": mscale}
