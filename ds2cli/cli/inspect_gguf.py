"""What `ds2 inspect FILE.gguf` reports: the file, its tensor types, the model its metadata
describes, the memory each ds2 form needs, and every problem found (as data; inspect_tables.py renders).

Only the header is read (gguf memory-maps the file), so it is instant on a 16 GB file. A file
that is not a readable GGUF at all (wrong magic, truncated, a part missing) raises; anything
after that (metadata ds2 cannot map, tensors that disagree with it, types ds2 cannot read, a
tokenizer that does not build) is a string in `problems`.
"""

from __future__ import annotations

from pathlib import Path

from ds2cli.cli import inspect_report as describe
from ds2cli.weights import memory
from ds2cli.weights import qcheckpoint
from ds2cli.errors import Ds2Error
from ds2cli.weights.gguf.config import config_from_gguf
from ds2cli.weights.gguf.file import GGUFFile, find
from ds2cli.weights.gguf.checkpoint import DEFAULT_BITS, GGUFModel
from ds2cli.weights.gguf.tensors import GGUFTensors


def tensor_types(gf: GGUFFile) -> dict:
    out: dict[str, dict] = {}
    for t in gf.tensors.values():
        d = out.setdefault(t.tensor_type.name, {"tensors": 0, "params": 0, "bytes": 0})
        d["tensors"] += 1
        d["params"] += int(t.n_elements)
        d["bytes"] += int(t.n_bytes)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


def describe_gguf(path: str | Path, budget: int | None = None) -> dict:
    gf = GGUFFile(find(path))
    f = gf.fields
    report = {"format": "gguf", "path": str(path), "files": [p.name for p in gf.paths], "file_bytes": gf.nbytes,
              "architecture": f.get("general.architecture"), "name": f.get("general.name"),
              "n_tensors": len(gf.tensors), "tensor_types": tensor_types(gf),
              "tokenizer": {"model": f.get("tokenizer.ggml.model"), "pre": f.get("tokenizer.ggml.pre"),
                            "tokens": len(f.get("tokenizer.ggml.tokens") or []),
                            "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
                            "eos_token_id": f.get("tokenizer.ggml.eos_token_id"),
                            "add_bos_token": f.get("tokenizer.ggml.add_bos_token"),
                            "chat_template": "tokenizer.chat_template" in f},
              "warnings": [], "problems": []}
    try:
        cfg = config_from_gguf(gf)
    except Ds2Error as e:
        report["problems"] = [str(e)] + gf.unsupported()
        return report
    tensors = GGUFTensors(gf, cfg)
    model = GGUFModel(gf, cfg, tensors)
    report["problems"] = tensors.problems(cfg)
    try:
        model.tokenizer()
    except Ds2Error as e:
        report["problems"].append(str(e))
    bits = DEFAULT_BITS.get(model.bulk_type)
    report.update(model=describe.model_section(cfg), mla=describe.mla_section(cfg), moe=describe.moe_section(cfg),
                  bulk_type=model.bulk_type,
                  loads_as="q8b (the file's own blocks)" if model.default_recipe else f"{bits}-bit" if bits else "float32",
                  memory=memory_section(cfg, bits, model.default_recipe))
    streams = model.stream_problem(model.default_recipe) is None           # a Q8_0 file, as it loads
    report["memory"]["streaming"] = describe.streaming_section(cfg, model.default_recipe, streams,
                                                               str(gf.paths[0]), budget)
    return report


def memory_section(cfg, default_bits: int | None, default_recipe=None) -> dict:
    """A checkpoint's memory section (inspect_report.memory_section: float32 weights, caches, and
    `formats`), its formats those the GGUF loads in."""
    params = describe.params_section(cfg, describe.expected_tensors(cfg))["total"]
    return {**describe.memory_section(cfg, params), "formats": memory_forms(cfg, default_bits, default_recipe)}


def memory_forms(cfg, default_bits: int | None, default_recipe=None, available: int | None = None) -> list[dict]:
    """The weights and RAM (weights + cache at the default context + margin) of each form a GGUF
    loads in, the default first (`default_recipe`: a Q8_0 file's own blocks, q8b), and whether
    it fits the memory available now, as memory.fits says a checkpoint's forms; with the option
    that loads it."""
    available = memory.available_bytes() if available is None else available
    forms = [(default_bits, default_recipe)] + [(b, None) for b in (8, 4, None)
                                                if default_recipe is not None or b != default_bits]
    out = []
    for i, (bits, recipe) in enumerate(forms):
        qc = recipe or (qcheckpoint.QuantConfig.recipe(bits) if bits else None)
        need = memory.required(cfg, qc, None, quantize_at_load=bits is not None)
        out.append({"format": memory.label(qc) + (" (q8b, the file's blocks)" if recipe is not None else ""),
                    "weight_bytes": need["weights"], "ram_bytes": need["total"], "context": need["context"],
                    "available_bytes": available,
                    "fits": None if available is None else need["total"] <= available,
                    "default": i == 0,
                    "option": "--quantize exact" if recipe is not None else
                    "--quantize auto" if bits is None else f"--quantize {bits}"})
    return out
