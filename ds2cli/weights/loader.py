"""Loading an opened model (source.py) into a Model: the memory check, weights (converted or
quantized layer by layer, or memory-mapped as `ds2 quantize` stored them), MLA weight absorption
and RoPE row order, once, at load."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from ds2cli.weights import checkpoint
from ds2cli.weights import expert_cache
from ds2cli.weights import memory
from ds2cli.weights import qcheckpoint
from ds2cli.weights import streaming
from ds2cli.model import rope
from ds2cli.model.layers import MLP, Attention, Layer, MoE, Weights
from ds2cli.model.config import DeepseekV2Config
from ds2cli.errors import ConfigError
from ds2cli.weights.source import Source, open_model
from ds2cli.model.transformer import Model
from ds2cli.wording import article

Progress = Callable[[int, int], None]  # (layers done, layers total)


def load_form(source: Source, quantize: int | str | None, context: int | None = None) -> tuple:
    """(bits to quantize to at load or None, the recipe when not quantize's own) for loading
    `source` with load's `quantize`: checked, "auto" decided, a GGUF's own form by default."""
    model_dir, cfg, gguf, stored = source.path, source.config, source.gguf, source.stored
    recipe = None                                  # the formats it loads into, when not quantize's recipe
    if quantize == "exact":                        # a Q8_0 GGUF's own blocks (gguf_model.exact_recipe)
        if gguf is None or gguf.exact_recipe is None:
            raise ConfigError("--quantize exact keeps a Q8_0 GGUF's own blocks; "
                              f"{model_dir} is {'a ' + gguf.bulk_type if gguf else 'not a'} GGUF")
        quantize, recipe = 8, gguf.exact_recipe
    if gguf is not None and quantize is None:
        # the ds2 format nearest the file's own types (a Q8_0 file: its own blocks)
        quantize, recipe = gguf.default_bits, gguf.default_recipe
    if quantize not in (None, 8, 4, "auto"):
        raise ConfigError(f"quantize must be 8, 4, 'auto' or 'exact', got {quantize!r}")
    if stored is not None and quantize not in (None, "auto", stored.bits):
        raise ConfigError(f"{model_dir} is already {article(stored.bits)} {stored.bits}-bit ds2 checkpoint; "
                          f"it cannot be loaded as {quantize}-bit")
    if quantize == "auto":
        quantize = None if stored is not None else memory.choose_auto(cfg, context, path=model_dir)
    return quantize, recipe


def formats_of(source: Source, quantize: int | None, recipe) -> "qcheckpoint.QuantConfig | None":
    """The formats the weights take in memory (None: float32)."""
    return source.stored or recipe or (qcheckpoint.QuantConfig.recipe(quantize) if quantize else None)


def names_by_layer(tensors, num_layers: int) -> list[list[str]]:
    """Each layer's stored tensor names, found in one pass (a full V2 holds ~55k tensors).
    fp8 scales travel with their weights (checkpoint.iter_tensors) and the MTP layers stored
    after the decoder (DeepSeek-V3's num_nextn_predict_layers) are never read."""
    layers: list[list[str]] = [[] for _ in range(num_layers)]
    skipped = checkpoint.IGNORED_SUFFIXES + (checkpoint.SCALE_SUFFIX,)
    for name in tensors:
        parts = name.split(".", 3)
        if parts[:2] == ["model", "layers"] and not name.endswith(skipped):
            i = int(parts[2])                    # validate() has vouched for every layer index
            if i < num_layers:
                layers[i].append(name)
    return layers


def prepare_attention(t: dict, cfg: DeepseekV2Config) -> dict:
    """Permute the RoPE rows to the original's de-interleaved order and split kv_b_proj into
    the absorbed per-head W_UK / W_UV, once, at load."""
    H, d, R, C, v = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                     cfg.kv_lora_rank, cfg.v_head_dim)
    q_rows = np.concatenate([h * (d + R) + np.concatenate([np.arange(d), d + rope.rope_rows(cfg)])
                             for h in range(H)])
    q_name = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
    w = {q_name: t.pop(q_name)[q_rows]}
    if cfg.q_lora_rank is not None:
        w["q_a_proj"], w["q_a_layernorm"] = t.pop("q_a_proj"), t.pop("q_a_layernorm")
    kv_rows = np.concatenate([np.arange(C), C + rope.rope_rows(cfg)])
    w["kv_a_proj_with_mqa"] = t.pop("kv_a_proj_with_mqa")[kv_rows]
    w["kv_a_layernorm"] = t.pop("kv_a_layernorm")
    kv_b = t.pop("kv_b_proj").reshape(H, d + v, C)                          # (H, d+v, C)
    w["w_uk"] = np.ascontiguousarray(kv_b[:, :d])                           # (H, d, C)
    w["w_uv"] = np.ascontiguousarray(kv_b[:, d:].transpose(0, 2, 1))        # (H, C, v)
    w["o_proj"] = t.pop("o_proj")
    return w


def mlp_slots(cfg: DeepseekV2Config, i: int, qc: qcheckpoint.QuantConfig | None = None,
              experts: range | None = None, expert_batch: int | None = None) -> tuple[dict, dict]:
    """Layer i's fused MLP arrays, preallocated, and where each checkpoint tensor goes in them.

    gate_proj fills the first half of a (2I, D) gate_up matrix and up_proj the second, so one
    matmul computes both; every expert sits in one (E, 2I, D) / (E, D, I) pair. Each stored
    tensor is converted to float32 straight into its slot: no per-layer float32 copy of the
    experts exists beside the stacked arrays, which keeps the load's peak memory near the
    weights' own size. With qc, the routed experts' stacks are qcheckpoint.ExpertStacks, which
    quantize each expert once it is read: their float32 stacks never exist. `experts`: only those
    routed experts, stacked from 0 (a node of a cluster spread by experts; empty: none)."""
    D, w, slots = cfg.hidden_size, {}, {}

    def stack(key: str, shape: tuple[int, int, int]):
        f = qcheckpoint.format_for(qc, "mlp", key, shape)
        return qcheckpoint.ExpertStack(shape, f, expert_batch) if f is not None else np.empty(shape, np.float32)

    def fuse(prefix: str, gate_up: str, down: str, inter: int, lead: tuple = ()) -> None:
        slots[prefix + "gate_proj"] = (w[gate_up], lead + (slice(0, inter),))
        slots[prefix + "up_proj"] = (w[gate_up], lead + (slice(inter, 2 * inter),))
        slots[prefix + "down_proj"] = (w[down], lead)

    if not cfg.is_moe_layer(i):
        inter = cfg.intermediate_size
        w.update(gate_up=np.empty((2 * inter, D), np.float32), down_proj=np.empty((D, inter), np.float32))
        fuse("", "gate_up", "down_proj", inter)
        return w, slots
    experts = range(cfg.n_routed_experts) if experts is None else experts
    E, inter = len(experts), cfg.moe_intermediate_size
    if E:
        w.update(experts_gate_up=stack("experts_gate_up", (E, 2 * inter, D)),
                 experts_down=stack("experts_down", (E, D, inter)))
    for e in experts:
        fuse(f"experts.{e}.", "experts_gate_up", "experts_down", inter, (e - experts.start,))
    if cfg.n_shared_experts:
        shared = inter * cfg.n_shared_experts
        w.update(shared_gate_up=np.empty((2 * shared, D), np.float32),
                 shared_down=np.empty((D, shared), np.float32))
        fuse("shared_experts.", "shared_gate_up", "shared_down", shared)
    return w, slots


def as_layer(cfg: DeepseekV2Config, i: int, norms: tuple, attn: dict, mlp: dict) -> Layer:
    """A prepared layer's arrays as a layers.Layer whose matrices are weight objects: the
    projections (qcheckpoint.ROLES names them) formats.Dense, w_uk and w_uv linear.Heads; norms
    and the router gate stay arrays (float32, until qcheckpoint.quantize_layer rounds w_uk, w_uv
    and the gate to bfloat16)."""
    part = MoE if cfg.is_moe_layer(i) else MLP
    return Layer(norms[0], Attention(**{k: qcheckpoint.as_stored_weight("attn", k, w) for k, w in attn.items()}),
                 norms[1], part(**{k: qcheckpoint.as_stored_weight("mlp", k, w) for k, w in mlp.items()}))


def read_tensors(tensors, names: list[str]):
    """(name, array) for `names` from safetensors headers, or from a GGUF file's mapping
    (gguf_tensors.GGUFTensors, which dequantizes each tensor as it is asked for)."""
    if hasattr(tensors, "iter_tensors"):
        return tensors.iter_tensors(names)
    return checkpoint.iter_tensors(tensors, names)


def strip(name: str, prefix: str) -> str:
    # "model.layers.3.self_attn.kv_b_proj.weight" -> "kv_b_proj"
    return name[len(prefix):].removesuffix(".weight").removeprefix("self_attn.").removeprefix("mlp.")


def expert_of(name: str, prefix: str) -> int:
    """The routed expert a layer's tensor belongs to ("...mlp.experts.17.gate_proj.weight": 17),
    -1 for the others."""
    rest = name[len(prefix):]
    if rest.startswith("mlp.experts."):
        return int(rest.split(".")[2])
    return -1


def kept_names(names: list[str], i: int, experts: range | None, only_experts: bool = False) -> list[str]:
    """Layer i's tensor names but the routed experts outside `experts` (None: all of them);
    `only_experts`: the routed experts in `experts` alone."""
    prefix = f"model.layers.{i}."
    if experts is None and not only_experts:
        return names
    out = []
    for n in names:
        e = expert_of(n, prefix)
        if (e >= 0 and (experts is None or e in experts)) or (e < 0 and not only_experts):
            out.append(n)
    return out


def load_routed(tensors, names: list[str], cfg: DeepseekV2Config, i: int,
                qc: qcheckpoint.QuantConfig | None, experts: range) -> Layer:
    """Only MoE layer i's routed experts `experts` (stacked from 0), in qc's formats: what a node
    of a cluster spread by experts holds of a layer outside its range."""
    mlp, slots = mlp_slots(cfg, i, qc, experts)
    prefix = f"model.layers.{i}."
    for name, array in read_tensors(tensors, sorted(kept_names(names, i, experts, True),
                                                    key=lambda n: expert_of(n, prefix))):
        dst, index = slots[strip(name, prefix)]
        dst[index] = array
    mlp = {k: w.finish() if isinstance(w, qcheckpoint.ExpertStack) else w for k, w in mlp.items()
           if k.startswith("experts_")}
    return Layer(None, Attention(), None, MoE(**{k: qcheckpoint.as_stored_weight("mlp", k, w) for k, w in mlp.items()}))


def load_layer(tensors, names: list[str], cfg: DeepseekV2Config, i: int,
               qc: qcheckpoint.QuantConfig | None = None, experts: range | None = None,
               expert_batch: int | None = None) -> Layer:
    """Layer i, prepared, in float32; with qc its routed experts already in qc's formats (the
    rest is for qcheckpoint.quantize_layer). `experts`: only those routed experts (mlp_slots)."""
    prefix = f"model.layers.{i}."
    mlp, slots = mlp_slots(cfg, i, qc, experts, expert_batch)
    names = kept_names(names, i, experts)
    t = {}
    # an expert's tensors together, so each one is complete (and quantized) soon after it starts
    # (a GGUF lists all experts' gate slabs, then all up slabs)
    names = sorted(names, key=lambda n: expert_of(n, prefix))
    for name, array in read_tensors(tensors, names):
        key = strip(name, prefix)
        if key in slots:
            dst, index = slots[key]
            dst[index] = array                   # converts to float32 in place (or quantizes)
        else:
            t[key] = np.ascontiguousarray(array, dtype=np.float32)
    for key, w in mlp.items():
        if isinstance(w, qcheckpoint.ExpertStack):
            mlp[key] = w.finish()
    if "gate" in t:
        mlp["gate"] = t.pop("gate")
    if "gate.e_score_correction_bias" in t:  # DeepSeek-V3's router bias (E,)
        mlp["e_score_correction_bias"] = t.pop("gate.e_score_correction_bias")
    norms = t.pop("input_layernorm"), t.pop("post_attention_layernorm")
    return as_layer(cfg, i, norms, prepare_attention(t, cfg), mlp)


def load_top(tensors, cfg: DeepseekV2Config, qc: qcheckpoint.QuantConfig | None = None,
             needed: set[str] = frozenset({"embed_tokens", "norm", "lm_head"})) -> dict:
    """The embedding, final norm and lm_head (the embedding itself when tied), in qc's formats;
    those not `needed` are None."""
    top = {"embed_tokens": None, "norm": None, "lm_head": None}
    for key, name in (("embed_tokens", "model.embed_tokens.weight"), ("norm", "model.norm.weight"),
                      ("lm_head", "lm_head.weight")):
        if key not in needed:
            continue
        if key == "lm_head" and cfg.tie_word_embeddings:
            top[key] = top["embed_tokens"]
            continue
        (_, array), = read_tensors(tensors, [name])
        array = np.ascontiguousarray(array, dtype=np.float32)
        top[key] = qcheckpoint.as_stored_weight(
            "", key, qcheckpoint.quantize_weight(array, qcheckpoint.format_for(qc, "", key, array.shape)))
    return top


def load_weights(model_dir: Path, cfg: DeepseekV2Config, progress: Progress | None = None,
                 qc: qcheckpoint.QuantConfig | None = None, tensors: dict | None = None,
                 layers: range | None = None, experts: range | None = None) -> dict:
    """A Hugging Face checkpoint's weights, prepared; with qc, each layer is quantized as soon as
    it is loaded, so only one layer ever exists in float32. `tensors`: the validated headers.
    With `layers`, only those decoder layers (the others None) and the top weights they need;
    with `experts`, only those routed experts of every MoE layer, which the layers outside
    `layers` then hold alone (a node of a cluster spread by experts)."""
    tensors = checkpoint.validate(cfg, model_dir) if tensors is None else tensors
    wanted = range(cfg.num_hidden_layers) if layers is None else layers
    top = load_top(tensors, cfg, qc, qcheckpoint.top_needed(cfg, wanted))
    layers = []
    for i, names in enumerate(names_by_layer(tensors, cfg.num_hidden_layers)):
        if i not in wanted:
            routed = experts is not None and len(experts) and cfg.is_moe_layer(i)
            layers.append(load_routed(tensors, names, cfg, i, qc, experts) if routed else None)
            continue
        layer = load_layer(tensors, names, cfg, i, qc, experts)
        layers.append(qcheckpoint.quantize_layer(layer, qc) if qc else layer)
        if progress:
            progress(i + 1, cfg.num_hidden_layers)
    return {**top, "layers": layers}


def load(path: str | Path | Source | None = None, progress: Progress | None = None,
         quantize: int | str | None = None, context: int | None = None, memory_check: bool = True,
         layers: range | None = None, memory_budget: int | None = None, experts: range | None = None) -> Model:
    """Load a model (default: the bundled ds2-tiny): a path, or a Source that source.open_model
    opened (a command reads its config, tokenizer and prompt from that first, then loads from
    the same object). Config, weights with MLA absorption precomputed, tokenizer and
    generation_config.

    A float checkpoint loads as float32, or with `quantize=8|4` quantized layer by layer as it
    loads (`"auto"`: float32 if it fits in memory, else the most precise format that does;
    `"exact"`: a Q8_0 GGUF's own blocks, q8b, which is also how such a file loads by default); a
    checkpoint written by `ds2 quantize` is memory-mapped as it is stored. Before any weight is
    read, what the model will hold (with a cache of `context` tokens) is checked against the
    memory available (memory.py); `memory_check=False` skips that. The Model runs on the
    reference executor (the calling thread): ds2cli.load (execution/factory.py) gives it the
    executor the options pick.
    `layers`: only that range of decoder layers, and the top weights it needs (a node of a
    cluster computes its range with Model.compute; the memory check is the placement's).
    `experts`: only those routed experts of every MoE layer, stacked from 0, the layers outside
    `layers` holding nothing else (a node of a cluster spread by experts: execution/remote.py).
    `memory_budget` (bytes): the routed experts of a low-bit checkpoint or a Q8_0 GGUF read from
    disk, as they are needed, into a cache that, with everything else, fits the budget
    (weights/streaming.py; the Model's `streamed`)."""
    source = open_model(path)
    model_dir, cfg, stored = source.path, source.config, source.stored
    quantize, recipe = load_form(source, quantize, context)
    # headers first (cheap, and they name a broken checkpoint precisely), then the memory check,
    # then the weights
    tensors = source.tensors
    tokenizer, gen = source.tokenizer, source.generation_config
    qc = formats_of(source, quantize, recipe)
    plan = None
    if memory_budget is not None:
        plan = stream_plan(source, qc, context, memory_budget, memory_check, layers, experts)
    elif memory_check:
        streamable = source.gguf is not None and source.gguf.stream_problem(qc) is None
        memory.check(cfg, model_dir, stored, quantize, context, recipe=recipe, streamable=streamable)
    if stored is not None:
        weights = qcheckpoint.load_weights(cfg, stored, tensors, progress, layers, experts)
    else:      # a streamed GGUF's routed experts are read from the file as they are needed
        weights = load_weights(model_dir, cfg, progress, qc, tensors, layers, experts if plan is None else range(0))
    if plan is not None:
        stored_experts = source.gguf.streamed_experts(qc) if source.gguf else expert_cache.StoredExperts(cfg, stored, tensors)
        weights["streamed"] = streaming.streamed_weights(weights, cfg, stored_experts, plan["slots"], experts)
    return Model(cfg, Weights(**weights), tokenizer, gen, model_dir, quantization=qc)


def stream_problem(source: Source, qc) -> str | None:
    """Why the routed experts of `source` in the formats `qc` cannot be streamed, or None: a ds2
    low-bit checkpoint streams, a GGUF whose experts a ds2 format holds as stored (Q8_0) too."""
    if source.gguf is not None:
        return source.gguf.stream_problem(qc) or None
    if source.stored is None:
        return (f"--memory-budget streams the routed experts of a low-bit ds2 checkpoint or a Q8_0 GGUF; "
                f"{source.path} is a float checkpoint: make a low-bit copy first with "
                f"ds2 quantize {source.path} OUT --bits 4 (or 8)")
    return None


def stream_plan(source: Source, qc, context: int | None, budget: int, memory_check: bool,
                layers: range | None = None, experts: range | None = None) -> dict:
    """memory.streamed's plan for `--memory-budget` (of the share `layers` and `experts` when
    given: a node of a cluster), once the model is known to stream: a ds2 low-bit checkpoint,
    or a GGUF whose experts some ds2 format holds as stored (Q8_0); a float checkpoint must be
    quantized first."""
    problem = stream_problem(source, qc)
    if problem:
        raise ConfigError(problem)
    plan = memory.streamed(source.config, qc, context, budget, layers, experts)
    available = memory.available_bytes() if memory_check else None
    if available is not None and budget > available:
        raise memory.MemoryCheckError(f"--memory-budget {memory.gb(budget)} is more than the "
                                      f"{memory.gb(available)} available")
    return plan
