"""A GGUF model as the loader takes it: config, tensors (validated), tokenizer, sampling defaults,
and the ds2 format its weights load into.

How a GGUF runs: each tensor is dequantized with gguf.quants at load and, one layer at a
time, put into ds2's own formats (the ones the engine, the few-token kernel and the helpers
already multiply by). A Q8_0 file loads as q8b, Q8_0's own blocks of 32: its integers and
scales come back bit for bit, so ds2 computes what the file holds (requantizing its blocks into
per-row q8 measured KL 1.15x-1.80x the file's own on the reference cases), and q8b's panel
kernel decodes about as fast as q8 (weights/formats/q8b.py). Q6_K / Q5_* files load as `--bits 8` (float32
for F32/F16/BF16 files, like a safetensors checkpoint), Q4_0 / Q4_1 / Q4_K as `--bits 4`.
`--quantize 8` loads a 4-bit file into 8 bits (near-lossless, about twice the memory), or a
Q8_0 file into ds2's own 8-bit recipe; `--quantize exact` names a Q8_0 file's default.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ds2cli.weights import qcheckpoint
from ds2cli.model.config import DeepseekV2Config
from ds2cli.errors import CheckpointError, ConfigError
from ds2cli.weights.formats.base import FORMATS
from ds2cli.weights.gguf import experts as gguf_experts
from ds2cli.weights.gguf.config import config_from_gguf
from ds2cli.weights.gguf.file import GGUFFile, find
from ds2cli.weights.gguf.tensors import GGUFTensors

# the ds2 bits a tensor type loads into by default (None: float32)
DEFAULT_BITS = {"F32": None, "F16": None, "BF16": None, "Q8_0": 8, "Q6_K": 8, "Q5_0": 8, "Q5_1": 8,
                "Q5_K": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4}
# general.sampling.* (written by convert_hf_to_gguf from generation_config.json) -> its keys
SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
            "general.sampling.top_k": "top_k"}


@dataclasses.dataclass
class GGUFModel:
    file: GGUFFile
    config: DeepseekV2Config
    tensors: GGUFTensors

    @property
    def bulk_type(self) -> str:
        """The type holding most of the decoder layers' matrix bytes (the experts', in a MoE
        model; the embedding of a small model would outweigh them otherwise)."""
        by_type: dict[str, int] = {}
        for name, t in self.file.tensors.items():
            if not name.startswith("blk.") or len(t.shape) < 2:
                continue
            by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
        return max(by_type, key=by_type.get) if by_type else "F32"    # no decoder matrix: nothing to quantize

    @property
    def default_bits(self) -> int | None:
        return DEFAULT_BITS.get(self.bulk_type)

    @property
    def default_recipe(self) -> qcheckpoint.QuantConfig | None:
        """The formats the file loads into without --quantize, when not default_bits' recipe: a
        Q8_0 file's own blocks."""
        return self.exact_recipe

    @property
    def exact_recipe(self) -> qcheckpoint.QuantConfig | None:
        """`--quantize exact`: every matrix q8b, a Q8_0 file's own blocks bit for bit (None: the
        file is not Q8_0, and no ds2 format holds its blocks exactly)."""
        if self.bulk_type != "Q8_0":
            return None
        return qcheckpoint.QuantConfig(8, dict.fromkeys(qcheckpoint.ROLES, "q8b"))

    @property
    def generation_config(self) -> dict:
        gen = {}
        for name, key in SAMPLING.items():
            value = self.file.fields.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{self.file.name}: GGUF metadata {name} should be a number, got {value!r}")
            gen[key] = round(value, 6)
        if "temperature" in gen:
            gen["do_sample"] = gen["temperature"] > 0
        return gen

    def stream_problem(self, qc: qcheckpoint.QuantConfig | None) -> str | None:
        """Why `--memory-budget` cannot stream this file's routed experts loaded into `qc`'s
        formats (None: it can): a type no ds2 format holds unchanged, which every read would
        have to convert (gguf/experts.py), or formats other than the one that holds Q8_0."""
        found = gguf_experts.unstreamable(self.file, self.config)
        if found:
            types = ", ".join(f"{kind} ({name})" for kind, name in found.items())
            bits = 4 if any(DEFAULT_BITS.get(kind) == 4 for kind in found) else 8    # as the file loads
            return (f"--memory-budget reads a GGUF's routed experts as stored, which ds2 multiplies unchanged only "
                    f"as {', '.join(gguf_experts.STREAMABLE)}; {self.file.name} stores them as {types}, which ds2 "
                    f"converts at load: convert the file once with ds2 quantize {self.file.paths[0]} OUT "
                    f"--bits {bits}, then stream OUT")
        wanted = {kind: FORMATS[gguf_experts.STREAMABLE[self.bulk_type]]
                  for kind in gguf_experts.STACKED} if self.bulk_type in gguf_experts.STREAMABLE else {}
        got = {kind: qc.format_of("mlp", kind) if qc else None for kind in gguf_experts.STACKED}
        if not wanted or got != wanted:
            return (f"--memory-budget streams a {'/'.join(gguf_experts.STREAMABLE)} GGUF's experts in their own "
                    f"blocks, as the file loads by default (or with --quantize exact); another --quantize would "
                    f"convert each expert as it is read: leave --quantize out")
        return None

    def streamed_experts(self, qc: qcheckpoint.QuantConfig) -> "gguf_experts.GGUFExperts":
        """The routed experts as the expert cache reads them (stream_problem(qc) None)."""
        return gguf_experts.GGUFExperts(self.file, self.config,
                                        {kind: qc.format_of("mlp", kind) for kind in gguf_experts.STACKED})

    def check(self) -> None:
        """The tensors against the metadata: every problem named, or none."""
        found = self.tensors.problems(self.config)
        if found:
            shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
            raise CheckpointError(f"GGUF {self.file.name} does not match its metadata "
                                  f"({len(found)} problem{'s' * (len(found) > 1)}): {shown}")

    def tokenizer(self):
        from ds2cli.weights.gguf.tokenizer import tokenizer_from_gguf
        return tokenizer_from_gguf(self.file, self.config.vocab_size)

    def write_tokenizer_files(self, out: Path) -> None:
        """tokenizer.json, tokenizer_config.json and generation_config.json for `ds2 quantize`'s
        output directory, so that it loads like any Hugging Face checkpoint."""
        from ds2cli.weights.gguf.tokenizer import backend_from_gguf
        tok = self.tokenizer()
        backend_from_gguf(self.file).save(str(out / "tokenizer.json"))
        config = {"bos_token": tok.bos_token, "eos_token": tok.eos_token,
                  "add_bos_token": self.file.fields.get("tokenizer.ggml.add_bos_token") is True,
                  "chat_template": tok.chat_template}
        (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n",
                                                   encoding="utf-8")
        if self.generation_config:
            (out / "generation_config.json").write_text(json.dumps(self.generation_config, indent=2) + "\n")


def config_json(cfg: DeepseekV2Config) -> dict:
    """The config.json a GGUF's metadata stands for (DeepseekV2Config.from_dict reads it back)."""
    d = {k: v for k, v in dataclasses.asdict(cfg).items() if v is not None or k in ("q_lora_rank", "rope_scaling")}
    return {"architectures": ["DeepseekV3ForCausalLM" if cfg.is_v3 else "DeepseekV2ForCausalLM"], **d}


def open_model(path: str | Path, validate: bool = True) -> GGUFModel | None:
    """The GGUF at `path` (a file, a directory holding one, any part of a split file), read and,
    with `validate`, checked; None when `path` is not a GGUF. A command opens its model once
    (weights/source.py) and loads from that."""
    parts = find(path)
    if parts is None:
        return None
    gf = GGUFFile(list(parts))
    cfg = config_from_gguf(gf)
    model = GGUFModel(gf, cfg, GGUFTensors(gf, cfg))
    if validate:
        model.check()
    return model
