"""ds2's low-bit checkpoint: the engine's run-time layout, stored so that loading is a memory map.

A directory `ds2 quantize` writes holds config.json (the source's, plus a `quantization_config`
with `"quant_method": "ds2"`), the tokenizer and generation files, model.safetensors.index.json
and one safetensors shard per decoder layer plus one for the embedding, final norm and lm_head.
Tensors are stored *prepared* (as weights/loader.py prepares them from a Hugging Face checkpoint):
the RoPE rows of q and kv_a_proj_with_mqa de-interleaved, kv_b_proj split into per-head
`w_uk` (H, d, C) and `w_uv` (H, C, v), each MLP's gate_proj and up_proj fused into one
`gate_up` (2I, D), and the routed experts stacked as `experts_gate_up` (E, 2I, D) and
`experts_down` (E, D, I). Names:

  model.layers.{i}.{input,post_attention}_layernorm.weight          F32
  model.layers.{i}.self_attn.{q_proj | q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj}.*
  model.layers.{i}.self_attn.{q_a_layernorm, kv_a_layernorm}.weight   F32
  model.layers.{i}.self_attn.{w_uk, w_uv}.weight                    F32, or BF16 (`unquantized`)
  model.layers.{i}.mlp.{gate_up, down_proj}.*                       (dense layers)
  model.layers.{i}.mlp.gate.weight                                  F32, or BF16 (MoE layers)
  model.layers.{i}.mlp.e_score_correction_bias.weight               F32 (DeepSeek-V3's MoE layers)
  model.layers.{i}.mlp.{experts_gate_up, experts_down, shared_gate_up, shared_down}.*
  model.embed_tokens.*, model.norm.weight, lm_head.* (absent when tied)

where `*` is `qweight` + `scales` for a low-bit matrix (weights/formats/) and `weight` (F32)
for one kept in float32. Every tensor starts at a multiple of 64 bytes in its file.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ds2cli.weights import calibration
from ds2cli.weights import checkpoint
from ds2cli.weights import formats as quant
from ds2cli.weights import scales
from ds2cli.model.config import DeepseekV2Config
from ds2cli.model.layers import Layer, new_part
from ds2cli.model.linear import Heads
from ds2cli.weights.formats import Dense
from ds2cli.weights.formats import FORMATS, QuantError, QuantMatrix
from ds2cli.errors import CheckpointError

QUANT_METHOD = "ds2"
VERSION = 2                      # 2: q8 scales per row (1 had groups of 32 rows)
ALIGN = 64

# Which prepared matrices each role of a recipe covers.
ROLES = {"attention": ("attn", ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")),
         "dense_mlp": ("mlp", ("gate_up", "down_proj")),
         "routed_experts": ("mlp", ("experts_gate_up", "experts_down")),
         "shared_experts": ("mlp", ("shared_gate_up", "shared_down")),
         "lm_head": ("", ("lm_head",)),
         "embed_tokens": ("", ("embed_tokens",))}
ROLE_OF = {(part, key): role for role, (part, keys) in ROLES.items() for key in keys}
PART_PREFIX = {"": "", "attn": "self_attn.", "mlp": "mlp."}

# The recipes, by measurement on ds2-tiny (examples/quant_quality.py, the tune prompts; the README
# has the held-out figures). Its error compounds across roles, so a role is kept wider where that
# cut the KL most for its bytes on the 27-layer V2-Lite shape:
#   --bits 8: the embedding, attention and the dense MLP as bfloat16 (lossless from a bfloat16
#     source; faster than int8 to widen from cache, but two bytes a weight from memory: decode on
#     the 4-layer slice about 5% slower); the experts and lm_head q8. Raw-text KL 1.69e-2 all q8,
#     4.9e-3 so (the embedding alone 1.40e-2, with the dense MLP 1.01e-2, with attention 1.05e-2):
#     V2-Lite's file grows 3.7%.
#   --bits 4: the routed experts (92% of V2-Lite's parameters) 4-bit; attention, the embedding,
#     lm_head, the dense MLP and the shared experts 8-bit. Raw-text KL 0.339 with only attention,
#     embedding and lm_head at 8 bits, 0.215 with the dense MLP too, 0.168 with the shared experts
#     (4-bit attention: 0.346): V2-Lite's file grows 2.4%.
# Neither recipe quantizes kv_b_proj's halves w_uk and w_uv (attention multiplies them per head in
# both orientations) or the router gate; both store them bfloat16 (UNQUANTIZED below), a real
# checkpoint's own precision (the original MoEGate too widens a bfloat16 weight to float32):
# 120 MB less than float32 on V2-Lite, which brings its files to +2.96% and +1.1%.
RECIPES = {8: {**dict.fromkeys(ROLES, "q8"), "embed_tokens": "bf16", "attention": "bf16", "dense_mlp": "bf16"},
           4: {**dict.fromkeys(ROLES, "q8"), "routed_experts": "q4"}}
UNQUANTIZED = "bf16"              # how the recipes store these: "f32" (files before it) or "bf16"
UNQUANTIZED_MATRICES = (("attn", "w_uk"), ("attn", "w_uv"), ("mlp", "gate"))


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    bits: int
    formats: dict                     # role -> a FORMATS name ("q8", "q4", "q8b", "bf16") or "f32"
    calibration: dict | None = None   # what calibration.Calibration.describe() said, if one ran
    unquantized: str = "f32"          # UNQUANTIZED_MATRICES: "f32" or "bf16" (files before it: f32)

    @staticmethod
    def recipe(bits: int) -> "QuantConfig":
        if bits not in RECIPES:
            raise QuantError(f"--bits must be 8 or 4, got {bits}")
        return QuantConfig(bits, dict(RECIPES[bits]), unquantized=UNQUANTIZED)

    def format_of(self, part: str, key: str) -> quant.Format | None:
        name = self.formats.get(ROLE_OF.get((part, key)), "f32")
        return None if name == "f32" else FORMATS[name]

    def float_dtype(self, part: str, key: str) -> str:
        """The safetensors dtype of an array the recipe does not quantize."""
        return "BF16" if (part, key) in UNQUANTIZED_MATRICES and self.unquantized == "bf16" else "F32"

    @property
    def used(self) -> list[str]:
        """The low-bit formats the recipe uses, in FORMATS order."""
        return [name for name in FORMATS if name in self.formats.values()]

    def to_json(self) -> dict:
        # scale_search and calibration describe how the scales were chosen, not how to read
        # them: a reader that predates them (ds2 before the scale search) loads the file alike
        d = {"quant_method": QUANT_METHOD, "version": VERSION, "bits": self.bits, "layout": "ds2-prepared",
             "formats": dict(self.formats),
             "format_specs": {name: FORMATS[name].spec() for name in self.used},
             "unquantized": self.unquantized,
             "scale_search": {"q8": list(scales.Q8_STEPS), "q4": list(scales.Q4_STEPS)}}
        if self.calibration is not None:
            d["calibration"] = dict(self.calibration)
        return d

    @staticmethod
    def from_json(d: object) -> "QuantConfig":
        if not isinstance(d, dict):
            raise QuantError("config.json: quantization_config must be an object")
        if d.get("version") != VERSION:
            hint = " (an older ds2 wrote it: run ds2 quantize again)" if d.get("version") == 1 else ""
            raise QuantError(f"config.json: quantization_config version {d.get('version')!r} is not "
                             f"one ds2 reads (it writes version {VERSION}){hint}")
        bits, formats, specs = d.get("bits"), d.get("formats"), d.get("format_specs")
        if not isinstance(bits, int) or bits not in RECIPES:
            raise QuantError(f"config.json: quantization_config bits must be 8 or 4, got {bits!r}")
        if not isinstance(formats, dict) or set(formats) != set(ROLES):
            raise QuantError(f"config.json: quantization_config formats must name exactly the roles "
                             f"{', '.join(ROLES)}")
        for role, name in formats.items():
            if name != "f32" and (not isinstance(name, str) or name not in FORMATS):
                raise QuantError(f"config.json: quantization_config gives {role} the unknown format "
                                 f"{name!r} (ds2 knows {', '.join(FORMATS)}, f32)")
        unquantized = d.get("unquantized", "f32")
        if unquantized not in ("f32", "bf16"):
            raise QuantError(f"config.json: quantization_config unquantized must be \"f32\" or \"bf16\", "
                             f"got {json.dumps(unquantized)}")
        calib = d.get("calibration")
        qc = QuantConfig(bits, dict(formats), calib if isinstance(calib, dict) else None, unquantized)
        if not isinstance(specs, dict):
            raise QuantError("config.json: quantization_config has no format_specs object")
        for name in qc.used:
            if specs.get(name) != FORMATS[name].spec():
                raise QuantError(f"config.json: quantization_config format_specs describes {name} as "
                                 f"{json.dumps(specs.get(name))}, which is not ds2's {name} "
                                 f"({json.dumps(FORMATS[name].spec())})")
        return qc


def read_quant_config(raw: dict) -> QuantConfig | None:
    """The ds2 quantization_config of a parsed config.json; None for a float checkpoint.
    Other tools' quantization_configs (fp8 checkpoints) are not ds2's to read here."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantError("config.json: quantization_config must be an object")
    if qc.get("quant_method") is None:
        raise QuantError("config.json: quantization_config has no quant_method")
    return QuantConfig.from_json(qc) if qc["quant_method"] == QUANT_METHOD else None


