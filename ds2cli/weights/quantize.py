"""`ds2 quantize`: a float checkpoint -> a ds2 low-bit checkpoint (layout in qcheckpoint.py).

It streams: one decoder layer is read (memory-mapped), prepared, quantized and written before
the next is touched, so the peak is one float32 layer (2.3 GB for a V2-Lite MoE layer) plus the
output buffers of that layer, whatever the model's size. Everything is written into a hidden
directory beside DST (files.building) that becomes DST by one rename once config.json, written
last, is in place: an interrupted or failed run leaves nothing that looks like a checkpoint, and
removes its partial directory itself when it can.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
from pathlib import Path
from typing import Callable

from ds2cli.weights import calibration
from ds2cli.weights import checkpoint
from ds2cli.weights import checksums
from ds2cli.weights import staging as files
from ds2cli.weights.gguf import checkpoint as gguf_model
from ds2cli.weights import memory
from ds2cli.weights import qcheckpoint
from ds2cli.json_files import read_json_object
from ds2cli.model.config import DeepseekV2Config
from ds2cli.errors import ConfigError, Ds2Error
from ds2cli.weights.loader import load_layer, load_top, names_by_layer
from ds2cli.weights.source import check_model_dir, read_quant_config
from ds2cli.text.tokenizer import Tokenizer
from ds2cli.wording import human_bytes
from ds2cli import __version__

# Weight files of other frameworks are never copied; everything else at the top level of the
# source (tokenizer, generation config, license, README, remote code) is.
SKIPPED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
DISK_MARGIN = 64 << 20
# A copy's README says what the copy is; its source's (which may say "stored in bfloat16") is kept
# beside it under another name, and its YAML front matter (license, tags) carried over.
README, SOURCE_README = "README.md", "README.source.md"
FRONT_MATTER_LIMIT = 64 << 10
FORMAT_WORDS = {"q8": "int8, a float32 scale a row", "q8b": "int8, a scale a block of 32 inputs",
                "q4": "4-bit, a bfloat16 scale a group of 32", "bf16": "bfloat16", "f32": "float32"}


def copy_readme(src: Path, qc: qcheckpoint.QuantConfig, total: int, card: Path | None, gguf: bool) -> str:
    """The copy's README.md: its format, role by role, and where it came from; the front matter
    of the source's card (`card`), if it opens with one within FRONT_MATTER_LIMIT bytes."""
    front = ""
    if card is not None:
        with open(card, "rb") as f:
            text = f.read(FRONT_MATTER_LIMIT).decode("utf-8", errors="replace")
        if text.startswith("---\n") and "\n---\n" in text[4:]:
            front = text[:text.index("\n---\n", 4) + 5]
    roles = "".join(f"- {role}: {FORMAT_WORDS.get(name, name)}\n" for role, name in qc.formats.items())
    kept = (f"- w_uk, w_uv and the router gate: {FORMAT_WORDS.get(qc.unquantized, qc.unquantized)}; "
            f"the norms float32\n")
    origin = (f"Its source's README, which describes the source (its storage included), is "
              f"{SOURCE_README} beside this file.\n" if card is not None else
              "Its tokenizer files were written from the GGUF file's metadata.\n" if gguf else
              "Its source had no README.\n")
    return (f"{front}# {src.name}, {qc.bits}-bit (ds2)\n\n"
            f"A ds2 low-bit copy of `{src.name}`, written by `ds2 quantize --bits {qc.bits}` (ds2 "
            f"{__version__}): {human_bytes(total)} of weights in ds2's own layout "
            f"(config.json's quantization_config), which only ds2 loads.\n\n"
            f"Formats, by role:\n\n{roles}{kept}\n{origin}")


class QuantizeError(Ds2Error):
    """The destination is unusable, or writing it failed."""


