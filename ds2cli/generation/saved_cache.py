"""A latent cache on disk with the tokens it holds, so that a conversation or a long prompt is read
once: `ds2 chat --session FILE` and `ds2 generate --prompt-cache FILE` (llama-cli's option).

The file: b"DS2CACHE", a little-endian uint32 n, n bytes of a JSON header, then the cache's
positions [0, length) of every layer, latent (L, length, C) then k_pe (L, length, R), float32.
The header says what the file is and what follows: ds2's format version, its kind (a chat
"session" or a "prompt cache": a command given the other kind refuses it and never writes over
it), the model's fingerprint (weights/fingerprint.py: config, headers, sizes and load form, never
the weights), the cache's dims, dtype and length, the tokens, the caller's `state` (chat's
messages) and a CRC-32 of the tokens and the arrays. Everything is checked before a byte goes
into a cache: a file truncated, edited, holding values that are not finite, a directory, a FIFO
or a device (opened without waiting for a writer) or unreadable is one Ds2Error, and the file is left as it was; one from another model or version
is a ForeignCacheError, which says what it held (a prompt cache is then rebuilt, a session's
conversation read again). The header is bounded by what the model's context can hold before it
is read. Writing goes through user_files.write_atomic: a full disk or an interrupt leaves the
previous file whole, a symlink's target is replaced, the mode kept."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from ds2cli.errors import Ds2Error
from ds2cli.json_files import JSON_ERRORS, json_error
from ds2cli.model.cache import LatentCache, common_prefix
from ds2cli.model.config import DeepseekV2Config
from ds2cli.model.transformer import Model
from ds2cli.user_files import open_regular, write_atomic
from ds2cli.weights.fingerprint import fingerprint

MAGIC = b"DS2CACHE"
VERSION = 2                   # 2: the header says its kind (1: a session had messages in its state)
SESSION, PROMPT_CACHE = "session", "prompt cache"
KIND_NAMES = {SESSION: "a chat session", PROMPT_CACHE: "a prompt cache"}
# What a header may hold, from the model's context: its tokens (at most 8 bytes each as JSON) and
# a conversation's messages (the text of at most as many tokens, at most 32 bytes each escaped),
# and a little for the rest. A V2's 163,840 positions allow 6.6 MB; ds2-tiny's a megabyte.
HEADER_FIXED = 1 << 20
HEADER_PER_TOKEN = 40


def header_limit(cfg: DeepseekV2Config) -> int:
    return HEADER_FIXED + HEADER_PER_TOKEN * cfg.max_position_embeddings


class SavedCacheError(Ds2Error):
    """A saved cache that cannot be used with this model, or cannot be written."""


class WrongKindError(SavedCacheError):
    """A session given where a prompt cache is wanted, or the other way round."""


class ForeignCacheError(SavedCacheError):
    """A saved cache of another model, another load form or another ds2 version: its cache is of no
    use here, but what it says (`state`, a session's messages) may be."""

    def __init__(self, message: str, state: dict):
        super().__init__(message)
        self.state = state


def model_identity(model: Model) -> str:
    qc = model.quantization
    return fingerprint(model.path, qc.to_json() if qc is not None else None)


def save(path: Path, model: Model, cache: LatentCache, tokens: list[int], state: dict | None = None,
         kind: str = PROMPT_CACHE, clean: bool = False) -> None:
    """Write the cache's first len(tokens) positions, the tokens and `state` to `path` as `kind`,
    atomically; with `clean` (the caller holds the file's user_files.Lock), temporaries a killed
    writer left are removed. Values that are not finite (a broken model or a bug) are never saved."""
    path, n = Path(path), len(tokens)
    if n > cache.length:
        raise SavedCacheError(f"cannot save {n} tokens from a cache holding {cache.length}")
    latent, k_pe = cache.prefix(n)                                                  # (L, n, C), (L, n, R)
    if not (np.isfinite(latent).all() and np.isfinite(k_pe).all()):
        raise SavedCacheError(f"not saving {path}: the cache holds values that are not finite")
    tokens = [int(t) for t in tokens]
    header = {"format": "ds2 saved cache", "version": VERSION, "kind": kind, "model": model_identity(model),
              "dtype": "float32", "layers": latent.shape[0], "kv_lora_rank": latent.shape[2],
              "qk_rope_head_dim": k_pe.shape[2], "length": n, "tokens": tokens, "state": state or {},
              "crc32": checksum(tokens, latent, k_pe)}
    head = json.dumps(header, ensure_ascii=False).encode("utf-8")

    def write(f) -> None:
        f.write(MAGIC + struct.pack("<I", len(head)) + head)
        f.write(latent.data)
        f.write(k_pe.data)
    try:
        write_atomic(path, write, clean=clean)
    except OSError as e:
        raise SavedCacheError(f"cannot write {path}: {e.strerror}; the previous file, if any, is unchanged") from None


def checksum(tokens: list[int], latent: np.ndarray, k_pe: np.ndarray) -> int:
    crc = zlib.crc32(np.asarray(tokens, np.int64).tobytes())
    return zlib.crc32(k_pe.data, zlib.crc32(latent.data, crc))


def load(path: Path, model: Model, capacity: int, match: list[int] | None = None,
         kind: str = PROMPT_CACHE) -> tuple[LatentCache, list[int], dict]:
    """A new cache of `capacity` positions holding the saved ones, with the saved tokens and state.
    With `match` (a new prompt), only the saved tokens it begins with are kept, at most all but
    its last (which must run to give logits): llama-cli's --prompt-cache."""
    cache = model.new_cache(capacity)
    tokens, state = load_into(path, model, cache, match, kind)
    return cache, tokens, state


def peek(path: Path, model: Model, follow: bool = True) -> list[int]:
    """The tokens a prompt cache holds, its header checked against `model`; the arrays unread.
    Only a regular file is read (unless `follow`, not through a symlink)."""
    path = Path(path)
    try:
        with open_regular(path, follow) as f:
            return check_header(path, read_header(f, path, model.config)[0], model, PROMPT_CACHE)["tokens"]
    except OSError as e:
        raise SavedCacheError(f"cannot read {path}: {e.strerror}") from None


def read_header(f, path: Path, cfg: DeepseekV2Config) -> tuple[dict, int, int]:
    """The header of the open file `f`, parsed; with where the arrays start and the file's size.
    Its length is bounded by the file and by what the model's context can hold before it is read."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
        raise SavedCacheError(f"{path} is not a ds2 session or prompt cache")
    n_head = struct.unpack("<I", head[len(MAGIC):])[0]
    if n_head > size - len(head):
        raise SavedCacheError(f"{path} is truncated or corrupt: its header claims {n_head} bytes")
    if n_head > header_limit(cfg):
        raise SavedCacheError(f"{path} has a header of {n_head} bytes, more than a cache of this model's "
                              f"{cfg.max_position_embeddings} positions can hold ({header_limit(cfg)})")
    try:
        h = json.loads(f.read(n_head).decode("utf-8"))
    except (UnicodeDecodeError, *JSON_ERRORS) as e:
        raise SavedCacheError(f"{path} has a corrupt header: {json_error(e)}") from None
    if not isinstance(h, dict) or h.get("format") != "ds2 saved cache":
        raise SavedCacheError(f"{path} is not a ds2 session or prompt cache")
    return h, len(head) + n_head, size


def kind_of(h: dict) -> str | None:
    """What a parsed header says it is (version 1 files: a session kept messages in its state)."""
    if h.get("version") == 1:
        state = h.get("state")
        return SESSION if isinstance(state, dict) and "messages" in state else PROMPT_CACHE
    return h.get("kind") if h.get("kind") in KIND_NAMES else None


def require_kind(path: Path, h: dict, kind: str) -> None:
    found = kind_of(h)
    if found != kind:
        what = KIND_NAMES.get(found, "a saved cache of an unknown kind")
        raise WrongKindError(f"{path} is {what}, not {KIND_NAMES[kind]}")


def check_kind(path: Path, cfg: DeepseekV2Config, kind: str) -> None:
    """Before anything loads: `path`, when it exists, is a saved cache of `kind`; anything else
    (the other kind, a transcript, any other file) is refused, so it is never written over."""
    try:
        with open(path, "rb") as f:
            h = read_header(f, path, cfg)[0]
    except FileNotFoundError:
        return
    except IsADirectoryError:
        raise SavedCacheError(f"{path} is a directory, not {KIND_NAMES[kind]}") from None
    except OSError as e:
        raise SavedCacheError(f"cannot read {path}: {e.strerror}") from None
    except SavedCacheError as e:
        raise SavedCacheError(f"{e}; refusing to use it as {KIND_NAMES[kind]} or to write over it") from None
    require_kind(path, h, kind)


def load_into(path: Path, model: Model, cache: LatentCache, match: list[int] | None = None,
              kind: str = PROMPT_CACHE) -> tuple[list[int], dict]:
    """`load`, into a cache the caller has (the server's pool hands out its own)."""
    tokens, state, latent, k_pe = read(path, model, match, kind)
    if len(tokens) > cache.capacity:
        raise SavedCacheError(f"{path} holds {len(tokens)} tokens, more than the context of {cache.capacity} "
                              f"tokens; a larger --ctx holds it")
    cache.set_prefix(latent, k_pe)
    return tokens, state


def read(path: Path, model: Model, match: list[int] | None = None, kind: str = PROMPT_CACHE,
         follow: bool = True) -> tuple[list[int], dict, np.ndarray, np.ndarray]:
    """The saved tokens (with `match`, those the prompt begins with, all but its last at most),
    the state and the positions' latent (L, n, C) and k_pe (L, n, R), every check passed. Only a
    regular file is read (unless `follow`, not through a symlink)."""
    path = Path(path)
    try:
        with open_regular(path, follow) as f:
            header, data_at, size = read_header(f, path, model.config)
            header = check_header(path, header, model, kind)
            n = header["length"]
            L, C, R = header["layers"], header["kv_lora_rank"], header["qk_rope_head_dim"]
            expected = data_at + 4 * L * n * (C + R)
            if size != expected:
                raise SavedCacheError(f"{path} is {'truncated' if size < expected else 'longer than its header says'}: "
                                      f"{size} bytes, {expected} expected")
            latent = np.fromfile(f, np.float32, L * n * C).reshape(L, n, C)
            k_pe = np.fromfile(f, np.float32, L * n * R).reshape(L, n, R)
    except IsADirectoryError:
        raise SavedCacheError(f"{path} is a directory, not {KIND_NAMES[kind]}") from None
    except OSError as e:
        raise SavedCacheError(f"cannot read {path}: {e.strerror}") from None
    if checksum(header["tokens"], latent, k_pe) != header["crc32"]:
        raise SavedCacheError(f"{path} was changed after ds2 wrote it (its checksum does not match)")
    if not (np.isfinite(latent).all() and np.isfinite(k_pe).all()):
        raise SavedCacheError(f"{path} holds values that are not finite: it was damaged, not written by "
                              f"a working ds2 (refused, and left as it is)")
    keep = n if match is None else min(common_prefix(header["tokens"], match), len(match) - 1)
    return header["tokens"][:keep], header["state"], latent[:, :keep], k_pe[:, :keep]


def check_header(path: Path, h: dict, model: Model, kind: str) -> dict:
    """The header, every field checked against this model before anything is allocated."""
    require_kind(path, h, kind)
    state = h.get("state") if isinstance(h.get("state"), dict) else {}
    if h.get("version") not in (1, VERSION):
        raise ForeignCacheError(f"{path} was written by another version of ds2 (format {h.get('version')!r}, "
                                f"this one reads {VERSION})", state)
    cfg = model.config
    if h.get("model") != model_identity(model):
        raise ForeignCacheError(f"{path} belongs to another model (or the same one loaded in another form): "
                                f"it was saved with another checkpoint, --quantize or ds2 quantize copy", state)
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
