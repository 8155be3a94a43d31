"""config.json -> a frozen, validated `DeepseekV2Config` with the original DeepSeek field names."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from ds2cli.errors import ConfigError
from ds2cli.json_files import read_json_object

SUPPORTED_MODEL_TYPES = ("deepseek_v2",)
TOPK_METHODS = ("greedy", "group_limited_greedy")
# The DeepSeek-V3 family keeps V2's architecture and changes the router (sigmoid scores,
# noaux_tc choice with a correction bias), the weight format (fp8 blocks) and adds MTP layers.
# Kimi-K2 ships model_type kimi_k2 with DeepSeek-V3's architecture.
V3_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
V3_ARCHITECTURE = "DeepseekV3ForCausalLM"
V3_TOPK_METHODS = ("noaux_tc",)
V3_SCORING_FUNCS = ("sigmoid",)
QUANT_METHODS = ("fp8",)
DS2_QUANT_METHOD = "ds2"  # qcheckpoint.QUANT_METHOD: `ds2 quantize`'s own low-bit layout
# transformers' DeepseekV3Config defaults for the fields whose V2 default differs; a V3
# config.json that omits one of them means these values, as it does to transformers.
V3_DEFAULTS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 8, "topk_group": 4,
               "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
               "n_shared_experts": 1}


@dataclasses.dataclass(frozen=True)
class DeepseekV2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int | None = None
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    model_type: str = "deepseek_v2"
    # DeepSeek-V3 family only (a deepseek_v2 config keeps these defaults whatever it holds)
    rope_interleave: bool = True          # False: q_pe/k_pe rows are already in rotate_half order
    num_nextn_predict_layers: int = 0     # MTP layers stored after the decoder; never run
    quantization_config: dict | None = None  # {quant_method: fp8, fmt: e4m3, weight_block_size}

    # ---- derived ----
    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (eos,)

    @property
    def is_v3(self) -> bool:
        """The DeepSeek-V3 family: sigmoid/noaux_tc router, optional fp8 weights and MTP layers."""
        return self.model_type in V3_MODEL_TYPES

    @property
    def mtp_layers(self) -> list[int]:
        """Indices of the stored multi-token-prediction layers, which inference never reads."""
        return list(range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers))

    def is_moe_layer(self, layer_idx: int) -> bool:
        """The original DeepseekV2DecoderLayer's rule for choosing DeepseekV2MoE over a dense MLP.
        DeepseekV3DecoderLayer (transformers, and DeepSeek's own inference code) has no
        moe_layer_freq: every layer from first_k_dense_replace on is MoE."""
        freq = 1 if self.is_v3 else self.moe_layer_freq
        return (self.n_routed_experts is not None
                and layer_idx >= self.first_k_dense_replace
                and layer_idx % freq == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def dense_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i)]

    @staticmethod
    def from_dict(d: dict) -> "DeepseekV2Config":
        return _parse(d)

    @staticmethod
    def from_file(path: str | Path) -> "DeepseekV2Config":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"no config.json in {path.parent}")
        return _parse(read_json_object(path, ConfigError))


# Far beyond any real checkpoint (DeepSeek-V3 has 61 layers); a hostile count must not make
# per-layer lists (moe_layers, the expected tensor names) too large to build.
MAX_LAYERS = 100_000

# Which fields must be present and what kind of value each takes. Types are checked by hand
# because a config.json written by a human or another tool is untrusted input.
_REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim")
_OPTIONAL_POSITIVE_INTS = ("q_lora_rank", "moe_intermediate_size", "n_routed_experts",
                           "num_experts_per_tok", "n_group", "topk_group")
_NONNEG_INTS = ("first_k_dense_replace", "n_shared_experts")
_POSITIVE_INTS = ("moe_layer_freq", "max_position_embeddings")
_FLOATS = ("routed_scaling_factor", "rms_norm_eps", "rope_theta")
_BOOLS = ("norm_topk_prob", "tie_word_embeddings", "attention_bias")
_STRINGS = ("topk_method", "scoring_func", "hidden_act")
V3_ONLY_FIELDS = ("rope_interleave", "num_nextn_predict_layers", "quantization_config")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _check_int(d: dict, key: str, minimum: int) -> None:
    v = d[key]
    if not _is_int(v):
        raise ConfigError(f"config field {key} must be an integer, got {v!r}")
    if v < minimum:
        raise ConfigError(f"config field {key} must be >= {minimum}, got {v}")


def _rope_from_parameters(d: dict) -> dict:
    """Newer transformers write `rope_parameters` (theta and scaling together) instead of
    `rope_theta` + `rope_scaling`; map it back to the original names."""
    rp = d["rope_parameters"]
    if not isinstance(rp, dict):
        raise ConfigError(f"config field rope_parameters must be an object, got {rp!r}")
    d = dict(d)
    if "rope_theta" in rp:
        d["rope_theta"] = rp["rope_theta"]
    kind = rp.get("rope_type", rp.get("type", "default"))
    d["rope_scaling"] = None if kind == "default" else dict(rp)
    return d


def _check_rope_scaling(rs: Any) -> dict | None:
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"config field rope_scaling must be an object or null, got {rs!r}")
    kind = rs.get("type", rs.get("rope_type"))
    if kind in (None, "default") and "factor" not in rs:
        return None
    if kind != "yarn":
        raise ConfigError(f"unsupported rope_scaling type {kind!r} (ds2 supports yarn or none)")
    if "factor" not in rs:
        raise ConfigError("rope_scaling of type yarn needs a factor")
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                "mscale", "mscale_all_dim"):
        if key in rs and not _is_number(rs[key]):
            raise ConfigError(f"rope_scaling.{key} must be a number, got {rs[key]!r}")
    if rs["factor"] <= 0:
        raise ConfigError(f"rope_scaling.factor must be > 0, got {rs['factor']}")
    if rs.get("original_max_position_embeddings", 4096) <= 0:
        raise ConfigError("rope_scaling.original_max_position_embeddings must be > 0")
    return dict(rs)


def _check_token_ids(d: dict) -> None:
    bos = d.get("bos_token_id")
    if bos is not None and not (_is_int(bos) and bos >= 0):
        raise ConfigError(f"config field bos_token_id must be a non-negative integer, got {bos!r}")
    eos = d.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise ConfigError(f"config field eos_token_id must be an integer or a list of them, got {eos!r}")


def _check_moe(d: dict) -> None:
    if d.get("n_routed_experts") is None:
        return
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if d.get(key) is None:
            raise ConfigError(f"config field {key} is required when n_routed_experts is set")
    n, k = d["n_routed_experts"], d["num_experts_per_tok"]
    if k > n:
        raise ConfigError(f"num_experts_per_tok ({k}) is larger than n_routed_experts ({n})")
    if d["topk_method"] in ("group_limited_greedy", "noaux_tc"):
        n_group, topk_group = d.get("n_group"), d.get("topk_group")
        if n_group is None or topk_group is None:
            raise ConfigError(f"topk_method {d['topk_method']} needs n_group and topk_group")
        if n % n_group:
            raise ConfigError(f"n_routed_experts ({n}) is not divisible by n_group ({n_group})")
        if topk_group > n_group:
            raise ConfigError(f"topk_group ({topk_group}) is larger than n_group ({n_group})")
        if topk_group * (n // n_group) < k:
            raise ConfigError(f"topk_group ({topk_group}) groups of {n // n_group} experts "
                              f"hold fewer than num_experts_per_tok ({k})")
        if d["topk_method"] == "noaux_tc" and n // n_group < 2:
            raise ConfigError(f"topk_method noaux_tc ranks each group by its two best experts, but "
                              f"n_routed_experts ({n}) / n_group ({n_group}) leaves groups of one")


def is_v3_family(raw: dict) -> bool:
    """deepseek_v3, or kimi_k2 when it declares DeepSeek-V3's architecture."""
    model_type, arch = raw.get("model_type"), raw.get("architectures")
    if model_type == "deepseek_v3":
        return True
    return model_type == "kimi_k2" and isinstance(arch, list) and V3_ARCHITECTURE in arch


def _check_v3(d: dict) -> None:
    """The V3 family's router, layout and storage fields; V3_DEFAULTS fill the absent ones."""
    for key, value in V3_DEFAULTS.items():
        d.setdefault(key, value)
    if d["topk_method"] not in V3_TOPK_METHODS:
        raise ConfigError(f"unsupported topk_method {d['topk_method']!r} for model_type "
                          f"{d['model_type']!r} (ds2 supports {', '.join(V3_TOPK_METHODS)})")
    if d["scoring_func"] not in V3_SCORING_FUNCS:
        raise ConfigError(f"unsupported scoring_func {d['scoring_func']!r} for model_type "
                          f"{d['model_type']!r} (ds2 supports {', '.join(V3_SCORING_FUNCS)})")
    if d.get("rope_interleave") is not None and not isinstance(d["rope_interleave"], bool):
        raise ConfigError(f"config field rope_interleave must be true or false, got {d['rope_interleave']!r}")
    if d.get("num_nextn_predict_layers") is not None:
        _check_int(d, "num_nextn_predict_layers", 0)
        if d["num_nextn_predict_layers"] > MAX_LAYERS:
            raise ConfigError(f"config field num_nextn_predict_layers must be <= {MAX_LAYERS}")
    rs = d.get("rope_scaling")
    if isinstance(rs, dict) and rs.get("attention_factor") is not None and not _is_number(rs["attention_factor"]):
        raise ConfigError(f"rope_scaling.attention_factor must be a number, got {rs['attention_factor']!r}")
    qc = d.get("quantization_config")
    if qc is None:
        return
    if not isinstance(qc, dict):
        raise ConfigError(f"config field quantization_config must be an object, got {qc!r}")
    if qc.get("quant_method") == DS2_QUANT_METHOD:  # read by qcheckpoint, not an fp8 checkpoint
        d["quantization_config"] = None
        return
    if qc.get("quant_method") not in QUANT_METHODS:
        raise ConfigError(f"unsupported quantization_config.quant_method {qc.get('quant_method')!r} "
                          f"(ds2 reads {', '.join(QUANT_METHODS)} block-scaled weights and its own "
                          f"{DS2_QUANT_METHOD!r} low-bit checkpoints)")
    # fmt and weight_block_size are checked against the stored tensors (checkpoint.problems),
    # so that a mismatch names the tensors it concerns.


def _parse(raw: dict) -> DeepseekV2Config:
    model_type = raw.get("model_type")
    v3 = is_v3_family(raw)
    if model_type not in SUPPORTED_MODEL_TYPES and not v3:
        raise ConfigError(f"not a DeepSeek-V2 checkpoint: model_type is {model_type!r}, "
                          f"ds2 runs model_type 'deepseek_v2', 'deepseek_v3' "
                          f"(and 'kimi_k2' with architectures {V3_ARCHITECTURE})")
    d = _rope_from_parameters(raw) if "rope_parameters" in raw and "rope_scaling" not in raw else dict(raw)
    if not v3:  # a V2 config is read exactly as before, whatever V3 fields it may hold
        for key in V3_ONLY_FIELDS:
            d.pop(key, None)
    fields = {f.name: f for f in dataclasses.fields(DeepseekV2Config)}
    for key in _REQUIRED_INTS:
        if key not in d:
            raise ConfigError(f"config.json is missing the required field {key}")
        _check_int(d, key, 1)
    if d["num_hidden_layers"] > MAX_LAYERS:
        raise ConfigError(f"config field num_hidden_layers must be <= {MAX_LAYERS}, "
                          f"got {d['num_hidden_layers']}")
    for key in _OPTIONAL_POSITIVE_INTS:
        if d.get(key) is not None:
            _check_int(d, key, 1)
    for key in _NONNEG_INTS + _POSITIVE_INTS:
        if d.get(key) is not None:
            _check_int(d, key, 0 if key in _NONNEG_INTS else 1)
    for key in _FLOATS:
        if key in d and not _is_number(d[key]):
            raise ConfigError(f"config field {key} must be a number, got {d[key]!r}")
    for key in _BOOLS:
        if key in d and d[key] is not None and not isinstance(d[key], bool):
            raise ConfigError(f"config field {key} must be true or false, got {d[key]!r}")
    for key in _STRINGS:
        if key in d and not isinstance(d[key], str):
            raise ConfigError(f"config field {key} must be a string, got {d[key]!r}")
    if v3:
        _check_v3(d)
    else:
        d.setdefault("topk_method", "greedy")
        if d["topk_method"] not in TOPK_METHODS:
            raise ConfigError(f"unsupported topk_method {d['topk_method']!r} (ds2 supports greedy, group_limited_greedy)")
        if d.get("scoring_func", "softmax") != "softmax":
            raise ConfigError(f"unsupported scoring_func {d['scoring_func']!r} (ds2 supports softmax)")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act {d['hidden_act']!r} (ds2 supports silu)")
    if d.get("attention_bias"):
        raise ConfigError("unsupported attention_bias true (DeepSeek-V2 checkpoints have no attention biases)")
    if d["qk_rope_head_dim"] % 2:
        raise ConfigError(f"config field qk_rope_head_dim must be even, got {d['qk_rope_head_dim']}")
    if d.get("rms_norm_eps", 1e-6) <= 0 or d.get("rope_theta", 1e4) <= 0:
        raise ConfigError("config fields rms_norm_eps and rope_theta must be > 0")
    d["rope_scaling"] = _check_rope_scaling(d.get("rope_scaling"))
    _check_moe(d)
    _check_token_ids(d)
    kwargs = {k: v for k, v in d.items() if k in fields and v is not None}
    for key in ("norm_topk_prob", "tie_word_embeddings", "attention_bias"):
        kwargs[key] = bool(d.get(key) or False)
    if v3:
        kwargs["rope_interleave"] = d.get("rope_interleave") is not False
    kwargs["routed_scaling_factor"] = float(d.get("routed_scaling_factor", 1.0))
    kwargs["rms_norm_eps"] = float(d.get("rms_norm_eps", 1e-6))
    kwargs["rope_theta"] = float(d.get("rope_theta", 10000.0))
    return DeepseekV2Config(**kwargs)