def check_destination(src: Path, dst: Path, force: bool) -> None:
    """Before anything is read: a destination that is a file, not empty, inside or around the
    source, or that the file system cannot name, is refused."""
    try:
        _check_destination(src, dst, force)
    except OSError as e:       # a name too long for the file system, a component that is a file ...
        raise QuantizeError(f"cannot use {dst} as the destination: {e.strerror or e}") from None


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise QuantizeError(f"{dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise QuantizeError(f"{dst} exists and is not empty; pass --force to replace it")
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise QuantizeError(f"the destination {dst} is inside the source checkpoint {src}")
    if dst.resolve() in src.resolve().parents:
        raise QuantizeError(f"the destination {dst} contains the source checkpoint {src}")


def shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def quantize_checkpoint(src: str | Path, dst: str | Path, bits: int, force: bool = False,
                        progress: Callable[[int, int], None] | None = None,
                        calibration_text: str | Path | None = None,
                        write_shard: Callable[[Path, list], int] | None = None) -> dict:
    """Write the `bits` recipe of checkpoint `src` into directory `dst`; return a summary. With
    `calibration_text` (a file, or calibration.BUILTIN), the scales are chosen from the float
    model's inputs on that text (calibration.py). `write_shard(path, arrays)` writes a shard and
    returns its bytes (default: qcheckpoint.write_safetensors)."""
    src, dst = check_model_dir(src), Path(dst).expanduser()
    qc = qcheckpoint.QuantConfig.recipe(bits)
    gguf = gguf_model.open_model(src)    # a GGUF: its metadata is the config, its tokenizer is written out
    raw = gguf_model.config_json(gguf.config) if gguf else read_json_object(src / "config.json", ConfigError)
    cfg = gguf.config if gguf else DeepseekV2Config.from_file(src / "config.json")
    if not gguf and read_quant_config(src) is not None:
        what = "calibrate from" if calibration_text is not None else "quantize"
        raise QuantizeError(f"{src} is already a ds2 low-bit checkpoint; {what} its float source instead")
    if gguf and calibration_text is not None:
        raise QuantizeError(f"{src} is a GGUF file, already quantized: calibrate from its float source instead")
    text = calibration.read_text(calibration_text) if calibration_text is not None else None
    check_destination(src, dst, force)
    tensors = gguf.tensors if gguf else checkpoint.validate(cfg, src)
    calib = None
    if text is not None:
        calib = calibration.Calibration(tensors, cfg, Tokenizer.load(src, vocab_size=cfg.vocab_size), *text)
        qc = dataclasses.replace(qc, calibration=calib.describe())
    size = memory.weight_bytes(cfg, qc)
    files.check_free_disk(files.existing_ancestor(dst.parent), size + DISK_MARGIN, f"the {bits}-bit checkpoint",
                          QuantizeError)
    try:
        with files.building(dst, replace=True) as partial:
            written = write_all(src, partial, raw, cfg, qc, tensors, progress, gguf, calib, write_shard)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise QuantizeError(f"no space left on the device writing {dst}; nothing was kept") from None
        raise QuantizeError(f"cannot write {dst}: {e.strerror or e}") from None
    # the names every command's --json uses for these (docs/cli.md, "JSON output")
    return {"path": str(dst.absolute()), "bits": bits, "weight_bytes": written, "formats": qc.formats,
            "float32_weight_bytes": memory.weight_bytes(cfg, None), "calibration": qc.calibration}


def write_all(src: Path, out: Path, raw: dict, cfg: DeepseekV2Config, qc, tensors: dict, progress,
              gguf: gguf_model.GGUFModel | None = None, calib: calibration.Calibration | None = None,
              write_shard: Callable[[Path, list], int] | None = None) -> int:
    n = cfg.num_hidden_layers + 1          # shards: one a layer, then the embeddings, norm and lm_head
    weight_map, sums, total = {}, {}, 0
    write_shard = write_shard or qcheckpoint.write_safetensors

    def write(k: int, arrays: list) -> None:
        nonlocal total
        name = shard_name(k, n)
        total += write_shard(out / name, arrays)
        weight_map.update((tensor, name) for tensor, _ in arrays)
        sums.update(checksums.of_arrays(arrays, qcheckpoint.is_expert_stack))   # the bytes as written

    for i, names in enumerate(names_by_layer(tensors, cfg.num_hidden_layers)):
        # calibration runs the float layer; without it the experts are quantized as they are read
        layer = load_layer(tensors, names, cfg, i, None if calib else qc)
        stats = calib.run_layer(layer) if calib else None
        layer = qcheckpoint.quantize_layer(layer, qc, stats)
        del stats
        write(i + 1, list(qcheckpoint.layer_arrays(layer, i)))
        del layer
        if progress:      # counts the model's layers; the last shard's work follows the last count
            progress(i + 1, cfg.num_hidden_layers)
    if calib:   # the head's inputs are the last layer's outputs, through the final norm
        top = load_top(tensors, cfg, None)
        stats = calib.head(top["norm"])
        for key in ("embed_tokens", "lm_head"):
            f = qcheckpoint.format_for(qc, "", key, top[key].shape)
            h = stats["", key][0] if ("", key) in stats else None
            top[key] = qcheckpoint.quantize_weight(top[key], f, h)
    else:
        top = load_top(tensors, cfg, qc)
    if cfg.tie_word_embeddings:
        del top["lm_head"]
    write(n, list(qcheckpoint.layer_arrays(top, None)))
    index = {"metadata": {"total_size": total, "format": "ds2"}, "weight_map": dict(sorted(weight_map.items())),
             "checksums": checksums.index_record(sums)}
    (out / checkpoint.INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    if gguf:
        gguf.write_tokenizer_files(out)
    for path in ([] if gguf else sorted(src.iterdir())):
        if (path.is_file() and path.name not in ("config.json", checkpoint.INDEX_NAME, README, SOURCE_README)
                and not path.name.endswith(SKIPPED_SUFFIXES) and not path.name.startswith(".")):
            shutil.copy2(path, out / path.name)
    card = None if gguf or not (src / README).is_file() else src / README
    if card is not None:
        shutil.copy2(card, out / SOURCE_README)            # the model card, as its authors wrote it
    (out / README).write_text(copy_readme(src, qc, total, card, bool(gguf)), encoding="utf-8")
    # config.json last: until it exists the directory is not a checkpoint
    config = {**raw, "quantization_config": qc.to_json()}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return total
