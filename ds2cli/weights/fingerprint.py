"""What a model is, for files that belong to it (a saved conversation, a prompt cache) and for a
cluster's nodes, which must hold the driver's checkpoint (cluster/ray_cluster.py): a digest of
its config and tokenizer files, its index (model.safetensors.index.json, whole: for a copy `ds2
quantize` wrote, the checksum of every tensor and routed expert, weights/checksums.py), every
weight file's name and size, the safetensors headers (or a GGUF's header region) and the form
its weights were loaded in. Never a hash of the weights themselves: a 16 GB checkpoint is
identified in milliseconds, and what the index records of them is compared instead."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from ds2cli.errors import Ds2Error

HEADER_LIMIT = 100 << 20     # a safetensors header larger than this is not read (checkpoint.py refuses it too)
GGUF_HEAD = 4 << 20          # a GGUF's metadata and tensor infos sit at its start


def fingerprint(path: Path | None, quantization: dict | None) -> str:
    """A hex digest of the model at `path` (a checkpoint directory or a GGUF file) as loaded
    with `quantization` (QuantConfig.to_json(), or None for float32)."""
    h = hashlib.sha256(b"ds2 model\0")
    if path is None:
        raise Ds2Error("this model has no path to identify it by; it cannot save or resume a cache")
    path = Path(path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".gguf", ".model"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if f.suffix == ".safetensors":
                head = fh.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                h.update(fh.read(min(n, HEADER_LIMIT, size)))
            elif f.suffix == ".gguf":
                h.update(fh.read(min(GGUF_HEAD, size)))
            else:        # config.json, tokenizer files, generation_config.json: small (read(n) allocates n)
                h.update(fh.read(min(HEADER_LIMIT, size)))
    h.update(json.dumps(quantization, sort_keys=True).encode())
    return h.hexdigest()
