"""What `ds2 inspect` reports: a checkpoint described as JSON-ready data (inspect_tables.py renders it).

`describe` reads config.json, the safetensors headers, tokenizer_config.json, tokenizer.json and
generation_config.json, never tensor data (unless `check`), so it is instant on a 30 GB checkpoint.
A Hugging Face id whose shards are not downloaded is described from their headers read over
HTTP (hub.resolve_headers, passed in as `shards`): the same report, from the same code.
It loads the tokenizer exactly as `generate` would and renders the chat template once, so a
checkpoint that `generate` refuses for its tokenizer does not pass inspect.
Parameter counts come from the stored headers, not from the config, so they describe what is
actually on disk; disagreements with the config are listed in `problems`, not raised. Two
exceptions count what the config describes instead: a ds2 low-bit checkpoint (it stores prepared
tensors, see qcheckpoint.py) and one with a shard that cannot be read (its tensors are unknown).
Storage counts weights, not stored elements (a q4 byte holds two); the scales of ds2's low-bit
formats hold no parameters, so storage lists their bytes with 0 parameters and `dtypes` leaves
them out.

Active parameters per token count what one token's forward pass multiplies by:
  everything stored
  - routed experts, + num_experts_per_tok / n_routed_experts of each MoE layer's routed experts
  - the input embedding when untied: a token reads one row of it (D values), not the matrix
    (DeepSeek's published "2.4B active" for V2-Lite counts the same way)
  - a stored lm_head.weight when tied: the tied model reads the embedding matrix as its head
so lm_head (or the tied embedding standing in for it) is counted once.

DeepSeek-V3 checkpoints may also store fp8 weights with block scales (`*.weight_scale_inv`,
reported under `fp8`, not counted as parameters) and multi-token-prediction layers after the
decoder (reported under `mtp` and counted apart: inference never reads them).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from ds2cli.weights import checkpoint
from ds2cli.weights import checksums
from ds2cli.weights import memory
from ds2cli.weights import qcheckpoint
from ds2cli.model import rope
from ds2cli.weights.checkpoint import TensorInfo
from ds2cli.json_files import read_json_object
from ds2cli.model.config import DeepseekV2Config
from ds2cli.errors import CheckpointError, ConfigError, Ds2Error
from ds2cli.weights.source import check_model_dir, read_generation_config
from ds2cli.text.tiktoken_convert import has_tiktoken, load_backend as load_tiktoken_backend
from ds2cli.text.tokenizer import Tokenizer

FLOAT32_BYTES = 4  # ds2 computes, and keeps its caches, in float32
PARAM_CATEGORIES = ("embeddings", "attention", "dense_mlp", "routed_experts", "shared_experts",
                    "router", "norms", "lm_head", "other")


def describe(model_dir: str | Path, check: bool = False, shards: checkpoint.Shards | None = None,
             budget: int | None = None, verify: bool = False) -> dict:
    """The report for one checkpoint directory (JSON-serialisable).

    Raises ConfigError for a missing or invalid config.json; every other defect (safetensors
    files or headers that cannot be read, tensors that disagree with the config, a broken
    tokenizer or generation config, NaN/Inf weights found by `check`) is a string in `problems`,
    and the rest of the report is made of what can be read.
    With `check`, every tensor's values are scanned, one tensor at a time; with `verify`, every
    tensor's bytes are checked against the checksums the index records (weights/checksums.py).
    `shards` is where the safetensors files are read, by default the directory's own; for a Hub
    id, the shards' headers read over HTTP (hub.resolve_headers), which hold no data to check.
    `budget`: the --memory-budget whose expert cache the report sizes (default: the memory
    available now)."""
    model_dir = check_model_dir(model_dir)
    if (check or verify) and shards is not None:
        raise ConfigError(f"{'--check' if check else '--verify'} reads every weight: it needs the shards downloaded, "
                          f"not only their headers")
    cfg = DeepseekV2Config.from_file(model_dir / "config.json")
    stored, qc, found, complete = read_checkpoint(model_dir, cfg, shards)
    tensors = {n: t for n, t in stored.items() if not checkpoint.is_mtp(n, cfg)}  # what inference reads
    generation, gen_problems = _generation_config(model_dir)
    tok, tok_problems = tokenizer_section(model_dir, cfg, generation)
    tok["generation_config"] = (model_dir / "generation_config.json").is_file()
    params = params_section(cfg, tensors if qc is None and complete else expected_tensors(cfg))
    storage = storage_section(model_dir, stored, qc, shards)
    mem = memory_section(cfg, params["total"])
    mem["formats"] = memory.fits(cfg, qc)
    mem["streaming"] = streaming_section(cfg, qc, qc is not None, str(model_dir), budget)
    scanned, scan_problems = scan_values(stored) if check else (None, [])
    verified = verify_checksums(model_dir, stored) if verify else None
    return {
        "path": str(model_dir.absolute()),      # absolute in every command's --json
        "model_type": cfg.model_type,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "params": params["total"],
        "active_params_per_token": params["active_per_token"],
        "dtypes": {dtype: d["params"] for dtype, d in storage["dtypes"].items() if d["params"]},
        "moe_layers": cfg.moe_layers,
        "dense_layers": cfg.dense_layers,
        "latent_cache_bytes_per_token": mem["latent_cache_bytes_per_token"],
        "mha_cache_bytes_per_token": mem["mha_cache_bytes_per_token"],
        "model": model_section(cfg),
        "mla": mla_section(cfg),
        "moe": moe_section(cfg),
        "fp8": fp8_section(cfg, tensors),
        "mtp": mtp_section(cfg, stored),
        "params_by_category": params,
        "storage": storage,
        "memory": mem,
        "quantization": None if qc is None else {**qc.to_json(), "file_bytes": storage["total_bytes"]},
        "tokenizer": tok,
        "check": scanned,
        "verify": None if verified is None else verified.to_json(),
        "warnings": [],
        "problems": found + gen_problems + tok_problems + scan_problems + ([] if verified is None else verified.problems),
    }


def verify_checksums(model_dir: Path, stored: dict[str, TensorInfo]) -> checksums.Verified:
    """--verify: the stored bytes against the index's checksums; a checkpoint that records none
    (a float checkpoint, a ds2 copy written before they were) is a problem: nothing was verified."""
    try:
        recorded = checksums.recorded(model_dir)
    except CheckpointError as e:
        return checksums.Verified(problems=[str(e)])
    if recorded is None:
        return checksums.Verified(problems=[f"--verify: {checkpoint.INDEX_NAME} records no checksums to check the "
                                            f"weights against (`ds2 quantize` writes them; a float checkpoint has none)"])
    return checksums.verify(stored, recorded)


def read_checkpoint(model_dir: Path, cfg: DeepseekV2Config, shards: checkpoint.Shards | None = None
                    ) -> tuple[dict[str, TensorInfo], qcheckpoint.QuantConfig | None, list[str], bool]:
    """(the tensors of every readable shard, the ds2 quantization_config, problems, whether every
    shard was read). The tensors are checked against the config only when every shard was read
    and the layout is known: otherwise each tensor of an unreadable shard, or of the ds2 layout
    read as Hugging Face's, would be one more problem that says nothing new."""
    stored, found = checkpoint.read_readable_headers(model_dir, shards)
    complete = not found
    qc, qc_problems = quantization_config(model_dir)
    found += qc_problems
    if not found:
        found = checkpoint.problems(cfg, stored) if qc is None else qcheckpoint.problems(cfg, qc, stored)
    return stored, qc, found, complete


