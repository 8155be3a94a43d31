"""config.json parsing: original names, rope_parameters, and a ConfigError naming the field."""

import json

import pytest

from ds2cli.model.config import DeepseekV2Config
from ds2cli.errors import ConfigError
from ds2cli.weights.source import bundled_model_dir


@pytest.fixture
def raw():
    return json.loads((bundled_model_dir() / "config.json").read_text())


def test_bundled_config_fields(raw):
    cfg = DeepseekV2Config.from_dict(raw)
    assert (cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.q_head_dim) == (256, 128, 64, 48)
    assert cfg.moe_layers == [1, 2, 3, 4, 5] and cfg.dense_layers == [0]
    assert cfg.rope_scaling["factor"] == 4.0 and cfg.eos_token_ids == (1,)


def test_rope_parameters_replace_rope_scaling_and_theta(raw):
    rs = raw.pop("rope_scaling")
    raw.pop("rope_theta")
    raw["rope_parameters"] = {**rs, "rope_theta": 50000.0}
    cfg = DeepseekV2Config.from_dict(raw)
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling["factor"] == 4.0
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 20000.0}
    cfg = DeepseekV2Config.from_dict(raw)
    assert cfg.rope_theta == 20000.0 and cfg.rope_scaling is None


def test_moe_layer_rule_honours_first_k_dense_and_layer_freq(raw):
    raw.update(first_k_dense_replace=0, moe_layer_freq=2)
    assert DeepseekV2Config.from_dict(raw).moe_layers == [0, 2, 4]
    raw["n_routed_experts"] = None
    assert DeepseekV2Config.from_dict(raw).moe_layers == []


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "not a DeepSeek-V2 checkpoint: model_type is 'llama'"),
    ({"model_type": "kimi_k2"}, "model_type is 'kimi_k2'"),  # kimi_k2 needs DeepseekV3ForCausalLM
    ({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid'"),
    ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling type 'linear'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_attention_heads": 0}, "num_attention_heads must be >= 1"),
    ({"hidden_size": -4}, "hidden_size must be >= 1"),
    ({"kv_lora_rank": 0}, "kv_lora_rank must be >= 1"),
    ({"hidden_size": "256"}, "hidden_size must be an integer"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok (9) is larger than n_routed_experts (8)"),
    ({"n_group": 3}, "not divisible by n_group (3)"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim must be even"),
    ({"rope_scaling": {"type": "yarn", "factor": "4"}}, "rope_scaling.factor must be a number"),
])
def test_unsupported_or_impossible_values_name_the_field(raw, change, message):
    raw.update(change)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DeepseekV2Config.from_dict(raw)


def test_missing_required_field(raw):
    del raw["kv_lora_rank"]
    with pytest.raises(ConfigError, match="missing the required field kv_lora_rank"):
        DeepseekV2Config.from_dict(raw)