# ---- the prepared layout ----

def layer_shapes(cfg: DeepseekV2Config, i: int) -> dict[tuple[str, str], tuple[int, ...]]:
    """(part, key) -> shape of every array of prepared layer i (see loader.load_layer)."""
    D, H, C, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    d, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    s = {("", "input_layernorm"): (D,), ("", "post_attention_layernorm"): (D,)}
    if cfg.q_lora_rank is None:
        s["attn", "q_proj"] = (H * (d + R), D)
    else:
        s["attn", "q_a_proj"] = (cfg.q_lora_rank, D)
        s["attn", "q_a_layernorm"] = (cfg.q_lora_rank,)
        s["attn", "q_b_proj"] = (H * (d + R), cfg.q_lora_rank)
    s["attn", "kv_a_proj_with_mqa"] = (C + R, D)
    s["attn", "kv_a_layernorm"] = (C,)
    s["attn", "w_uk"] = (H, d, C)
    s["attn", "w_uv"] = (H, C, v)
    s["attn", "o_proj"] = (D, H * v)
    if not cfg.is_moe_layer(i):
        inter = cfg.intermediate_size
        s["mlp", "gate_up"], s["mlp", "down_proj"] = (2 * inter, D), (D, inter)
        return s
    E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    s["mlp", "gate"] = (E, D)
    if cfg.topk_method == "noaux_tc":  # DeepSeek-V3's router bias, float32 like the gate
        s["mlp", "e_score_correction_bias"] = (E,)
    s["mlp", "experts_gate_up"], s["mlp", "experts_down"] = (E, 2 * inter, D), (E, D, inter)
    if cfg.n_shared_experts:
        shared = inter * cfg.n_shared_experts
        s["mlp", "shared_gate_up"], s["mlp", "shared_down"] = (2 * shared, D), (D, shared)
    return s


