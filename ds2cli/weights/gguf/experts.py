"""A GGUF's routed experts as `--memory-budget` reads them (weights/streaming.py's ExpertCache).

A MoE layer's experts are stacked tensors, blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps
(E, out, in), and expert e of each is one contiguous byte range: a miss reads gate and up (one
read each, side by side in a staging buffer) and down, the whole expert, then puts the bytes
into the slot's format. Only a type that some ds2 format holds unchanged can stream, or every
miss would pay a conversion: Q8_0, whose blocks (an f16 scale and 32 int8 values of one row)
are q8b's own, the format a Q8_0 file loads into anyway, so the streamed run multiplies by the
same integers and scales as the run with every expert in memory. Every other type is
dequantized at load and put into a ds2 format; `unstreamable` names them, for one error before
loading (gguf/checkpoint.py's GGUFModel.stream_problem).
"""

from __future__ import annotations

import numpy as np

from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights.formats.base import QuantMatrix
from ds2cli.weights.gguf.file import GGUFFile
from ds2cli.weights.expert_cache import Buffers

STREAMABLE = {"Q8_0": "q8b"}            # a GGUF type -> the ds2 format holding its blocks unchanged
STACKED = {"experts_gate_up": ("ffn_gate_exps", "ffn_up_exps"), "experts_down": ("ffn_down_exps",)}
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", 32)])         # 34 bytes: GGUF's block_q8_0


def moe_layers(cfg: DeepseekV2Config) -> list[int]:
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]


def unstreamable(gf: GGUFFile, cfg: DeepseekV2Config) -> dict[str, str]:
    """{GGUF type: the first stacked expert tensor stored in it} for every type no ds2 format
    holds unchanged (empty: the experts can stream)."""
    out: dict[str, str] = {}
    for i in moe_layers(cfg):
        for names in STACKED.values():
            for g in names:
                name = f"blk.{i}.{g}.weight"
                if name not in gf.tensors:
                    continue                     # missing: GGUFModel.check names it
                kind = gf.type_name(name)
                if kind not in STREAMABLE:
                    out.setdefault(kind, name)
    return out


class GGUFExperts:
    """Where each MoE layer's experts lie in a GGUF file whose stacked expert tensors are all
    Q8_0 (unstreamable() empty) and how a read fills a q8b slot. The model's other weights were
    converted into memory of the process's own at load (streamed_weights copies those left as
    views of the file, its float norms)."""

    def __init__(self, gf: GGUFFile, cfg: DeepseekV2Config, formats: dict[str, type[QuantMatrix]]):
        E, D, inter, layers = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, moe_layers(cfg)
        self.formats = formats if layers else {}
        self.shapes = {"experts_gate_up": (2 * inter, D), "experts_down": (D, inter)}
        self.where: dict[tuple[int, str], list[tuple]] = {}     # (layer, kind) -> [(path, offset, bytes)]
        for i in layers:
            for kind, names in STACKED.items():
                tensors = [gf.tensors[f"blk.{i}.{g}.weight"] for g in names]
                self.where[i, kind] = [(gf.part_of[t.name], int(t.data_offset), int(t.n_bytes) // E)
                                       for t in tensors]
        self.paths = set(gf.paths)
        self.read_bytes = sum(n for kind in STACKED for *_, n in self.where[layers[0], kind]) if layers else 0
        self.widest = max((sum(n for *_, n in spans) for spans in self.where.values()), default=0)
        self.staging = Buffers()            # one matrix's blocks, lent to each reading thread

    def read(self, layer: int, e: int, kind: str, qweight: np.ndarray, scales: np.ndarray, pread,
             check: bool = True) -> None:
        """Expert e of `layer`'s `kind` into a q8b slot: its Q8_0 rows (gate's, then up's, for
        gate_up), one read a stored tensor, then each block's 32 values and f16 scale into the
        slot's panels, q8b.to_panels' layout: qweight (P, in, R), scales (P, in/32, R)."""
        with self.staging.lend(self.widest) as staging:
            at = 0
            for path, offset, n in self.where[layer, kind]:
                pread(path, offset + e * n, staging[at:at + n], e, layer)
                at += n
            out, inp = self.shapes[kind]
            blocks = staging[:at].view(Q8_0_BLOCK).reshape(out, inp // 32)    # (out, in/32)
            panels, _, r = qweight.shape
            qweight[...] = blocks["qs"].reshape(panels, r, inp).transpose(0, 2, 1)     # (P, in, R)
            scales[...] = blocks["d"].reshape(panels, r, -1).transpose(0, 2, 1)        # (P, in/32, R), f16 -> f32
