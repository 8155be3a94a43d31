"""The synthetic checkpoint `ds2 bench` runs on by default: DeepSeek-V2-Lite's exact layer shapes,
cut to a few layers and filled with random weights, written once into a cache directory."""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

from ds2cli.weights import checkpoint
from ds2cli.cli import console
from ds2cli.weights import staging as files
from ds2cli.cli.bench.settings import BenchError
from ds2cli.model.config import DeepseekV2Config
from ds2cli.model.linear import bfloat16_bits
from ds2cli.weights.source import bundled_model_dir
from ds2cli.wording import article

LITE_LAYERS = 27            # DeepSeek-V2-Lite's depth; --layers takes the first N of them
DEFAULT_LAYERS = 4
INIT_STD = 0.02             # initializer_range: the spread of a trained model's weights
SHARD_BYTES = 2 * 10**9     # safetensors shards of about 2 GB, like the published checkpoints
BLOCK_ELEMENTS = 1 << 24    # synthesis draws, converts and writes 16M values (64 MB float32) at a time


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
        yield bfloat16_bits(block)                                          # rounded to nearest even


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
                f.write(block.data)


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


def write_checkpoint(out: Path, config: dict, seed: int, shard_bytes: int,
                     show: Callable[[str], None] = console.info) -> None:
    """Shards, index, config.json and ds2-tiny's tokenizer files into the (empty) folder `out`;
    a line to `show` after each shard."""
    shapes = checkpoint.expected_shapes(DeepseekV2Config.from_dict(config))
    shards = plan_shards(shapes, shard_bytes)
    weight_map = {}
    for n, names in enumerate(shards, 1):
        t0 = time.perf_counter()
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        write_shard(out / file, {name: shapes[name] for name in names}, seed)
        weight_map.update(dict.fromkeys(names, file))
        show(f"  wrote {file} ({(out / file).stat().st_size / 1e9:.2f} GB, "
                     f"{time.perf_counter() - t0:.0f} s)")
    index = {"metadata": {"total_size": 2 * sum(math.prod(s) for s in shapes.values())},
             "weight_map": weight_map}
    (out / checkpoint.INDEX_NAME).write_text(json.dumps(index, indent=2), encoding="utf-8")
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(bundled_model_dir() / name, out / name)


def synthesise(target: Path, config: dict, seed: int = 0, shard_bytes: int = SHARD_BYTES,
               show: Callable[[str], None] = console.info) -> Path:
    """Write a random-weight bf16 checkpoint for `config` at `target`, a line to `show` a shard.
    It is built in a sibling folder and renamed into place only when complete, so an interrupted
    synthesis is never reused."""
    cfg = DeepseekV2Config.from_dict(config)
    target.parent.mkdir(parents=True, exist_ok=True)
    needed = 2 * sum(math.prod(s) for s in checkpoint.expected_shapes(cfg).values())     # bf16
    files.check_free_disk(target.parent, int(needed * 1.05), "the benchmark checkpoint", BenchError,
                          "pick another place with --cache-dir or DS2_BENCH_DIR, or fewer --layers")
    with files.building(target, replace=False) as partial:
        write_checkpoint(partial, config, seed, shard_bytes, show)
    return target


def synthetic_path(bench_dir: Path, layers: int) -> Path:
    return bench_dir.expanduser() / f"deepseek-v2-lite-{layers}-layers"


def synthetic_model(bench_dir: Path, layers: int) -> Path:
    """The synthetic DeepSeek-V2-Lite slice, synthesised on first use and reused after."""
    target = synthetic_path(bench_dir, layers)
    if (target / "config.json").is_file():
        return target
    console.info(f"synthesising {article(layers)} {layers}-layer DeepSeek-V2-Lite-shaped checkpoint in {target} (once)")
    return synthesise(target, lite_config(layers))

