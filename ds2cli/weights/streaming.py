"""Routed experts streamed from disk within a memory budget (`--memory-budget`).

A mixture of experts is mostly routed experts that a given token never touches. With a budget
smaller than the model, everything else (attention, shared experts, dense layers, embedding,
head, norms) stays resident, and the routed experts live in an ExpertCache: a fixed number of
*slots*, each holding one expert (its gate_up and down matrices), filled from the model's file
on a miss with one read a stored matrix, in whole experts, into buffers the cache owns. Where an
expert lies is its source's: StoredExperts for a ds2 low-bit checkpoint (here),
gguf/experts.GGUFExperts for a GGUF's stacked tensors (a Q8_0 expert's blocks become q8b's).
Reads bypass the page cache (O_DIRECT; where the file system refuses it, the pages read are
dropped after, posix_fadvise DONTNEED), so the budget holds for the process's memory and the
page cache it causes together. They happen outside the cache's lock: the computing thread takes
what is in the slots while readers read.

Each layer's expert stacks are StreamedStacks: `stack[e]` is the slot holding expert e, a weight
of the checkpoint's own format, so the math multiplies by it unchanged. How a layer's experts
are computed as their reads land, and read ahead, is execution's (execution/experts.py's
StreamedExperts). The slots are shared memory made before the helper processes fork, so they
multiply by what was read after."""
from __future__ import annotations

import mmap
import os

import numpy as np

from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights.expert_cache import KINDS, ExpertCache, StreamedStack
from ds2cli.weights.formats.base import QuantMatrix


def streamed_weights(weights: dict, cfg: DeepseekV2Config, source, slots: int,
                     share: range | None = None) -> ExpertCache:
    """Put StreamedStacks over one ExpertCache of `slots` experts in place of each MoE layer's
    routed expert stacks in `weights` (qcheckpoint.load_weights' memory-mapped ones, or None
    where the loader left them out; `share`: only those experts of each, stacked from 0, as a
    node of a cluster spread by experts holds them), and read the other weights that are views of a mapped file
    (a low-bit checkpoint's, a GGUF's float norms) into memory of this process's own: the budget then holds no page
    cache of the files (dropped as they are read), and a file changed under the run fails a read
    with an error instead of a fault on a mapped page."""
    cache = ExpertCache(cfg, source, slots, share)
    keep = owned
    E = len(cache.share)
    for i, layer in enumerate(weights["layers"]):
        if layer is not None:
            for _, part in layer.parts():
                for key, w in list(part.items()):
                    if not (layer.is_moe and key in KINDS):      # those are replaced: never copied
                        part[key] = keep(w)
            for key in KINDS if layer.is_moe else ():
                layer.mlp[key] = StreamedStack(cache, i, key, (E, *source.shapes[key]))
            layer.input_layernorm = keep(layer.input_layernorm)
            layer.post_attention_layernorm = keep(layer.post_attention_layernorm)
    tied = weights["lm_head"] is weights["embed_tokens"]
    for key in ("embed_tokens", "norm", "lm_head"):
        weights[key] = keep(weights[key])
    if tied:
        weights["lm_head"] = weights["embed_tokens"]
    for path in source.paths:
        drop_cached(path)
    return cache


def owned(w):
    """A weight (array, or weight object over arrays) whose memory is a view of a mapped file, as
    a copy in this process; one that owns its memory already, itself (not copied twice)."""
    if w is None:
        return None
    if isinstance(w, np.ndarray):
        return np.array(w) if file_backed(w) else w
    if isinstance(w, QuantMatrix):
        return w if not (file_backed(w.qweight) or file_backed(w.scales)) else \
            type(w)(np.array(w.qweight), np.array(w.scales))
    return type(w)(np.array(w.w)) if file_backed(w.w) else w      # formats.Dense, linear.Heads: one array, .w


def file_backed(a: np.ndarray) -> bool:
    """Whether `a` views a memory-mapped file (np.memmap, or an mmap.mmap of a file), at any depth."""
    while a is not None:
        if isinstance(a, np.memmap) or (isinstance(a, mmap.mmap) and not is_anonymous(a)):
            return True
        a = getattr(a, "base", None) if isinstance(a, np.ndarray) else getattr(a, "obj", None)
    return False


def is_anonymous(m: mmap.mmap) -> bool:
    try:
        m.size()            # a mapping of a file knows the file's size; an anonymous one raises
        return False
    except OSError:
        return True


def drop_cached(path) -> None:
    """Ask the kernel to drop a file's pages from the page cache (they were copied)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