def top_shapes(cfg: DeepseekV2Config) -> dict[tuple[str, str], tuple[int, ...]]:
    V, D = cfg.vocab_size, cfg.hidden_size
    s = {("", "embed_tokens"): (V, D), ("", "norm"): (D,)}
    if not cfg.tie_word_embeddings:
        s["", "lm_head"] = (V, D)
    return s


def stored_name(layer: int | None, part: str, key: str) -> str:
    if layer is None:
        return {"embed_tokens": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}[key]
    return f"model.layers.{layer}.{PART_PREFIX[part]}{key}"


EXPERT_STACKS = ("experts_gate_up", "experts_down")     # the routed experts, (E, ...) in one tensor


def is_expert_stack(name: str) -> bool:
    """Whether a stored tensor holds a MoE layer's routed experts stacked, expert first."""
    stem = name.rsplit(".", 1)[0]
    return stem.startswith("model.layers.") and stem.rsplit(".", 1)[-1] in EXPERT_STACKS


def stored_tensors(name: str, shape: tuple[int, ...], f: quant.Format | None,
                   dtype: str = "F32") -> Iterator[tuple[str, tuple, str]]:
    """(tensor name, shape, safetensors dtype) of one prepared array in format f (None: a float
    array of `dtype`)."""
    if f is None:
        yield name + ".weight", shape, dtype
    else:
        yield name + ".qweight", f.qweight_shape(shape), SAFETENSORS_DTYPES[f.qweight_dtype.name]
        yield name + ".scales", f.scales_shape(shape), SAFETENSORS_DTYPES[f.scale_dtype.name]


