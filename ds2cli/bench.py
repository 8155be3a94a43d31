"""`ds2 bench`: load, prefill and decode speed, held against what this machine's memory and BLAS
can do (llama-bench for ds2).

By default it runs on a synthetic checkpoint with DeepSeek-V2-Lite's exact layer shapes, cut to a
few layers and filled with random weights, written once into a cache directory. Two probes
measure the machine: float32 matrix-vector bandwidth (the ceiling for decode, which reads every
active weight once per token) and float32 GEMM throughput (the ceiling for prefill).

What one decode step must read, in bytes (float32, 4 bytes a parameter): the token's embedding
row; in every layer the two norms and every attention weight (the absorbed path multiplies by all
of w_uk and w_uv), then the dense MLP, or the router, the shared experts and the routed experts
the gate picked (counted once each per layer and step); the final norm and lm_head; plus the
latent cache of every position attended to (latent and k_pe of every layer, read once).
A prefill reads the same weights once for all its tokens, with every expert any token picked, so
a short prompt is bound by bytes (held against the matvec probe) and a long one by FLOPs (held
against the GEMM probe). Both probes run once at the start and again, shorter, beside each
measured point, whose ratios are taken against those: a shared machine's speed drifts mid-run.
"""

from __future__ import annotations

import gc
import inspect
import json
import math
import os
import platform
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import click
import ml_dtypes
import numpy as np

from ds2cli import checkpoint, console, files, helpers, memory
from ds2cli.attention import absorbed_cost, expanded_cost
from ds2cli.config import DeepseekV2Config
from ds2cli.errors import Ds2Error
from ds2cli.loader import bundled_model_dir, check_model_dir, load, read_quant_config
from ds2cli.model import Model
from ds2cli.qcheckpoint import QuantConfig
from ds2cli.quantize import quantize_checkpoint

LITE_LAYERS = 27            # DeepSeek-V2-Lite's depth; --layers takes the first N of them
DEFAULT_LAYERS = 4
INIT_STD = 0.02             # initializer_range: the spread of a trained model's weights
SHARD_BYTES = 2 * 10**9     # safetensors shards of about 2 GB, like the published checkpoints
BLOCK_ELEMENTS = 1 << 24    # synthesis draws, converts and writes 16M values (64 MB float32) at a time
FILL_CHUNK = 512            # the decode cache is filled by prefilling this many real tokens at a time
PROBE_RUNS = 8
POINT_PROBE_RUNS = 4        # the probes again beside each measured point, shorter
MATVEC_N = 8192             # 8192 x 8192 float32 = 256 MB, far past any CPU cache
GEMM_SHAPES = {             # (M, K, N): (M, K) @ (N, K)^T, as the engine multiplies by weights
    "prefill": (512, 2048, 2048),   # 512 prompt tokens through a 2048 x 2048 projection
    "expert": (48, 2048, 2816),     # one routed expert's gate_up: 512 tokens x top-6 / 64 experts
}


class BenchError(Ds2Error):
    """The benchmark cannot run as asked (disk, memory, or option values the model cannot take)."""


# ---- the synthetic checkpoint ----

def lite_config(layers: int) -> dict:
    """DeepSeek-V2-Lite's config.json (original field names) cut to `layers` layers. The special
    token ids are ds2-tiny's, because the synthetic checkpoint ships ds2-tiny's tokenizer."""
    tiny = json.loads((bundled_model_dir() / "config.json").read_text(encoding="utf-8"))
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": 102400, "hidden_size": 2048, "num_hidden_layers": layers,
        "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "norm_topk_prob": False, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "attention_bias": False, "tie_word_embeddings": False, "initializer_range": INIT_STD,
        "bos_token_id": tiny["bos_token_id"], "eos_token_id": tiny["eos_token_id"],
        "torch_dtype": "bfloat16",
    }


def random_blocks(name: str, shape: tuple[int, ...], seed: int):
    """A tensor's values in row-major order, as bf16 blocks: norm weights are ones, the rest is
    uniform with standard deviation INIT_STD (uniform rather than normal: seven times faster to
    draw, and only the spread matters). Seeded by name, so values do not depend on the sharding."""
    n = math.prod(shape)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    for start in range(0, n, BLOCK_ELEMENTS):
        size = min(BLOCK_ELEMENTS, n - start)
        if name.endswith("norm.weight"):
            block = np.ones(size, np.float32)
        else:
            block = rng.random(size, dtype=np.float32)                       # U[0, 1): std 1/sqrt(12)
            block -= np.float32(0.5)
            block *= np.float32(INIT_STD * math.sqrt(12))
        yield block.astype(ml_dtypes.bfloat16)


