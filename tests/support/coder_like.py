"""A small random DeepSeek-V2 checkpoint around DeepSeek's V2.5 tokenizer, whose vocabulary holds
DeepSeek-Coder's fill-in-the-middle tokens: the model the FIM tests (and the docs' FIM examples)
run. Its weights are random (bench's synthesis, a fixed seed), so what it writes is noise, but
every id of the real tokenizer has an embedding row and the prompt is the real one."""

import json
import shutil
from pathlib import Path

from ds2cli.cli.bench.synthetic import write_shard
from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights import checkpoint

V25 = Path(__file__).resolve().parents[1] / "data" / "tokenizers" / "deepseek-v2.5"

CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 102400, "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": None,
    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
    "intermediate_size": 64, "moe_intermediate_size": 16, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "norm_topk_prob": False, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "max_position_embeddings": 2048, "rope_scaling": None,
    "attention_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
    "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16",
}


def write_coder_like(out: Path, seed: int = 0) -> Path:
    """The checkpoint in `out` (made if absent): one bf16 shard, config.json, the V2.5 tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    shapes = checkpoint.expected_shapes(DeepseekV2Config.from_dict(CONFIG))
    write_shard(out / "model.safetensors", shapes, seed)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2), encoding="utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(V25 / name, out / name)
    return out