def stored_kind(name: str, tensors: dict[str, checkpoint.TensorInfo]) -> tuple[str, int]:
    """How `ds2 inspect` names the storage of a tensor of a ds2 checkpoint, and the weights each of
    its elements holds: ("q4 (U8, 2 per byte)", 2) for a q4 qweight, ("q8 (I8)", 1) for a q8 one,
    ("q8 scales (F32)", 0) for scales (they are not parameters), (dtype, 1) for a float tensor.
    q8 and q8b store the same dtypes, so the format is the one whose shapes the pair has."""
    stem, _, suffix = name.rpartition(".")
    t = tensors[name]
    qweight, scale = tensors.get(stem + ".qweight"), tensors.get(stem + ".scales")
    if suffix in ("qweight", "scales") and qweight is not None and scale is not None:
        for f in FORMATS.values():
            shape = (*qweight.shape[:-1], qweight.shape[-1] * f.per_element)
            if (qweight.dtype, scale.dtype) == (SAFETENSORS_DTYPES[f.qweight_dtype.name], SAFETENSORS_DTYPES[f.scale_dtype.name]) \
                    and f.scales_shape(shape) == tuple(scale.shape):
                if suffix == "scales":
                    return f"{f.name} scales ({t.dtype})", 0
                return (f"{f.name} ({t.dtype}, {f.per_element} per byte)" if f.per_element > 1
                        else f"{f.name} ({t.dtype})", f.per_element)
    return t.dtype, 1


def format_for(qc: QuantConfig | None, part: str, key: str, shape: tuple[int, ...]) -> quant.Format | None:
    f = qc.format_of(part, key) if qc else None
    return f if f is not None and f.supports(shape) else None


def expected(cfg: DeepseekV2Config, qc: QuantConfig) -> Iterator[tuple[str, tuple, str]]:
    for (part, key), shape in top_shapes(cfg).items():
        yield from stored_tensors(stored_name(None, part, key), shape, format_for(qc, part, key, shape))
    for i in range(cfg.num_hidden_layers):
        for (part, key), shape in layer_shapes(cfg, i).items():
            yield from stored_tensors(stored_name(i, part, key), shape, format_for(qc, part, key, shape),
                                      qc.float_dtype(part, key))


def problems(cfg: DeepseekV2Config, qc: QuantConfig, tensors: dict[str, checkpoint.TensorInfo]) -> list[str]:
    """Every missing, unexpected, mis-shaped or mis-typed tensor of a ds2 low-bit checkpoint."""
    limit = 2 * len(tensors) + 10_000
    want, out = {}, []
    for name, shape, dtype in expected(cfg, qc):
        want[name] = (shape, dtype)
        if len(want) > limit:
            return [f"config.json describes more than {limit} tensors but the checkpoint holds {len(tensors)}"]
    for name, (shape, dtype) in want.items():
        info = tensors.get(name)
        if info is None:
            out.append(f"missing tensor {name} {list(shape)}")
        elif info.shape != shape:
            out.append(f"tensor {name} has shape {list(info.shape)}, config says {list(shape)}")
        elif info.dtype != dtype:
            out.append(f"tensor {name} has dtype {info.dtype}, quantization_config says {dtype}")
    out += [f"unexpected tensor {name}" for name in tensors if name not in want]
    return out


# ---- loading: views of the mapped files ----

def load_weights(cfg: DeepseekV2Config, qc: QuantConfig, tensors: dict, progress: Callable | None = None,
                 layers: range | None = None, experts: range | None = None) -> dict:
    """The stored weights memory-mapped; with `layers`, only those decoder layers (the others
    None) and only the top weights they need (top_needed); with `experts`, only those routed
    experts of every MoE layer (views of their rows, stacked from 0), which the layers outside
    `layers` then hold alone (a node of a cluster spread by experts)."""
    mapped = Mapped()
    layers_wanted = range(cfg.num_hidden_layers) if layers is None else layers
    needed = top_needed(cfg, layers_wanted)
    routed = ("experts_gate_up", "experts_down")

    def build(layer: int | None, part: str, key: str, shape: tuple[int, ...]):
        name = stored_name(layer, part, key)
        f = format_for(qc, part, key, shape)
        rows = slice(experts.start, experts.stop) if experts is not None and key in routed else slice(None)
        if f is not None:
            return f(mapped.array(tensors[name + ".qweight"])[rows], mapped.array(tensors[name + ".scales"])[rows])
        return as_stored_weight(part, key, mapped.array(tensors[name + ".weight"])[rows])

    top = {key: build(None, part, key, shape) for (part, key), shape in top_shapes(cfg).items() if key in needed}
    layers = []
    for i in range(cfg.num_hidden_layers):
        own = i in layers_wanted
        if not own and not (experts is not None and len(experts) and cfg.is_moe_layer(i)):
            layers.append(None)
            continue
        parts = {"attn": new_part("attn", cfg.is_moe_layer(i)), "mlp": new_part("mlp", cfg.is_moe_layer(i)), "": {}}
        for (part, key), shape in layer_shapes(cfg, i).items():
            if key in routed and experts is not None and not len(experts) or not own and key not in routed:
                continue
            parts[part][key] = build(i, part, key, shape)
        layers.append(Layer(parts[""].get("input_layernorm"), parts["attn"], parts[""].get("post_attention_layernorm"),
                            parts["mlp"]))
        if progress:
            progress(i + 1, cfg.num_hidden_layers)
    return {"embed_tokens": top.get("embed_tokens"), "norm": top.get("norm"),
            "lm_head": top.get("lm_head", top.get("embed_tokens") if "lm_head" in needed else None), "layers": layers}


