"""config.json -> a frozen, validated `DeepseekV2Config` with the original DeepSeek field names."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from ds2cli.errors import ConfigError, Ds2Error

SUPPORTED_MODEL_TYPES = ("deepseek_v2",)
TOPK_METHODS = ("greedy", "group_limited_greedy")


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

    def is_moe_layer(self, layer_idx: int) -> bool:
        """The original DeepseekV2DecoderLayer's rule for choosing DeepseekV2MoE over a dense MLP."""
        return (self.n_routed_experts is not None
                and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

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


# What json.loads raises on untrusted text: JSONDecodeError, UnicodeDecodeError and an integer of
# thousands of digits are ValueErrors; deep nesting is a RecursionError.
JSON_ERRORS = (ValueError, RecursionError)


def json_error(e: BaseException) -> str:
    """Why untrusted JSON did not parse, in one line (without Python's advice to raise a limit)."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
        return str(e)
    return "a number has too many digits"


def read_json_object(path: Path, error: type[Ds2Error]) -> dict:
    """An untrusted JSON file that must hold an object; any failure raises `error` in one line."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except JSON_ERRORS as e:
        raise error(f"{path} is not valid JSON: {json_error(e)}") from None
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(d, dict):
        raise error(f"{path} must hold a JSON object, not {type(d).__name__}")
    return d


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
    if d["topk_method"] == "group_limited_greedy":
        n_group, topk_group = d.get("n_group"), d.get("topk_group")
        if n_group is None or topk_group is None:
            raise ConfigError("topk_method group_limited_greedy needs n_group and topk_group")
        if n % n_group:
            raise ConfigError(f"n_routed_experts ({n}) is not divisible by n_group ({n_group})")
        if topk_group > n_group:
            raise ConfigError(f"topk_group ({topk_group}) is larger than n_group ({n_group})")
        if topk_group * (n // n_group) < k:
            raise ConfigError(f"topk_group ({topk_group}) groups of {n // n_group} experts "
                              f"hold fewer than num_experts_per_tok ({k})")


def _parse(raw: dict) -> DeepseekV2Config:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"not a DeepSeek-V2 checkpoint: model_type is {model_type!r}, "
                          f"ds2 runs model_type 'deepseek_v2'")
    d = _rope_from_parameters(raw) if "rope_parameters" in raw and "rope_scaling" not in raw else dict(raw)
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
    kwargs["routed_scaling_factor"] = float(d.get("routed_scaling_factor", 1.0))
    kwargs["rms_norm_eps"] = float(d.get("rms_norm_eps", 1e-6))
    kwargs["rope_theta"] = float(d.get("rope_theta", 10000.0))
    return DeepseekV2Config(**kwargs)
