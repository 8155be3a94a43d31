"""Rebuild the GGUF fixtures in this directory with llama.cpp's own tools (see README.md).

Run it with ds2's environment (it computes the float reference with ds2), pointing it at a
llama.cpp source tree (vendor/llama.cpp of the llama-cpp-python sdist: `pip download --no-deps
--no-binary :all: llama-cpp-python`) whose llama-quantize is built (`cmake -B build && cmake
--build build --target llama-quantize`), and at a SCRATCH Python that has torch, transformers,
sentencepiece, safetensors and numpy for convert_hf_to_gguf.py (never a ds2 dependency):

    python tests/data/gguf/make_fixtures.py --llama-cpp SCRATCH/llama_cpp_python-0.3.36/vendor/llama.cpp \
        --python SCRATCH/venv/bin/python --work SCRATCH/fixtures

(SCRATCH: a folder of your own outside the checkout, where the sdist was unpacked and the
scratch Python made; the fixtures were last made with llama-cpp-python 0.3.36.)

The converter recognises a tokenizer by the hash of its output on a fixed text; the reference
cases' 4096-token tokenizer is not one it knows, so the scratch copy of convert_hf_to_gguf
carries a two-line tweak: get_vocab_base_pre returns $DS2_FORCE_TOKENIZER_PRE when the hash is
unknown (this script sets it to "deepseek-llm").
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

HERE = Path(__file__).resolve().parent
REFERENCE = HERE.parent / "reference"

# A case (LoRA-Q: llama-quantize loads the hparams and, below 26 layers, requires
# attention.q_lora_rank) whose every matrix is 256 wide or a multiple of it in its rows, so that K-quants
# (256-value super-blocks) apply; attn_k_b (rows of qk_nope_head_dim = 64) falls back to
# another type, as it does in real files.
KQUANT_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "kv_lora_rank": 256, "q_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
    "v_head_dim": 128, "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1,
    "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "hidden_act": "silu", "max_position_embeddings": 2048,
    "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
    "rope_scaling": None, "scoring_func": "softmax", "torch_dtype": "float32",
}
KQUANT_TOKENS = 24
STD = 0.08   # the reference cases' initializer_range


def run(cmd: list, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def convert(python: str, llama_cpp: Path, src: Path, out: Path, outtype: str) -> None:
    env = {**__import__("os").environ, "DS2_FORCE_TOKENIZER_PRE": "deepseek-llm"}
    run(["nice", "-n", "19", python, llama_cpp / "convert_hf_to_gguf.py", src, "--outtype", outtype,
         "--outfile", out], env=env)


def make_kquant_source(dst: Path) -> None:
    """Random float32 weights for KQUANT_CONFIG in the Hugging Face layout (seeded)."""
    from ds2cli.weights.checkpoint import expected_shapes
    from ds2cli.model.config import DeepseekV2Config
    dst.mkdir(parents=True, exist_ok=True)
    cfg = DeepseekV2Config.from_dict(KQUANT_CONFIG)
    rng = np.random.default_rng(23)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:   # norms near one, the way trained ones sit
            tensors[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[name] = (STD * rng.standard_normal(shape)).astype(np.float32)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(KQUANT_CONFIG, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REFERENCE / "lite_like_plainq_yarn" / f, dst / f)


def float_reference(src: Path, out: Path) -> None:
    """ids and ds2's float32 logits of the float source (every row, all at once)."""
    from ds2cli.weights.loader import load
    model = load(src)
    ids = np.random.default_rng(7).integers(3, KQUANT_CONFIG["vocab_size"], KQUANT_TOKENS)
    logits = model.forward(ids, model.new_cache(len(ids)), all_logits=True)
    np.savez(out, ids=ids, logits=logits.astype(np.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--python", required=True, help="the scratch Python with torch for the converter")
    ap.add_argument("--work", type=Path, required=True, help="a scratch directory for the float sources")
    a = ap.parse_args()
    quantize = a.llama_cpp / "build" / "bin" / "llama-quantize"
    a.work.mkdir(parents=True, exist_ok=True)
    # 1. a reference case as llama.cpp converts it: float16 stored as float16, so it is lossless
    convert(a.python, a.llama_cpp, REFERENCE / "plain_rope_tied_fp16", HERE / "plain_rope_tied_fp16.f16.gguf", "f16")
    # 2. the K-quant case: float32 source -> F32 GGUF (scratch) -> Q4_K_M (llama-quantize)
    src = a.work / "kquant_256"
    make_kquant_source(src)
    float_reference(src, HERE / "kquant_256.ref.npz")
    f32 = a.work / "kquant_256.f32.gguf"
    convert(a.python, a.llama_cpp, src, f32, "f32")
    run(["nice", "-n", "19", quantize, f32, HERE / "kquant_256.Q4_K_M.gguf", "Q4_K_M"])


if __name__ == "__main__":
    main()
