"""A latent cache on disk with the tokens it holds, so that a conversation or a long prompt is read
once: `ds2 chat --session FILE` and `ds2 generate --prompt-cache FILE` (llama-cli's option).

The file: b"DS2CACHE", a little-endian uint32 n, n bytes of a JSON header, then the cache's
positions [0, length) of every layer, latent (L, length, C) then k_pe (L, length, R), float32.
The header says what it belongs to and what follows: ds2's format version, the model's
fingerprint (weights/fingerprint.py: config, headers, sizes and load form, never the weights), the
cache's dims, dtype and length, the tokens, the caller's `state` (chat's messages) and a CRC-32 of
the tokens and the arrays. Everything is checked before a byte goes into a cache: a file from
another model or version, truncated, edited, a directory or unreadable is one Ds2Error, and the
file is left as it was. Writing goes to a temporary file beside it, then a rename: a full disk or
an interrupt leaves the previous file whole."""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np

from ds2cli.errors import Ds2Error
from ds2cli.json_files import JSON_ERRORS, json_error
from ds2cli.model.cache import LatentCache, common_prefix
from ds2cli.model.transformer import Model
from ds2cli.weights.fingerprint import fingerprint

MAGIC = b"DS2CACHE"
VERSION = 1
HEADER_LIMIT = 256 << 20      # tokens and a conversation's messages; far beyond any real one


class SavedCacheError(Ds2Error):
    """A saved cache that cannot be used with this model, or cannot be written."""


def model_identity(model: Model) -> str:
    qc = model.quantization
    return fingerprint(model.path, qc.to_json() if qc is not None else None)