def quantization_config(model_dir: Path) -> tuple[qcheckpoint.QuantConfig | None, list[str]]:
    """The ds2 quantization_config, or the reason it is unusable as a problem."""
    try:
        return qcheckpoint.read_quant_config(read_json_object(model_dir / "config.json", Ds2Error)), []
    except Ds2Error as e:
        return None, [str(e)]


def expected_tensors(cfg: DeepseekV2Config) -> dict[str, TensorInfo]:
    """The Hugging Face tensors the config describes, as header entries (for parameter counts)."""
    return {name: TensorInfo(name, "F32", shape, Path(), 0) for name, shape in checkpoint.iter_expected(cfg)}


# ---- config sections ----

def model_section(cfg: DeepseekV2Config) -> dict:
    return {"type": cfg.model_type,
            "family": "DeepSeek-V3" if cfg.is_v3 else "DeepSeek-V2",
            "layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "heads": cfg.num_attention_heads,
            "vocab_size": cfg.vocab_size,
            "context_length": cfg.max_position_embeddings,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": rope_scaling(cfg),
            "softmax_scale": rope.softmax_scale(cfg),
            "tie_word_embeddings": cfg.tie_word_embeddings}


def rope_scaling(cfg: DeepseekV2Config) -> dict | None:
    """YaRN's parameters with the original's defaults filled in; None for plain RoPE."""
    if cfg.rope_scaling is None:
        return None
    p = {**rope.YARN_DEFAULTS, **cfg.rope_scaling}
    keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
            "mscale", "mscale_all_dim")
    return {"type": "yarn", **{k: p[k] for k in keys}}


