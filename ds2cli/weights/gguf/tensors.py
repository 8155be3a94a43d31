"""GGUF tensor names -> the Hugging Face names ds2's loader reads, one float32 tensor at a time.

The layout is convert_hf_to_gguf.py's DeepseekV2Model (checked against its modify_tensors, and
proven by the reference-logit parity test):
  - gguf's reader lists dimensions outermost first (GGUF stores them innermost first), so a
    2-D tensor is (out, in) as in the safetensors file;
  - the RoPE rows of attn_q / attn_q_b / attn_kv_a_mqa are not permuted: llama.cpp runs
    deepseek2 with its "normal" (adjacent-pair) RoPE, which is the original's interleaved
    layout, so they reach loader.prepare_attention exactly as a safetensors file has them;
  - experts are stacked: ffn_{gate,up,down}_exps (E, out, in), expert e's slab is HF's
    mlp.experts.e.*; shared experts are ffn_*_shexp; the router is ffn_gate_inp, and V3's
    e_score_correction_bias is exp_probs_b.bias;
  - kv_b_proj is either attn_kv_b (older files) or split in two (files written since
    llama.cpp's MLA rework): attn_k_b (H, C, d), stored transposed, and attn_v_b (H, v, C);
    ds2 puts them back into kv_b_proj (H*(d+v), C) rows nope-then-v per head.
Nothing here builds a float32 copy of the model: a tensor (for stacked experts, one expert's
slab) is dequantized only when the loader asks for it, from the memory-mapped file.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from ds2cli.weights import checkpoint
from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights.gguf.file import GGUFFile, dequantize

TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj",
         "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
         "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
         "attn_kv_b": "self_attn.kv_b_proj", "attn_output": "self_attn.o_proj",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
         "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
         "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"}
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# tensors llama.cpp may store that ds2 recomputes or never runs
IGNORED = ("rope_freqs.weight",)


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a Hugging Face tensor comes from: one GGUF tensor, one expert's slab of a stacked
    one (`index`), or kv_b_proj from attn_k_b + attn_v_b (`names` both)."""
    names: tuple[str, ...]
    shape: tuple[int, ...]          # the Hugging Face shape it yields
    index: int | None = None

    @property
    def kind(self) -> str:
        return "kv_b" if len(self.names) == 2 else "expert" if self.index is not None else "plain"


def numpy_shape(t) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(t.shape.tolist()))


class GGUFTensors(dict):
    """{Hugging Face name: Source} for one GGUF file, plus what the mapping left over."""

    def __init__(self, gf: GGUFFile, cfg: DeepseekV2Config):
        super().__init__()
        self.gf, self.unmapped = gf, []
        for name, t in gf.tensors.items():
            if not self._map(name, t, cfg):
                self.unmapped.append(name)

    def _map(self, name: str, t, cfg: DeepseekV2Config) -> bool:
        if name in TOP:
            self[TOP[name]] = Source((name,), numpy_shape(t))
            return True
        if name in IGNORED:
            return True
        parts = name.split(".")
        if parts[0] != "blk" or len(parts) != 4 or not parts[1].isdigit():
            return False
        i, key, suffix = int(parts[1]), parts[2], parts[3]
        if i >= cfg.num_hidden_layers:
            return True                          # MTP (nextn) layers stored after the decoder
        prefix = f"model.layers.{i}."
        if key in LAYER and suffix == "weight":
            self[prefix + LAYER[key] + ".weight"] = Source((name,), numpy_shape(t))
            return True
        if key == "exp_probs_b" and suffix == "bias":
            self[prefix + "mlp.gate.e_score_correction_bias"] = Source((name,), numpy_shape(t))
            return True
        if key in EXPERTS and suffix == "weight":
            shape = numpy_shape(t)
            for e in range(shape[0]):
                self[f"{prefix}mlp.experts.{e}.{EXPERTS[key]}.weight"] = Source((name,), shape[1:], e)
            return True
        if key in ("attn_k_b", "attn_v_b") and suffix == "weight":
            if f"blk.{i}.attn_kv_b.weight" in self.gf.tensors:
                return True                      # both layouts stored: the combined one is read
            k_b, v_b = self.gf.tensors.get(f"blk.{i}.attn_k_b.weight"), self.gf.tensors.get(f"blk.{i}.attn_v_b.weight")
            if k_b is None or v_b is None:
                return False                     # one half alone: reported as unexpected
            (H, C, d), (_, v, _) = numpy_shape(k_b), numpy_shape(v_b)
            self[prefix + "self_attn.kv_b_proj.weight"] = Source((k_b.name, v_b.name), (H * (d + v), C))
            return True
        return False

    def gguf_name(self, hf_name: str) -> str:
        return " + ".join(self[hf_name].names) if hf_name in self else hf_name

    def problems(self, cfg: DeepseekV2Config) -> list[str]:
        """Every tensor missing, unexpected, of a shape the metadata does not imply, or of a type
        ds2 cannot read; named as the GGUF file names them."""
        want = checkpoint.expected_shapes(cfg)
        out = []
        for name, shape in want.items():
            if name not in self:
                stacked = f" x {cfg.n_routed_experts} experts" if ".mlp.experts." in name else ""
                out.append(f"missing tensor {gguf_name_of(name)} (the metadata implies "
                           f"{list(reversed(shape))}{stacked})")
            elif self[name].shape != shape:
                out.append(f"tensor {self.gguf_name(name)} has shape "
                           f"{list(reversed(self[name].shape))}, the metadata implies {list(reversed(shape))}"
                           + (" per expert" if self[name].kind == "expert" else ""))
        extra = [n for n in self if n not in want and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
        out += [f"unexpected tensor {self.gguf_name(n)}" for n in extra]
        out += [f"unexpected tensor {n}" for n in self.unmapped]
        out += self.gf.unsupported()
        return list(dict.fromkeys(out))     # a stacked tensor's problem once, not once per expert

    def iter_tensors(self, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
        """(Hugging Face name, float32 array) for `names`, one at a time."""
        for name in names:
            yield name, self.array(name)
            src = self[name]
            for n in src.names:                   # a stacked tensor an expert's slab at a time
                self.gf.release(n, src.index)

    def array(self, name: str) -> np.ndarray:
        src, tensors = self[name], self.gf.tensors
        if src.kind == "kv_b":
            k_b, v_b = dequantize(tensors[src.names[0]]), dequantize(tensors[src.names[1]])  # (H,C,d), (H,v,C)
            kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)                     # (H, d+v, C)
            return kv_b.reshape(-1, kv_b.shape[-1])                                          # (H*(d+v), C)
        return dequantize(tensors[src.names[0]], src.index)

    def type_of(self, name: str) -> str:
        """The GGUF type a Hugging Face tensor is stored in (kv_b_proj: attn_k_b's)."""
        return self.gf.type_name(self[name].names[0])


def gguf_name_of(hf_name: str) -> str:
    """A Hugging Face name as the converter would name it in GGUF (for 'missing' messages)."""
    for g, h in TOP.items():
        if h == hf_name:
            return g
    parts = hf_name.split(".")
    if parts[:2] != ["model", "layers"]:
        return hf_name
    i, rest = parts[2], ".".join(parts[3:]).removesuffix(".weight")
    for g, h in LAYER.items():
        if h == rest:
            return f"blk.{i}.{g}.weight"
    if rest.startswith("mlp.experts."):
        kind = rest.split(".")[-1]
        return f"blk.{i}.{next(g for g, h in EXPERTS.items() if h == kind)}.weight"
    if rest == "mlp.gate.e_score_correction_bias":
        return f"blk.{i}.exp_probs_b.bias"
    return hf_name