def save(path: Path, model: Model, cache: LatentCache, tokens: list[int], state: dict | None = None) -> None:
    """Write the cache's first len(tokens) positions, the tokens and `state` to `path`, atomically."""
    path, n = Path(path), len(tokens)
    if n > cache.length:
        raise SavedCacheError(f"cannot save {n} tokens from a cache holding {cache.length}")
    latent = np.ascontiguousarray(cache.latent[:, :n], np.float32)                  # (L, n, C)
    k_pe = np.ascontiguousarray(cache.k_pe[:, :n], np.float32)                      # (L, n, R)
    tokens = [int(t) for t in tokens]
    header = {"format": "ds2 saved cache", "version": VERSION, "model": model_identity(model),
              "dtype": "float32", "layers": latent.shape[0], "kv_lora_rank": latent.shape[2],
              "qk_rope_head_dim": k_pe.shape[2], "length": n, "tokens": tokens, "state": state or {},
              "crc32": checksum(tokens, latent, k_pe)}
    head = json.dumps(header, ensure_ascii=False).encode("utf-8")
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise SavedCacheError(f"cannot write {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(head)) + head)
            f.write(latent.data)
            f.write(k_pe.data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise SavedCacheError(f"cannot write {path}: {e.strerror}; the previous file, if any, is unchanged") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def checksum(tokens: list[int], latent: np.ndarray, k_pe: np.ndarray) -> int:
    crc = zlib.crc32(np.asarray(tokens, np.int64).tobytes())
    return zlib.crc32(k_pe.data, zlib.crc32(latent.data, crc))


def load(path: Path, model: Model, capacity: int, match: list[int] | None = None) -> tuple[LatentCache, list[int], dict]:
    """A new cache of `capacity` positions holding the saved ones, with the saved tokens and state.
    With `match` (a new prompt), only the saved tokens it begins with are kept, at most all but
    its last (which must run to give logits): llama-cli's --prompt-cache."""
    cache = model.new_cache(capacity)
    tokens, state = load_into(path, model, cache, match)
    return cache, tokens, state


def peek(path: Path, model: Model) -> list[int]:
    """The tokens a saved cache holds, its header checked against `model`; the arrays unread."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return read_header(f, path, model)[0]["tokens"]
    except OSError as e:
        raise SavedCacheError(f"cannot read {path}: {e.strerror}") from None


def read_header(f, path: Path, model: Model) -> tuple[dict, int, int]:
    """The header of the open file `f`, checked against `model`; with where the arrays start and
    the file's size. Its length is bounded by the file and HEADER_LIMIT before it is read."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
        raise SavedCacheError(f"{path} is not a ds2 saved cache")
    n_head = struct.unpack("<I", head[len(MAGIC):])[0]
    if n_head > min(HEADER_LIMIT, size - len(head)):
        raise SavedCacheError(f"{path} is truncated or corrupt: its header claims {n_head} bytes")
    return parse_header(path, f.read(n_head), model), len(head) + n_head, size


def load_into(path: Path, model: Model, cache: LatentCache, match: list[int] | None = None) -> tuple[list[int], dict]:
    """`load`, into a cache the caller has (the server's pool hands out its own)."""
    capacity = cache.capacity
    path = Path(path)
    try:
        with open(path, "rb") as f:
            header, data_at, size = read_header(f, path, model)
            n = header["length"]
            L, C, R = header["layers"], header["kv_lora_rank"], header["qk_rope_head_dim"]
            expected = data_at + 4 * L * n * (C + R)
            if size != expected:
                raise SavedCacheError(f"{path} is {'truncated' if size < expected else 'longer than its header says'}: "
                                      f"{size} bytes, {expected} expected")
            latent = np.fromfile(f, np.float32, L * n * C).reshape(L, n, C)
            k_pe = np.fromfile(f, np.float32, L * n * R).reshape(L, n, R)
    except IsADirectoryError:
        raise SavedCacheError(f"{path} is a directory, not a saved cache") from None
    except OSError as e:
        raise SavedCacheError(f"cannot read {path}: {e.strerror}") from None
    if checksum(header["tokens"], latent, k_pe) != header["crc32"]:
        raise SavedCacheError(f"{path} was changed after ds2 wrote it (its checksum does not match)")
    keep = n if match is None else min(common_prefix(header["tokens"], match), len(match) - 1)
    if keep > capacity:
        raise SavedCacheError(f"{path} holds {keep} tokens, more than the context of {capacity} tokens; "
                              f"a larger --ctx holds it")
    cache.latent[:, :keep], cache.k_pe[:, :keep] = latent[:, :keep], k_pe[:, :keep]
    cache.length = keep
    return header["tokens"][:keep], header["state"]


def parse_header(path: Path, raw: bytes, model: Model) -> dict:
    """The header, every field checked against this model before anything is allocated."""
    try:
        h = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, *JSON_ERRORS) as e:
        raise SavedCacheError(f"{path} has a corrupt header: {json_error(e)}") from None
    if not isinstance(h, dict) or h.get("format") != "ds2 saved cache":
        raise SavedCacheError(f"{path} is not a ds2 saved cache")
    if h.get("version") != VERSION:
        raise SavedCacheError(f"{path} was written by another version of ds2 (format {h.get('version')!r}, "
                              f"this one reads {VERSION})")
    cfg = model.config
    if h.get("model") != model_identity(model):
        raise SavedCacheError(f"{path} belongs to another model (or the same one loaded in another form): "
                              f"it was saved with another checkpoint, --quantize or ds2 quantize copy")
    dims = {"layers": cfg.num_hidden_layers, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_rope_head_dim": cfg.qk_rope_head_dim}
    for key, want in dims.items():
        if h.get(key) != want or type(h.get(key)) is not int:
            raise SavedCacheError(f"{path}: {key} is {h.get(key)!r}, the model has {want}")
    n, tokens = h.get("length"), h.get("tokens")
    if h.get("dtype") != "float32" or type(n) is not int or n < 0 or not isinstance(tokens, list) \
            or len(tokens) != n or not isinstance(h.get("state"), dict) or type(h.get("crc32")) is not int:
        raise SavedCacheError(f"{path} has a corrupt header")
    if n > cfg.max_position_embeddings or \
            not all(type(t) is int and 0 <= t < cfg.vocab_size for t in tokens):
        raise SavedCacheError(f"{path} holds tokens this model does not have")
    return h