def top_needed(cfg: DeepseekV2Config, layers: range) -> set[str]:
    """The top weights a range of decoder layers computes with: the embedding before layer 0,
    the final norm and the head after the last (a tied head is the embedding)."""
    needed = set()
    if not len(layers):
        return needed
    if layers.start == 0:
        needed.add("embed_tokens")
    if layers.stop == cfg.num_hidden_layers:
        needed |= {"norm", "lm_head"} | ({"embed_tokens"} if cfg.tie_word_embeddings else set())
    return needed


HEAD_STACKS = (("attn", "w_uk"), ("attn", "w_uv"))    # multiplied head by head (linear.Heads)


def as_stored_weight(part: str, key: str, array):
    """A prepared layer's float array as the model multiplies by it: a projection's as a
    formats.Dense, w_uk's and w_uv's as a linear.Heads, a norm's or the gate's as it is."""
    if isinstance(array, (Dense, Heads, QuantMatrix)):
        return array
    if (part, key) in ROLE_OF:
        return Dense(array)
    return Heads(array) if (part, key) in HEAD_STACKS else array


# ---- quantizing prepared float weights ----

def quantize_weight(w, f: quant.Format | None, hessian: np.ndarray | None = None):
    """A prepared float weight (Dense or array) in format f, or as it is when f is None; with
    `hessian`, the second moments of its inputs over a calibration text (calibration.py)."""
    if f is None or isinstance(w, QuantMatrix):   # already quantized as it was read (ExpertStack)
        return w
    w = w.w if isinstance(w, Dense) else w
    if hessian is None or f.bits == 16 or f.block is not None:
        # bf16 rounds each value alone, nothing to compensate; q8b is a GGUF's own Q8_0 blocks
        return scales.quantize_matrix(w, f)
    return f(*calibration.quantize_calibrated(w, f, hessian))


class ExpertStack:
    """A stacked expert weight (E, out, in) in format f, filled from float tensors an expert's
    rows at a time (`stack[e, rows] = array`, as loader.mlp_slots fills a float32 stack) and
    quantized as soon as EXPERT_BATCH experts are complete, so the layer's float32 stack (2.2 GB
    for a V2-Lite MoE layer) never exists: only the experts read but not yet quantized do."""

    def __init__(self, shape: tuple[int, int, int], f: quant.Format, batch: int | None = None):
        self.shape, self.f = shape, f
        self.batch = batch or EXPERT_BATCH            # experts quantized together
        self.qweight = np.empty(f.qweight_shape(shape), f.qweight_dtype)
        self.scales = np.empty(f.scales_shape(shape), f.scale_dtype)
        self.pending: dict[int, list] = {}        # expert -> [float32 (out, in), rows filled]
        self.complete: list[int] = []
        self.done = np.zeros(shape[0], bool)

    def __setitem__(self, index: tuple, array: np.ndarray) -> None:
        e, rows = index[0], index[1] if len(index) > 1 else slice(None)
        slot = self.pending.setdefault(e, [np.empty(self.shape[1:], np.float32), 0])
        slot[0][rows] = array                       # converts to float32 in place
        slot[1] += slot[0][rows].shape[0]
        if slot[1] == self.shape[1]:
            self.complete.append(e)
            if len(self.complete) >= self.batch:
                self.flush()

    def flush(self) -> None:
        """Quantize the complete experts together (scales.quantize shares a stack over the cores)."""
        if not self.complete:
            return
        es, self.complete = self.complete, []
        block = np.stack([self.pending.pop(e)[0] for e in es])                 # (k, out, in)
        self.qweight[es], self.scales[es] = scales.quantize(block, self.f)
        self.done[es] = True

    def finish(self) -> QuantMatrix:
        self.flush()
        if not self.done.all() or self.pending:
            missing = sorted({int(e) for e in np.flatnonzero(~self.done)} | set(self.pending))
            raise QuantError(f"experts {missing[:8]} of a {list(self.shape)} stack were not read whole")
        return self.f(self.qweight, self.scales)