def mla_section(cfg: DeepseekV2Config) -> dict:
    return {"q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "q_head_dim": cfg.q_head_dim,
            "v_head_dim": cfg.v_head_dim}


def moe_section(cfg: DeepseekV2Config) -> dict:
    keys = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "topk_method",
            "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
            "moe_intermediate_size", "intermediate_size", "first_k_dense_replace", "moe_layer_freq")
    return {"router": router_description(cfg),
            **{k: getattr(cfg, k) for k in keys},
            "moe_layers": cfg.moe_layers, "dense_layers": cfg.dense_layers}


def router_description(cfg: DeepseekV2Config) -> str:
    """How the gate picks experts, in words."""
    if cfg.topk_method == "noaux_tc":
        groups = (f", top {cfg.topk_group} of {cfg.n_group} groups by their two best"
                  if cfg.n_group > 1 else "")
        return f"sigmoid, noaux_tc (e_score_correction_bias chooses{groups})"
    if cfg.topk_method == "group_limited_greedy":
        return f"softmax, group-limited greedy (top {cfg.topk_group} of {cfg.n_group} groups)"
    return "softmax, greedy"


def fp8_section(cfg: DeepseekV2Config, tensors: dict[str, TensorInfo]) -> dict | None:
    """fp8 block-quantized storage: which tensors, and the scales beside them (None: no fp8)."""
    fp8 = [t for t in tensors.values() if t.dtype in checkpoint.FP8_DTYPES]
    scales = [t for n, t in tensors.items() if n.endswith(checkpoint.SCALE_SUFFIX)]
    if not fp8 and cfg.quantization_config is None:
        return None
    qc = cfg.quantization_config or {}
    return {"quant_method": qc.get("quant_method"), "fmt": qc.get("fmt"),
            "weight_block_size": qc.get("weight_block_size"),
            "tensors": len(fp8), "params": sum(t.numel for t in fp8),
            "scale_tensors": len(scales), "scale_bytes": sum(t.nbytes for t in scales),
            "dequantized_to": "float32 at load, one tensor at a time"}


def mtp_section(cfg: DeepseekV2Config, stored: dict[str, TensorInfo]) -> dict:
    """The multi-token-prediction layers stored after the decoder: ignored, counted apart."""
    mtp = {n: t for n, t in stored.items() if checkpoint.is_mtp(n, cfg)}
    return {"layers": cfg.mtp_layers,
            "tensors": len(mtp),
            "params": sum(t.numel for t in parameters(mtp).values()),
            "bytes": sum(t.nbytes for t in mtp.values())}