def write_shard(path: Path, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
    """One bf16 safetensors file, streamed block by block: memory stays at one block, not a shard."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in shapes.items():
            for block in random_blocks(name, shape, seed):
                f.write(block.view(np.uint16).data)


def plan_shards(shapes: dict[str, tuple[int, ...]], shard_bytes: int) -> list[list[str]]:
    shards, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_checkpoint(out: Path, config: dict, seed: int, shard_bytes: int) -> None:
    """Shards, index, config.json and ds2-tiny's tokenizer files into the (empty) folder `out`."""
    shapes = checkpoint.expected_shapes(DeepseekV2Config.from_dict(config))
    shards = plan_shards(shapes, shard_bytes)
    weight_map = {}
    for n, names in enumerate(shards, 1):
        t0 = time.perf_counter()
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        write_shard(out / file, {name: shapes[name] for name in names}, seed)
        weight_map.update(dict.fromkeys(names, file))
        console.info(f"  wrote {file} ({(out / file).stat().st_size / 1e9:.2f} GB, "
                     f"{time.perf_counter() - t0:.0f} s)")
    index = {"metadata": {"total_size": 2 * sum(math.prod(s) for s in shapes.values())},
             "weight_map": weight_map}
    (out / checkpoint.INDEX_NAME).write_text(json.dumps(index, indent=2), encoding="utf-8")
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(bundled_model_dir() / name, out / name)


def synthesise(target: Path, config: dict, seed: int = 0, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write a random-weight bf16 checkpoint for `config` at `target`. It is built in a sibling
    folder and renamed into place only when complete, so an interrupted synthesis is never reused."""
    cfg = DeepseekV2Config.from_dict(config)
    target.parent.mkdir(parents=True, exist_ok=True)
    needed = 2 * sum(math.prod(s) for s in checkpoint.expected_shapes(cfg).values())     # bf16
    files.check_free_disk(target.parent, int(needed * 1.05), "the benchmark checkpoint", BenchError,
                          "pick another place with --cache-dir or DS2_BENCH_DIR, or fewer --layers")
    with files.building(target, replace=False) as partial:
        write_checkpoint(partial, config, seed, shard_bytes)
    return target


def synthetic_path(bench_dir: Path, layers: int) -> Path:
    return bench_dir.expanduser() / f"deepseek-v2-lite-{layers}-layers"


def synthetic_model(bench_dir: Path, layers: int) -> Path:
    """The synthetic DeepSeek-V2-Lite slice, synthesised on first use and reused after."""
    target = synthetic_path(bench_dir, layers)
    if (target / "config.json").is_file():
        return target
    console.info(f"synthesising a {layers}-layer DeepSeek-V2-Lite-shaped checkpoint in {target} (once)")
    return synthesise(target, lite_config(layers))


# ---- what the machine can do ----

def summary(samples: list[float]) -> dict:
    samples = [float(s) for s in samples]
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples), "runs": samples}


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def probe_matvec(runs: int) -> dict:
    """GB/s of float32 W @ x with W far larger than the caches: the bandwidth decode can hope for."""
    w = np.full((MATVEC_N, MATVEC_N), 1.0 / MATVEC_N, np.float32)   # written, so every page exists
    x = np.ones(MATVEC_N, np.float32)
    w @ x  # BLAS threads start outside the timing
    return summary([w.nbytes / seconds(lambda: w @ x) / 1e9 for _ in range(runs)])


def probe_gemm(m: int, k: int, n: int, runs: int) -> dict:
    """GFLOP/s of float32 (m, k) @ (n, k)^T."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((n, k), dtype=np.float32)
    a @ b.T
    return summary([2 * m * k * n / seconds(lambda: a @ b.T) / 1e9 for _ in range(runs)])


def probe_beside() -> dict:
    """Both probes again, right before a measurement: on a shared machine the speed drifts within
    a run, and a ratio only means something against a probe taken at the same time."""
    return {"matvec_gb_per_s": probe_matvec(POINT_PROBE_RUNS),
            "gemm_gflop_per_s": probe_gemm(*GEMM_SHAPES["prefill"], POINT_PROBE_RUNS)}


def machine_info() -> dict:
    info = {"cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform(),
            "numpy": np.__version__, "blas": None}
    try:
        from threadpoolctl import threadpool_info  # optional: reported when installed
    except ImportError:
        return info
    keys = ("user_api", "internal_api", "version", "num_threads", "threading_layer", "architecture")
    info["blas"] = [{k: lib.get(k) for k in keys} for lib in threadpool_info()]
    return info


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def params_of(w) -> int:
    return math.prod(w.shape)


def layer_weights(layer: dict) -> list:
    """Everything every token reads in this layer, routed experts aside (absorbed decode reads
    all of w_uk and w_uv): arrays and weight objects (linear.Dense, quant.QuantMatrix) alike."""
    mlp = [a for name, a in layer["mlp"].items() if not name.startswith("experts_")]
    return [layer["input_layernorm"], layer["post_attention_layernorm"], *layer["attn"].values(), *mlp]


def layer_params(layer: dict, matrices_only: bool = False) -> int:
    """Parameters of layer_weights; matrices_only leaves out the norm weights, for counting
    multiply-adds."""
    return sum(params_of(a) for a in layer_weights(layer) if len(a.shape) >= 2 or not matrices_only)


def routed_expert(model: Model) -> list:
    """One routed expert's weights (gate_up, down); none without MoE layers."""
    mlp = next((layer["mlp"] for layer in model.layers if layer["is_moe"]), None)
    return [] if mlp is None else [mlp["experts_gate_up"][0], mlp["experts_down"][0]]


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
        arrays += [layer["input_layernorm"], layer["post_attention_layernorm"],
                   *layer["attn"].values(), *layer["mlp"].values()]
    return list({id(a): a for a in arrays}.values())   # a tied lm_head is the embedding, once


def weight_nbytes(model: Model) -> int:
    """Bytes the loaded model's weights hold, in their stored form."""
    return sum(a.nbytes for a in all_weights(model))


def total_params(model: Model) -> int:
    return sum(params_of(a) for a in all_weights(model))


# ---- measurements ----

def time_load(path: Path, repeats: int, quantize: int | None = None,
              context: int | None = None) -> tuple[Model, dict]:
    samples, model = [], None
    for r in range(repeats):
        model = None  # free the previous copy first: two might not fit side by side
        gc.collect()
        console.info(f"load {r + 1}/{repeats}")
        progress = console.LoadProgress()
        try:
            t0 = time.perf_counter()
            model = load(path, progress=progress, quantize=quantize, context=context)
            samples.append(time.perf_counter() - t0)
        finally:
            progress.close()
    return model, summary(samples)


def bench_prefill(model: Model, tokens: int, repeats: int, rng) -> dict:
    """Prompt processing: `tokens` random ids into a fresh cache. Held against the GEMM probe
    (FLOPs) and, since a short prompt is bound by reading the experts its tokens picked, the
    matvec probe (bytes)."""
    console.info(f"prefill {tokens} tokens x {repeats}")
    probes = probe_beside()
    samples, routes = [], []
    for _ in range(repeats):
        ids = rng.integers(model.config.vocab_size, size=tokens)
        cache = model.new_cache(tokens)
        samples.append(tokens / seconds(lambda: model.forward(ids, cache, trace=routes)))
    routed = sum(len(np.unique(idx)) for idx in routes) / repeats
    weight_bytes = forward_weight_bytes(model, routed, tokens)
    tok_per_s, gflop = summary(samples), prefill_flops(model, tokens) / 1e9
    gflop_per_s = summary([gflop * s / tokens for s in samples])
    gb_per_s = weight_bytes * tok_per_s["median"] / tokens / 1e9
    return {"tokens": tokens, "tok_per_s": tok_per_s, "gflop": gflop, "gflop_per_s": gflop_per_s,
            "routed_experts": routed, "weight_bytes": weight_bytes, "weight_gb_per_s": gb_per_s,
            "probes": probes, "gemm_ratio": gflop_per_s["median"] / probes["gemm_gflop_per_s"]["median"],
            "matvec_ratio": gb_per_s / probes["matvec_gb_per_s"]["median"]}


def fill_cache(model: Model, cache, ids: np.ndarray) -> None:
    """Prefill `ids` after what the cache holds, FILL_CHUNK tokens at a time, up to len(ids)."""
    while cache.length < len(ids):
        model.forward(ids[cache.length:cache.length + FILL_CHUNK], cache)


def bench_decode(model: Model, contexts: list[int], steps: int, repeats: int, rng) -> list[dict]:
    """Token generation at each context: one cache is filled context by context with real
    (random-id) tokens, so the latents attended to are what a model produces."""
    cache = model.new_cache(max(contexts) + steps)
    prompt = rng.integers(model.config.vocab_size, size=max(contexts))
    points = []
    for context in sorted(contexts):
        console.info(f"fill the cache to {context} tokens, then decode {steps} x {repeats}")
        fill_cache(model, cache, prompt[:context])
        points.append(decode_point(model, cache, context, steps, repeats, rng))
    return points


def decode_point(model: Model, cache, context: int, steps: int, repeats: int, rng) -> dict:
    probes = probe_beside()
    samples, routes = [], []
    for _ in range(repeats):
        ids = rng.integers(model.config.vocab_size, size=steps)
        cache.truncate(context)
        t0 = time.perf_counter()
        for token in ids:
            model.forward(token[None], cache, trace=routes)
        samples.append(steps / (time.perf_counter() - t0))
    cache.truncate(context)
    routed = sum(len(np.unique(idx)) for idx in routes) / (steps * repeats)
    weight_bytes = forward_weight_bytes(model, routed)
    cache_bytes = cache.bytes_per_token * (context + (steps + 1) / 2)  # step j reads context + j + 1
    tok_per_s = summary(samples)
    gb_per_s = (weight_bytes + cache_bytes) * tok_per_s["median"] / 1e9
    return {"context": context, "tok_per_s": tok_per_s, "routed_experts_per_step": routed,
            "weight_bytes_per_token": weight_bytes, "cache_bytes_per_token": cache_bytes,
            "bytes_per_token": weight_bytes + cache_bytes, "gb_per_s": gb_per_s,
            "probes": probes, "matvec_ratio": gb_per_s / probes["matvec_gb_per_s"]["median"]}


# ---- the optional comparison with Hugging Face transformers ----

def compare_hf(path: Path, prompt_lengths: list[int], contexts: list[int], steps: int, repeats: int) -> dict | None:
    """Time transformers (float32) on the same checkpoint where torch and transformers happen to
    be importable. Neither is a ds2 dependency; any failure on their side is a note, not an error."""
    try:
        import torch
        import transformers
    except ImportError as e:
        console.warn(f"--compare-hf skipped: {e.name} is not importable (ds2 never needs torch or transformers)")
        return None
    try:
        return time_hf(torch, transformers, path, prompt_lengths, contexts, steps, repeats)
    except Exception as e:  # noqa: BLE001  (a third-party stack: report whatever it raised)
        console.warn(f"--compare-hf failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
        return None


def time_hf(torch, transformers, path: Path, prompt_lengths: list[int], contexts: list[int], steps: int,
            repeats: int) -> dict:
    """Prefill at each prompt length, then decode `steps` tokens after each context. Logits are
    asked for the last position only (logits_to_keep=1, where transformers offers it), as ds2
    computes them, so that prefill compares like with like."""
    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    result = {"transformers": transformers.__version__, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "load_s": time.perf_counter() - t0,
              "prefill": [], "decode": []}
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(hf.forward).parameters else {}
    result["logits_last_position_only"] = bool(last_only)
    vocab = hf.config.vocab_size

    def run(ids, past=None):
        return hf(ids, past_key_values=past, use_cache=True, **last_only).past_key_values

    with torch.inference_mode():
        for tokens in prompt_lengths:
            console.info(f"hf prefill {tokens} tokens x {repeats}")
            samples = [tokens / seconds(lambda: run(torch.randint(vocab, (1, tokens)))) for _ in range(repeats)]
            result["prefill"].append({"tokens": tokens, "tok_per_s": summary(samples)})
        for context in contexts:
            console.info(f"hf decode at context {context} x {repeats}")
            samples = []
            for _ in range(repeats):
                past = run(torch.randint(vocab, (1, context)))
                ids = torch.randint(vocab, (steps, 1, 1))
                t0 = time.perf_counter()
                for x in ids:
                    past = run(x, past)
                samples.append(steps / (time.perf_counter() - t0))
            result["decode"].append({"context": context, "tok_per_s": summary(samples)})
    return result


# ---- the command ----

def cache_tokens(prompt_lengths: list[int], contexts: list[int], steps: int) -> int:
    """The largest cache the run allocates."""
    return max(max(contexts) + steps, max(prompt_lengths))


def check_settings(cfg: DeepseekV2Config, prompt_lengths: list[int], contexts: list[int], steps: int) -> None:
    limit = cfg.max_position_embeddings
    if max(prompt_lengths) > limit:
        raise BenchError(f"--prompt-lengths {max(prompt_lengths)} is longer than the model's "
                         f"max_position_embeddings ({limit})")
    if max(contexts) + steps > limit:
        raise BenchError(f"--contexts {max(contexts)} plus --decode-steps {steps} go past the model's "
                         f"max_position_embeddings ({limit})")


def probe_machine() -> dict:
    console.info("probing memory bandwidth and GEMM throughput")
    return {"matvec": {"shape": [MATVEC_N, MATVEC_N], "gb_per_s": probe_matvec(PROBE_RUNS)},
            "gemm": {name: {"shape": list(shape), "gflop_per_s": probe_gemm(*shape, PROBE_RUNS)}
                     for name, shape in GEMM_SHAPES.items()}}


def memory_section(model: Model, cache_tokens: int) -> dict:
    """Peak RSS so far against what must be resident: the weights as stored (memory-mapped ones
    count once their pages are touched) and the largest cache; and against the float32 weights.
    The peak includes what the decode helper processes hold that this one does not map
    (helpers.helper_private_bytes), so pages split between the processes count once and in full."""
    weights = weight_nbytes(model)
    cache = cache_tokens * model.new_cache(1).bytes_per_token
    private = helpers.helper_private_bytes()
    rss = peak_rss_bytes() + private
    return {"peak_rss_bytes": rss, "helper_private_bytes": private, "weight_bytes": weights, "cache_bytes": cache,
            "float32_weight_bytes": 4 * total_params(model), "rss_ratio": rss / (weights + cache)}


def run_bench(path: Path, synthetic: bool, repeats: int, prompt_lengths: list[int], contexts: list[int],
              steps: int, hf: bool, quantize: int | None = None) -> dict:
    rng = np.random.default_rng(0)
    probes = probe_machine()
    model, load_s = time_load(path, repeats, quantize, context=cache_tokens(prompt_lengths, contexts, steps))
    warm = min(prompt_lengths)  # one untimed forward first, as llama-bench does
    model.forward(rng.integers(model.config.vocab_size, size=warm), model.new_cache(warm))
    prefill = [bench_prefill(model, tokens, repeats, rng) for tokens in prompt_lengths]
    decode = bench_decode(model, contexts, steps, repeats, rng)
    cfg = model.config
    report = {
        "model": {"path": str(path), "synthetic": synthetic, "num_hidden_layers": cfg.num_hidden_layers,
                  "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                  "params": total_params(model), "format": memory.label(model.quantization),
                  "weight_bytes": weight_nbytes(model), "float32_weight_bytes": 4 * total_params(model)},
        "machine": machine_info(),
        "settings": {"repeats": repeats, "prompt_lengths": prompt_lengths, "contexts": contexts,
                     "decode_steps": steps},
        "probes": probes, "load_s": load_s, "prefill": prefill, "decode": decode,
        "memory": memory_section(model, cache_tokens(prompt_lengths, contexts, steps)),
    }
    if hf:
        del model  # transformers' copy must not sit beside ours
        gc.collect()
        report["compare_hf"] = compare_hf(path, prompt_lengths, contexts, steps, repeats)
    return report


def parse_counts(ctx, param, value: str) -> list[int]:
    """click callback: "128,1024,4096" -> [128, 1024, 4096]."""
    try:
        counts = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise click.BadParameter(f"expected comma-separated whole numbers, got {value!r}") from None
    if not counts or counts[0] < 1:
        raise click.BadParameter(f"expected positive token counts, got {value!r}")
    return counts


def parse_formats(ctx, param, value: str | None) -> list[int | None] | None:
    """click callback: "f32,8,4" -> [None, 8, 4]."""
    if value is None:
        return None
    names = {"f32": None, "float32": None, "8": 8, "q8": 8, "4": 4, "q4": 4}
    chosen = [v.strip().lower() for v in value.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in names]
    if unknown or not chosen:
        raise click.BadParameter(f"expected formats among f32, 8, 4 (comma-separated), got {value!r}")
    return list(dict.fromkeys(names[v] for v in chosen))


@click.command("bench")
@click.option("-m", "--model", "model_dir", type=click.Path(path_type=Path),
              help="Benchmark this checkpoint directory instead of the synthetic DeepSeek-V2-Lite slice.")
@click.option("--layers", type=click.IntRange(1, LITE_LAYERS),
              help=f"Layers of the synthetic DeepSeek-V2-Lite slice.  [default: {DEFAULT_LAYERS}]")
@click.option("--cache-dir", type=click.Path(path_type=Path, file_okay=False), envvar="DS2_BENCH_DIR",
              show_envvar=True, help="Where synthetic checkpoints are kept.  [default: ~/.cache/ds2/bench]")
@click.option("-r", "--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Runs of each measurement (min, median and max are reported).")
@click.option("-p", "--prompt-lengths", default="16,512", show_default=True, callback=parse_counts,
              help="Prefill sizes in tokens, comma-separated.")
@click.option("-c", "--contexts", default="128,1024,4096", show_default=True, callback=parse_counts,
              help="Cached tokens to decode after, comma-separated.")
@click.option("-n", "--decode-steps", type=click.IntRange(min=1), default=16, show_default=True,
              help="Single-token steps timed at each context.")
@click.option("--compare-hf", is_flag=True,
              help="Also time Hugging Face transformers on the same checkpoint (where torch and "
                   "transformers are installed).")
@click.option("--quantize", type=click.Choice(["8", "4"]),
              help="Quantize the float checkpoint to 8 or 4 bits in memory as it loads.")
@click.option("--formats", callback=parse_formats,
              help="Compare formats, e.g. f32,8,4: f32 loads the float checkpoint, 8 and 4 load ds2 "
                   "quantize copies kept beside it (made once). -r sets the rounds; each round runs "
                   "every format once, in turn, each in its own process (load, memory and the figures); "
                   "then, where they fit in memory together, one process holds them all and times -r "
                   "samples of each, interleaved, for the speed ratios.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object with every figure instead of the table.")
def bench(model_dir, layers, cache_dir, repeats, prompt_lengths, contexts, decode_steps, compare_hf,
          quantize, formats, as_json):
    """Measure load, prefill and decode speed, and compare them with what this machine's memory
    bandwidth and float32 GEMM can do.

    Without --model, the first run synthesises a checkpoint with DeepSeek-V2-Lite's exact layer
    shapes, --layers deep, with random bf16 weights (about 1.1 GB of disk a layer), and later
    runs reuse it. Progress goes to stderr; the table (or --json) to stdout."""
    if model_dir is not None and layers is not None:
        raise BenchError("--layers sets the depth of the synthetic checkpoint; it cannot be used with --model")
    if formats and (quantize or compare_hf):
        raise click.UsageError("--formats runs each format itself; it cannot be combined with --quantize or --compare-hf")
    if model_dir is None:
        cfg = DeepseekV2Config.from_dict(lite_config(layers or DEFAULT_LAYERS))
    else:
        model_dir = check_model_dir(model_dir)
        cfg = DeepseekV2Config.from_file(model_dir / "config.json")
    check_settings(cfg, prompt_lengths, contexts, decode_steps)
    bench_dir = (cache_dir or Path("~/.cache/ds2/bench")).expanduser()
    context = cache_tokens(prompt_lengths, contexts, decode_steps)
    # refuse what cannot fit before synthesising or quantizing anything
    stored = None if model_dir is None else read_quant_config(model_dir)
    for bits in formats or [int(quantize) if quantize else None]:
        memory.check(cfg, model_dir or synthetic_path(bench_dir, cfg.num_hidden_layers),
                     stored or (QuantConfig.recipe(bits) if bits and formats else None),
                     None if formats else bits, context)
    path = model_dir or synthetic_model(bench_dir, layers or DEFAULT_LAYERS)
    if formats:
        report = compare_formats(path, bench_dir, formats, repeats, prompt_lengths, contexts, decode_steps)
    else:
        report = run_bench(path, model_dir is None, repeats, prompt_lengths, contexts, decode_steps, compare_hf,
                           int(quantize) if quantize else None)
    if as_json:
        click.echo(json.dumps(report))
    else:
        from rich.console import Console
        (render_formats if formats else render)(report, Console())


def quantized_copy(path: Path, bench_dir: Path, bits: int) -> Path:
    """`ds2 quantize` of `path`, made once into the bench directory and reused after."""
    target = bench_dir / f"{path.name}-q{bits}"
    if (target / "config.json").is_file():
        return target
    console.info(f"quantizing {path} to {bits} bits into {target} (once)")
    progress = console.LoadProgress(delay=0, label="quantizing")
    try:
        quantize_checkpoint(path, target, bits, force=True, progress=progress)
    finally:
        progress.close()
    return target


def compare_formats(path: Path, bench_dir: Path, formats: list[int | None], repeats: int,
                    prompt_lengths: list[int], contexts: list[int], steps: int) -> dict:
    """Each format benchmarked by fresh `ds2 bench --json -r 1` processes, so that each has its
    own peak RSS, in rounds: every round runs each format once, in turn. A shared machine's speed
    drifts over minutes, so a ratio is taken within each round, between runs made a minute or
    two apart, and the rounds' median is reported, rather than comparing one format's runs made
    now with another's made ten minutes later."""
    targets = {"f32" if bits is None else f"q{bits}": path if bits is None else quantized_copy(path, bench_dir, bits)
               for bits in formats}
    settings = ["-p", ",".join(map(str, prompt_lengths)), "-c", ",".join(map(str, contexts)), "-n", str(steps)]
    runs: dict[str, list[dict]] = {name: [] for name in targets}
    for k in range(repeats):
        for name, target in targets.items():
            console.info(f"== round {k + 1} of {repeats}, {name}: {target}")
            child = subprocess.run([sys.executable, "-m", "ds2cli", "bench", "-m", str(target), "--json",
                                    "-r", "1", *settings], stdout=subprocess.PIPE, text=True)
            if child.returncode != 0:
                raise BenchError(f"the {name} benchmark failed (exit {child.returncode}); its error is above")
            runs[name].append(json.loads(child.stdout))
    return {"formats": runs, "comparison": format_ratios(runs),
            "side_by_side": side_by_side(targets, repeats, prompt_lengths, contexts, steps)}


def side_by_side(targets: dict[str, Path], repeats: int, prompt_lengths: list[int], contexts: list[int],
                 steps: int) -> dict | None:
    """Speed ratios measured in one process that holds every format, their samples interleaved:
    for each point, sample k of every format runs in turn, seconds apart, on the same token ids,
    and the ratio is taken within each k. A shared machine's speed moves by 10-30% between the
    rounds' processes, minutes apart, and this pairs measurements made seconds apart instead.
    None (said on stderr) if the formats do not fit in memory together, and for one format."""
    if len(targets) < 2:
        return None
    cfgs = {name: DeepseekV2Config.from_file(t / "config.json") for name, t in targets.items()}
    context = cache_tokens(prompt_lengths, contexts, steps)
    need = sum(memory.required(cfgs[name], read_quant_config(t), context)["total"] for name, t in targets.items())
    available = memory.available_bytes()
    if available is not None and need > available:
        console.info(f"side by side: skipped, the formats need {memory.gb(need)} together and "
                     f"{memory.gb(available)} is available")
        return None
    console.info("== side by side: every format in this process, samples interleaved")
    # each low-bit load forks the decode helpers anew, so the last ones know every model here
    models = {}
    for name, t in targets.items():
        progress = console.LoadProgress()
        try:
            models[name] = load(t, progress=progress, context=context, memory_check=False)
        finally:
            progress.close()
    rng = np.random.default_rng(0)
    vocab = min(m.config.vocab_size for m in models.values())
    samples: dict[str, dict[str, list[float]]] = {}
    for tokens in prompt_lengths:
        console.info(f"side by side: prefill {tokens} tokens x {repeats}")
        row = samples[f"pp{tokens} tok/s"] = {name: [] for name in models}
        for k in range(repeats + 1):            # the first, untimed, warms every format up
            ids = rng.integers(vocab, size=tokens)
            for name, m in models.items():
                took = seconds(lambda: m.forward(ids, m.new_cache(tokens)))
                if k:
                    row[name].append(tokens / took)
    prompt = rng.integers(vocab, size=max(contexts))
    caches = {name: m.new_cache(max(contexts) + steps) for name, m in models.items()}
    for context in sorted(contexts):
        console.info(f"side by side: decode {steps} x {repeats} at {context} tokens")
        row = samples[f"tg @ {context} tok/s"] = {name: [] for name in models}
        for name, m in models.items():
            fill_cache(m, caches[name], prompt[:context])
        for _ in range(repeats):
            ids = rng.integers(vocab, size=steps)
            for name, m in models.items():
                caches[name].truncate(context)
                took = seconds(lambda: [m.forward(t[None], caches[name]) for t in ids])
                row[name].append(steps / took)
                caches[name].truncate(context)
    models.clear()
    caches.clear()
    helpers.stop_helpers_now()     # a helper's copy of this process would keep the models alive
    gc.collect()
    first = next(iter(targets))
    out = {}
    for row, by_name in samples.items():
        out[row] = {}
        for name, values in by_name.items():
            ratios = [v / b for v, b in zip(values, by_name[first])]
            out[row][name] = {"tok_per_s": summary(values), "ratio": float(np.median(ratios)),
                              "ratio_range": [min(ratios), max(ratios)], "ratios": ratios}
    return {"samples": repeats, "rows": out}


def comparison_figures(report: dict) -> dict[str, float]:
    """The figures a format comparison puts side by side, by row name."""
    rows = {"load s": report["load_s"]["median"]}
    rows.update({f"pp{r['tokens']} tok/s": r["tok_per_s"]["median"] for r in report["prefill"]})
    rows.update({f"tg @ {r['context']} tok/s": r["tok_per_s"]["median"] for r in report["decode"]})
    rows["peak RSS GB"] = report["memory"]["peak_rss_bytes"] / 1e9
    rows["weights GB"] = report["model"]["weight_bytes"] / 1e9
    return rows


def format_ratios(runs: dict[str, list[dict]]) -> dict:
    """Per format and figure: the median over the rounds, and the median over the rounds of the
    ratio to the first format's figure in the same round, with its min and max (speed: higher is
    better; load, RSS and weights: lower is better); plus the highest peak RSS against the
    float32 weight bytes."""
    figures = {name: [comparison_figures(r) for r in reports] for name, reports in runs.items()}
    base = next(iter(figures.values()))
    out = {}
    for name, rounds in figures.items():
        rows = rounds[0].keys()
        ratios = {row: [f[row] / b[row] for f, b in zip(rounds, base) if b[row]] for row in rows}
        out[name] = {"figures": {row: float(np.median([f[row] for f in rounds])) for row in rows},
                     "ratios": {row: float(np.median(r)) if r else None for row, r in ratios.items()},
                     "ratio_range": {row: [min(r), max(r)] if r else None for row, r in ratios.items()},
                     "rounds": len(rounds),
                     "rss_vs_float32_weights": max(r["memory"]["peak_rss_bytes"] / r["model"]["float32_weight_bytes"]
                                                   for r in runs[name])}
    return out


def render(report: dict, out) -> None:
    from rich import box
    from rich.table import Table
    m = report["model"]
    table = Table(title=f"ds2 bench: {m['path']}\n{m['num_hidden_layers']} layers, "
                        f"{m['params'] / 1e9:.2f} B params, {m['weight_bytes'] / 1e9:.2f} GB as {m['format']}",
                  caption=machine_line(report["machine"]), box=box.SIMPLE_HEAD)
    for name in ("test", "median", "min", "derived", "vs probe beside it"):
        table.add_column(name, no_wrap=name == "test", justify="right" if name in ("median", "min") else "left")
    for row in table_rows(report):
        table.add_row(*row)
    out.print(table)


def stat_cells(s: dict, fmt: str) -> list[str]:
    return [format(s["median"], fmt), format(s["min"], fmt)]


def table_rows(report: dict) -> list[list[str]]:
    p = report["probes"]
    rows = [["matvec GB/s", *stat_cells(p["matvec"]["gb_per_s"], ".1f"),
             "{}x{} float32".format(*p["matvec"]["shape"]), ""]]
    rows += [[f"gemm {name} GFLOP/s", *stat_cells(g["gflop_per_s"], ".1f"), "{}x{}x{}".format(*g["shape"]), ""]
             for name, g in p["gemm"].items()]
    rows.append(["load s", *stat_cells(report["load_s"], ".2f"), "", ""])
    rows += [[f"pp{r['tokens']} tok/s", *stat_cells(r["tok_per_s"], ".2f"),
              f"{r['gflop_per_s']['median']:.1f} GFLOP/s, {r['weight_gb_per_s']:.1f} GB/s",
              f"{r['gemm_ratio']:.0%} of {r['probes']['gemm_gflop_per_s']['median']:.0f} GFLOP/s, "
              f"{r['matvec_ratio']:.0%} of {r['probes']['matvec_gb_per_s']['median']:.1f} GB/s"]
             for r in report["prefill"]]
    rows += [[f"tg @ {r['context']} tok/s", *stat_cells(r["tok_per_s"], ".2f"),
              f"{r['bytes_per_token'] / 1e6:.0f} MB/tok, {r['gb_per_s']:.1f} GB/s",
              f"{r['matvec_ratio']:.0%} of {r['probes']['matvec_gb_per_s']['median']:.1f} GB/s"]
             for r in report["decode"]]
    mem = report["memory"]
    rows.append(["peak RSS GB", f"{mem['peak_rss_bytes'] / 1e9:.2f}", "",
                 f"weights {mem['weight_bytes'] / 1e9:.2f} + cache {mem['cache_bytes'] / 1e9:.2f}",
                 f"{mem['rss_ratio']:.2f}x those"])
    return rows + hf_rows(report)


def hf_rows(report: dict) -> list[list[str]]:
    """transformers' figures beside ds2's: the last column is ds2's median over transformers'."""
    hf = report.get("compare_hf")
    if not hf:
        return []
    ours = {("pp", r["tokens"]): r for r in report["prefill"]} | {("tg", r["context"]): r for r in report["decode"]}
    rows = []
    for kind, key, runs in (("pp", "tokens", hf["prefill"]), ("tg", "context", hf["decode"])):
        for r in runs:
            name = f"hf pp{r[key]}" if kind == "pp" else f"hf tg @ {r[key]}"
            mine = ours[(kind, r[key])]["tok_per_s"]["median"]
            rows.append([f"{name} tok/s", *stat_cells(r["tok_per_s"], ".2f"), f"transformers {hf['transformers']}",
                         f"ds2 {mine / r['tok_per_s']['median']:.2f}x"])
    return rows


def render_formats(report: dict, out) -> None:
    from rich import box
    from rich.table import Table
    comparison = report["comparison"]
    paired = (report.get("side_by_side") or {}).get("rows", {})
    first = next(iter(report["formats"].values()))[0]
    m = first["model"]
    table = Table(title=f"ds2 bench --formats: {m['path']}\n{m['num_hidden_layers']} layers, "
                        f"{m['params'] / 1e9:.2f} B params, {m['float32_weight_bytes'] / 1e9:.2f} GB as float32",
                  caption=machine_line(first["machine"]) + f"; medians of {next(iter(comparison.values()))['rounds']} "
                          "rounds, each running every format in its own process, in turn; ratio = this format "
                          "/ the first (median, and range), within each round" + (
                              f"; speed rows side by side: medians of {report['side_by_side']['samples']} "
                              "samples of every format interleaved in one process, each ratio within a sample"
                              if paired else ""),
                  box=box.SIMPLE_HEAD)
    table.add_column("test", no_wrap=True)
    for name in comparison:
        table.add_column(name, justify="right")
        if name != next(iter(comparison)):
            table.add_column("ratio", justify="right")
    for row in next(iter(comparison.values()))["figures"]:
        cells = [row]
        for k, (name, c) in enumerate(comparison.items()):
            cells.append(f"{paired[row][name]['tok_per_s']['median'] if row in paired else c['figures'][row]:.2f}")
            if k:
                ratio, lo_hi = ((paired[row][name]["ratio"], paired[row][name]["ratio_range"]) if row in paired
                                else (c["ratios"][row], c["ratio_range"][row]))
                cells.append("-" if ratio is None else f"{ratio:.2f}x ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})")
        table.add_row(*cells)
    cells = ["peak RSS / f32 weights"]
    for k, c in enumerate(comparison.values()):
        cells += [f"{c['rss_vs_float32_weights']:.2f}x"] + ([""] if k else [])
    table.add_row(*cells)
    out.print(table)


def machine_line(machine: dict) -> str:
    blas = [f"{lib['internal_api']} {lib['version']} ({lib['num_threads']} threads)"
            for lib in machine["blas"] or [] if lib.get("user_api") == "blas"]
    return (f"{machine['cpus_usable']} of {machine['cpu_count']} CPUs, numpy {machine['numpy']}"
            + (", " + ", ".join(blas) if blas else ""))