EXPERT_BATCH = 4     # experts quantized at once: two a core, 4 x 23 MB of float32 on V2-Lite


def quantize_layer(layer: Layer, qc: QuantConfig, stats: dict | None = None) -> Layer:
    """Replace a prepared float layer's matrices by their low-bit forms, one at a time (so at most
    one matrix exists in both forms at once); `stats` {(part, key): (H, tokens)} from a
    calibration run."""
    for part, weights in layer.parts():
        for key, w in list(weights.items()):
            if (part, key) in ROLE_OF:
                h = stats[part, key][0] if stats and (part, key) in stats else None
                weights[key] = quantize_weight(w, format_for(qc, part, key, w.shape), h)
            elif qc.float_dtype(part, key) == "BF16":
                a = w.w if isinstance(w, Heads) else w
                weights[key] = as_stored_weight(part, key, a.astype(quant.bfloat16_dtype()))   # rounded to nearest even
    return layer


def layer_arrays(layer: Layer | dict, i: int | None) -> Iterator[tuple[str, np.ndarray]]:
    """The stored tensors of a prepared layer (i None: the top-level dict of embed/norm/lm_head)."""
    if isinstance(layer, Layer):
        items = [("", "input_layernorm", layer.input_layernorm),
                 ("", "post_attention_layernorm", layer.post_attention_layernorm)]
        items += [(part, k, v) for part, weights in layer.parts() for k, v in weights.items()]
    else:
        items = [("", k, v) for k, v in layer.items()]
    for part, key, w in items:
        name = stored_name(i, part, key)
        if isinstance(w, QuantMatrix):
            yield name + ".qweight", w.qweight
            yield name + ".scales", w.scales
        else:
            w = w.w if isinstance(w, (Dense, Heads)) else w
            yield name + ".weight", np.ascontiguousarray(w if w.dtype.name == "bfloat16" else w.astype(np.float32, copy=False))


# ---- writing ----

# by NumPy's dtype name, so no bfloat16 dtype (ml_dtypes) is needed to build it
SAFETENSORS_DTYPES = {"float32": "F32", "int8": "I8", "uint8": "U8", "bfloat16": "BF16"}


def write_safetensors(path: Path, arrays: list[tuple[str, np.ndarray]]) -> int:
    """Write one safetensors file; return its size. The header is padded so the data starts
    64-byte aligned, and tensors go largest first: nearly every size is a multiple of 64 bytes, so
    the big ones all start aligned (the format allows no gaps between tensors)."""
    arrays = sorted(arrays, key=lambda a: (-a[1].nbytes, a[0]))
    header, offset = {}, 0
    for name, a in arrays:
        header[name] = {"dtype": SAFETENSORS_DTYPES[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)        # data starts on a 64-byte boundary
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, a in arrays:
            f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


class Mapped:
    """Tensors as read-only views of memory-mapped files: nothing is copied or converted, and a
    page is read from disk (or the page cache) only when the engine first touches it. The maps
    stay open as long as any view of them lives (each array holds its map)."""

    def __init__(self):
        self.maps: dict[Path, mmap.mmap] = {}

    def array(self, info: checkpoint.TensorInfo) -> np.ndarray:
        if info.dtype not in checkpoint.MAPPED_DTYPES:
            raise CheckpointError(f"tensor {info.name} has dtype {info.dtype}, which ds2 cannot map")
        if info.file not in self.maps:
            try:
                with open(info.file, "rb") as f:
                    self.maps[info.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"cannot map {info.file}: {getattr(e, 'strerror', None) or e}") from None
        dtype = checkpoint.numpy_dtype(info.dtype)
        return np.frombuffer(self.maps[info.file], dtype=dtype, count=info.numel,
                             offset=info.offset).reshape(info.shape)