# ---- parameters, from the stored headers ----

def param_category(name: str) -> str:
    """Which row of the Parameters table a checkpoint tensor belongs to."""
    if name == "model.embed_tokens.weight":
        return "embeddings"
    if name == "lm_head.weight":
        return "lm_head"
    if name.endswith("norm.weight"):  # input/post_attention/q_a/kv_a layernorms and model.norm
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense_mlp"
    return "other"


def parameters(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The tensors that are parameters: rotary inv_freq buffers some exporters store are not,
    nor are fp8 block scales (weight_scale_inv)."""
    skipped = checkpoint.IGNORED_SUFFIXES + (checkpoint.SCALE_SUFFIX,)
    return {n: t for n, t in tensors.items() if not n.endswith(skipped)}


def layer_index(name: str) -> int | None:
    # "model.layers.3.mlp.experts.7.up_proj.weight" -> 3
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else None


def routed_active(cfg: DeepseekV2Config, tensors: dict[str, TensorInfo]) -> int:
    """The routed-expert parameters one token runs: top-k of n experts in each MoE layer."""
    if not cfg.n_routed_experts:
        return 0
    per_layer: dict[int | None, int] = {}
    for name, t in tensors.items():
        if param_category(name) == "routed_experts":
            i = layer_index(name)
            per_layer[i] = per_layer.get(i, 0) + t.numel
    return sum(n * cfg.num_experts_per_tok // cfg.n_routed_experts for n in per_layer.values())


def params_section(cfg: DeepseekV2Config, tensors: dict[str, TensorInfo]) -> dict:
    """Parameter counts by category, total and active per token (see the module docstring)."""
    counts = dict.fromkeys(PARAM_CATEGORIES, 0)
    for name, t in parameters(tensors).items():
        counts[param_category(name)] += t.numel
    total = sum(counts.values())
    active_routed = routed_active(cfg, parameters(tensors))
    unread = counts["lm_head"] if cfg.tie_word_embeddings else counts["embeddings"]
    return {**counts,
            "routed_experts_active": active_routed,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "total": total,
            "active_per_token": total - counts["routed_experts"] + active_routed - unread}


# ---- storage and memory ----

def storage_section(model_dir: Path, tensors: dict[str, TensorInfo], qc: qcheckpoint.QuantConfig | None,
                    shards: checkpoint.Shards | None = None) -> dict:
    """The files, and parameters and bytes by storage: the safetensors dtype, or for a ds2 low-bit
    checkpoint its formats ("q4 (U8, 2 per byte)", "q8 scales (F32)": see qcheckpoint.stored_kind).
    A file's size is what its folder says, or for a Hub id's shard what the Hub said (hub.read_range)."""
    shards = shards or checkpoint.LocalShards(model_dir)
    files = [{"name": p.name, "bytes": shards.size(p.name)} for p in checkpoint.find_shards(model_dir, shards)[0]]
    dtypes: dict[str, dict] = {}
    for name, t in parameters(tensors).items():
        kind, weights_per_element = (t.dtype, 1) if qc is None else qcheckpoint.stored_kind(name, tensors)
        d = dtypes.setdefault(kind, {"params": 0, "bytes": 0})
        d["params"] += t.numel * weights_per_element
        d["bytes"] += t.nbytes
    return {"files": files,
            "total_bytes": sum(f["bytes"] for f in files),
            "n_tensors": len(tensors),
            "dtypes": dtypes}


def latent_cache_bytes_per_token(cfg: DeepseekV2Config) -> int:
    """MLA caches one compressed latent (C) and one shared rope key (R) per layer."""
    return cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * FLOAT32_BYTES


def mha_cache_bytes_per_token(cfg: DeepseekV2Config) -> int:
    """What a standard cache would hold: every head's K (q_head_dim) and V (v_head_dim)."""
    per_head = cfg.q_head_dim + cfg.v_head_dim
    return cfg.num_hidden_layers * cfg.num_attention_heads * per_head * FLOAT32_BYTES


def memory_section(cfg: DeepseekV2Config, params: int) -> dict:
    latent, mha = latent_cache_bytes_per_token(cfg), mha_cache_bytes_per_token(cfg)
    n = cfg.max_position_embeddings
    return {"float32_weight_bytes": params * FLOAT32_BYTES,
            "latent_cache_bytes_per_token": latent,
            "mha_cache_bytes_per_token": mha,
            "mha_to_latent_ratio": mha / latent,
            "context_length": n,
            "latent_cache_bytes_at_context": latent * n,
            "mha_cache_bytes_at_context": mha * n}


def streaming_section(cfg: DeepseekV2Config, qc: qcheckpoint.QuantConfig | None, as_stored: bool, source: str,
                      budget: int | None = None) -> list[dict]:
    """What --memory-budget holds (memory.streaming_summary) for each low-bit form the model can
    stream in: its own (`as_stored`: a ds2 low-bit checkpoint, a Q8_0 GGUF's q8b), else the
    8-bit and 4-bit copies `command` makes; the expert cache sized at `budget` (default: the
    memory available now). Empty for a model without routed experts."""
    given = budget is not None
    budget = budget if given else memory.available_bytes()
    forms = [(qc, None)] if as_stored else [(qcheckpoint.QuantConfig.recipe(bits), f"ds2 quantize {source} OUT --bits {bits}")
                                            for bits in (8, 4)]
    out = []
    for form, command in forms:
        summary = memory.streaming_summary(cfg, form, budget=budget)
        if summary is not None:
            out.append({**summary, "command": command, "budget_given": given})
    return out


# ---- tokenizer, from its JSON files (headers only: no tokenizers.Tokenizer is built) ----

def _read_json(path: Path) -> tuple[dict | None, list[str]]:
    """(object, []) / (None, []) when absent / (None, [problem]) when unusable."""
    if not path.is_file():
        return None, []
    try:
        return read_json_object(path, Ds2Error), []
    except Ds2Error as e:
        return None, [str(e)]


def _generation_config(model_dir: Path) -> tuple[dict, list[str]]:
    try:
        return read_generation_config(model_dir), []
    except Ds2Error as e:
        return {}, [str(e)]


def _ids(value) -> list[int]:
    """An eos_token_id given as an int, a list of ints, or absent -> a list."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def token_content(token) -> str | None:
    """bos_token / eos_token as a string, or as {"__type": "AddedToken", "content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def vocabulary(tokenizer_json: dict) -> dict[str, int]:
    """token -> id over model.vocab (a dict, or Unigram's list of [token, score]) and added_tokens."""
    model = tokenizer_json.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        out = {t: i for t, i in vocab.items() if isinstance(i, int)}
    elif isinstance(vocab, list):
        out = {e[0]: i for i, e in enumerate(vocab)
               if isinstance(e, list) and e and isinstance(e[0], str)}
    else:
        out = {}
    added_tokens = tokenizer_json.get("added_tokens")
    for added in added_tokens if isinstance(added_tokens, list) else []:
        if not isinstance(added, dict):
            continue
        if isinstance(added.get("id"), int) and isinstance(added.get("content"), str):
            out[added["content"]] = added["id"]
    return out


def tokenizer_section(model_dir: Path, cfg: DeepseekV2Config,
                      generation: dict) -> tuple[dict, list[str]]:
    """bos/eos, vocabulary size and chat template, and every reason `generate` would refuse the
    tokenizer: tokenizer.json missing or invalid, ids beyond vocab_size, bos/eos not in the
    vocabulary, a chat template that does not compile or render. An absent
    tokenizer_config.json is not a problem (every field has a default)."""
    tok_json, p1 = _read_json(model_dir / "tokenizer.json")
    tok_cfg, p2 = _read_json(model_dir / "tokenizer_config.json")
    kind = "tokenizer.json"
    if not (model_dir / "tokenizer.json").is_file() and has_tiktoken(model_dir):
        kind = "tiktoken.model (converted)"
        tok_json, p1 = converted_tiktoken_json(model_dir)
        if not (p1 or p2):
            p1 = tokenizer_problems(model_dir, cfg)
    elif not (model_dir / "tokenizer.json").is_file():
        p1 = [f"{model_dir / 'tokenizer.json'} not found: generate and chat need a Hugging Face tokenizer.json"]
    elif not (p1 or p2):
        p1 = tokenizer_problems(model_dir, cfg)
    vocab = vocabulary(tok_json) if tok_json else {}
    tc = tok_cfg or {}
    bos, eos = token_content(tc.get("bos_token")), token_content(tc.get("eos_token"))
    section = {"kind": kind, "tokenizer_json": kind == "tokenizer.json" and tok_json is not None,
               "tokenizer_config": tok_cfg is not None,
               "vocab_size": max(vocab.values()) + 1 if vocab else None,
               "bos_token": bos, "bos_token_id": vocab.get(bos) if bos else None,
               "eos_token": eos, "eos_token_id": vocab.get(eos) if eos else None,
               "add_bos_token": tc.get("add_bos_token"),
               "chat_template": bool(tc.get("chat_template")),
               "generation_eos_token_ids": _ids(generation.get("eos_token_id")),
               "config_bos_token_id": cfg.bos_token_id,
               "config_eos_token_ids": list(cfg.eos_token_ids)}
    return section, p1 + p2


def converted_tiktoken_json(model_dir: Path) -> tuple[dict | None, list[str]]:
    """What tiktoken.model converts to (from ds2's cache once converted), as tokenizer.json's object."""
    try:
        return json.loads(load_tiktoken_backend(model_dir).to_str()), []
    except Ds2Error as e:
        return None, [str(e)]


SAMPLE_CHAT = [{"role": "user", "content": "Hello"}]


def tokenizer_problems(model_dir: Path, cfg: DeepseekV2Config) -> list[str]:
    """Load the tokenizer as `generate` does, then render a one-message chat as `--chat` does."""
    try:
        tokenizer = Tokenizer.load(model_dir, vocab_size=cfg.vocab_size)
        tokenizer.render_chat(SAMPLE_CHAT, add_generation_prompt=True)
    except Ds2Error as e:
        return [str(e)]
    return []


# ---- --check: scan values ----

def scan_values(tensors: dict[str, TensorInfo]) -> tuple[dict, list[str]]:
    """What the scan did ({"tensors_read", "nonfinite_tensors", "stopped"}: the report says so,
    so that a clean scan is seen to have run) and one problem per floating-point tensor holding
    NaN or Inf (generate would stop on the non-finite logits they cause), read one tensor at a
    time. fp8 weights are scanned as stored (their scales are scanned as tensors of their own), so
    a missing or mis-shaped scale stays a problem of its own in the report, not a failure of the scan."""
    # F8_E4M3 is read below; another fp8 dtype is unsupported, a problem of its own already
    names = [n for n, t in tensors.items() if t.dtype.startswith(("F", "BF")) and not t.dtype.startswith("F8_")]
    fp8 = ((n, checkpoint.read_fp8(t).astype(np.float32)) for n, t in tensors.items()
           if t.dtype in checkpoint.FP8_DTYPES)
    problems, read, stopped = [], 0, False
    try:
        for name, a in itertools.chain(checkpoint.iter_float32(tensors, names), fp8):
            read += 1
            nan, inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
            if nan or inf:
                problems.append(f"tensor {name} has {nan} NaN and {inf} Inf values")
    except CheckpointError as e:   # data the header promised but that cannot be read as it says
        problems.append(f"{e} (the --check scan stopped there)")
        stopped = True
    return {"tensors_read": read, "nonfinite_tensors": len(problems) - stopped, "stopped": stopped}, problems
