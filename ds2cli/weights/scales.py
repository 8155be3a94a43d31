"""Choosing the scales: a float weight into one of weights/formats' classes, each q8 row's, q8b block's
or q4 group's scale the one of least squared error (after llama.cpp's make_qx_quants), or round
to nearest. This runs once, in `ds2 quantize` and `--quantize`; the kernels never see it.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ds2cli.weights.formats import Format, QuantMatrix, bfloat16_dtype, to_panels

# The candidate scales tried per row or group, as multiples of the round-to-nearest inverse scale
# (nmax / max |w|): llama.cpp's make_qx_quants tries (nmax + 0.1 k) / max for k = -9..9 and
# refits the scale to each candidate's integers. At 8 bits a step of 0.1 is 0.08% of 127 and
# changes nothing, so q8 steps in per mille; above 1 a candidate clips the extreme.
Q4_STEPS = (0.9625, 1.0375, 1.075)
Q8_STEPS = (0.994, 0.998, 1.004, 1.01)
SEARCH_BLOCK_BYTES = 4 << 20   # the search works on row blocks of about this much float32
SEARCHED = ("q8", "q8b", "q4", "bf16")   # the formats whose scales this module chooses


def quantize(w: np.ndarray, f: Format, importance: np.ndarray | None = None,
             search: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """w (..., out, in) float -> (qweight, scales) in format f, each row's (q8) or group's (q4)
    scale chosen by `search_scales` (search=False: round to nearest, the extreme setting the
    scale). `importance` (..., in) or (in,), the mean square of each input channel over
    calibration text, weights a column's error: it moves q8's row scale; q4's groups lie in one
    column, where a common weight cannot move the best scale, so q4 ignores it here (see
    calibration.py for what it does there). A stack of matrices (experts) is quantized one
    matrix at a time on each core, so the float32 temporaries stay one matrix a core large."""
    if w.ndim > 2:
        qweight = np.empty(f.qweight_shape(w.shape), f.qweight_dtype)
        scales = np.empty(f.scales_shape(w.shape), f.scale_dtype)
        stack = list(np.ndindex(w.shape[:-2]))

        def part(a: int, b: int) -> None:
            for e in stack[a:b]:
                imp = importance[e] if importance is not None and importance.ndim > 1 else importance
                qweight[e], scales[e] = quantize(w[e], f, imp, search)

        # the matrices of a stack (a layer's experts) share the cores: the search's NumPy calls
        # on 4 MB blocks release the GIL (27-layer V2-Lite at 4 bits: 411 s on one core)
        on_cores(part, len(stack))
        return qweight, scales
    w = np.asarray(w, dtype=np.float32)
    if f.name not in SEARCHED:
        return f.quantize(w)             # a format of its own: its own rounding to nearest
    if f.bits == 16:
        return w.astype(bfloat16_dtype()), np.ones(w.shape[0], np.float32)
    if f.group_size is None:
        # a q8 row is one block of `in` values; a q8b row is in/32 blocks, each scaled alone
        size = f.block or w.shape[1]
        blocks = w.reshape(w.shape[0], -1, size)                                # (out, nb, size)
        weight = None if importance is None else np.asarray(importance, np.float32).reshape(-1, size)
        step = max(1, SEARCH_BLOCK_BYTES // (4 * w.shape[1]))
        scale = np.empty(blocks.shape[:2], np.float32)
        q = np.empty(blocks.shape, np.int8)
        for r0 in range(0, w.shape[0], step):
            rows = blocks[r0:r0 + step]
            s = nearest_q8(rows)
            if search:
                s = keep_better(rows, search_scales(rows, -127, 127, Q8_STEPS, weight, axis=-1), s,
                                -127, 127, -1, weight)
            scale[r0:r0 + step] = s
            q[r0:r0 + step] = round_clip(rows, s[..., None], -127, 127)
        if f.block:
            return to_panels(q.reshape(w.shape), scale)                      # q8b's stored layout
        return q.reshape(w.shape), scale[:, 0]
    return quantize_q4(w, f, search)


def nearest_q8(rows: np.ndarray) -> np.ndarray:
    """Round-to-nearest scales of the last axis (a q8 row, a q8b block): the largest magnitude
    maps to 127."""
    return np.abs(rows).max(axis=-1) / np.float32(127)                     # (rows, ...)


def nearest_q4(groups: np.ndarray) -> np.ndarray:
    """Round-to-nearest group scales (G, in) of groups (G, g, in), as llama.cpp's Q4_0: the value
    of largest magnitude maps to -8 exactly, so the full range [-8, 7] is used whichever sign the
    extreme has; rounded up to bfloat16, so the extreme never clips."""
    return bf16_up(signed_extreme(groups, -2) / np.float32(-8))           # (G, in)


def signed_extreme(x: np.ndarray, axis: int) -> np.ndarray:
    """The value of largest magnitude along axis, with its sign (the negative one of a tie).
    From the max and the min: an argmax of |x| along a strided axis is several times slower."""
    hi, lo = x.max(axis=axis), x.min(axis=axis)
    return np.where(hi > -lo, hi, lo)


def quantize_q4(w: np.ndarray, f: Format, search: bool) -> tuple[np.ndarray, np.ndarray]:
    out, inp = w.shape
    g = f.group_size
    pad = -out % g
    if pad:  # zero rows change neither a group's maximum nor its error; dropped again below
        w = np.concatenate([w, np.zeros((pad, inp), np.float32)], axis=-2)
    groups = w.reshape(-1, g, inp)                                          # (G, g, in)
    scales = np.empty((len(groups), inp), bfloat16_dtype())
    q = np.empty(groups.shape, np.uint8)
    block = max(1, SEARCH_BLOCK_BYTES // (4 * g * inp))
    for g0 in range(0, len(groups), block):
        part = groups[g0:g0 + block]
        scales[g0:g0 + block] = search_q4(part) if search else nearest_q4(part)
        s = scales[g0:g0 + block].astype(np.float32)[:, None, :]            # (G, 1, in)
        q[g0:g0 + block] = round_clip(part, s, -8, 7, offset=8)
    q = q.reshape(out + pad, inp)[:out]
    half = inp // 2
    return np.ascontiguousarray(q[:, :half] | (q[:, half:] << 4)), scales


def search_q4(groups: np.ndarray) -> np.ndarray:
    """The searched bfloat16 scales (G, in) of groups (G, g, in): the search runs in float32 and
    its scale is rounded to the nearest bfloat16; a group keeps the round-to-nearest scale
    (nearest_q4) wherever that measures no worse after the rounding."""
    found = search_scales(groups, -8, 7, Q4_STEPS, None, axis=-2).astype(bfloat16_dtype())
    return keep_better(groups, found, nearest_q4(groups), -8, 7, -2)


def keep_better(x: np.ndarray, found: np.ndarray, nearest: np.ndarray, lo: int, hi: int, axis: int,
                weight: np.ndarray | None = None) -> np.ndarray:
    """found where its error, measured directly on the stored scales, is less than nearest's."""
    err = [squared_error(x, np.expand_dims(s.astype(np.float32), axis), lo, hi, axis, weight)
           for s in (found, nearest)]
    return np.where(err[0] < err[1], found, nearest)


def search_scales(x: np.ndarray, lo: int, hi: int, steps: tuple, weight: np.ndarray | None,
                  axis: int) -> np.ndarray:
    """The scale of each slice of x along `axis` (a row of q8, a group of q4) that minimizes the
    weighted squared error sum(weight * (x - s * L)^2) of its integers L = clip(rint(x / s),
    lo, hi), searched as llama.cpp's make_qx_quants does: from the inverse scale that maps the
    extreme onto the range, try each of `steps` times it; for each, refit the scale to the
    integers it gives (s = sum(w x L) / sum(w L^2), the least-squares scale for those
    integers) and keep the candidate whose refitted error, sum(w x^2) - s * sum(w x L), is
    least. The round-to-nearest integers (step 1) are one candidate, refitted. Callers check the
    result against round to nearest on the stored scales (keep_better), since this error is a
    difference of float32 sums. weight (in,) applies along the last axis (q8's columns); None
    weighs every value alike."""
    nmax = -lo if lo + hi < 0 else hi                  # q4: the extreme maps to -8; q8: to 127
    extreme = np.expand_dims(signed_extreme(x, axis) if lo + hi < 0 else np.abs(x).max(axis=axis), axis)
    base = np.divide(np.float32(-nmax if lo + hi < 0 else nmax), extreme,
                     out=np.zeros_like(extreme), where=extreme != 0)      # keepdims shape
    xw = x if weight is None else x * weight
    root = None if weight is None else np.sqrt(weight)
    sub = "gri,gri->gi" if axis == -2 else "...i,...i->..."
    total = np.einsum(sub, x, xw)                                           # sum(w x^2)
    best_s = np.zeros(total.shape, np.float32)
    best_err = np.full(total.shape, np.inf, np.float32)
    L = np.empty_like(x)
    for step in (1.0, *steps):
        np.multiply(x, base * np.float32(step), out=L)
        np.rint(L, out=L)
        np.clip(L, lo, hi, out=L)
        sumlx = np.einsum(sub, L, xw)
        if root is not None:
            L *= root
        suml2 = np.einsum(sub, L, L)
        s = np.divide(sumlx, suml2, out=np.zeros_like(sumlx), where=suml2 > 0)
        err = total - s * sumlx
        better = err < best_err
        best_s[better], best_err[better] = s[better], err[better]
    return best_s


def round_clip(x: np.ndarray, s: np.ndarray, lo: int, hi: int, offset: int = 0) -> np.ndarray:
    """The integers of x at scales s (broadcast), clip(rint(x / s), lo, hi) + offset; 0 (plus
    the offset) where s is 0, which happens only where x is all zeros."""
    inv = np.divide(np.float32(1), s, out=np.zeros_like(s), where=s != 0)
    q = np.rint(x * inv)
    np.clip(q, lo, hi, out=q)
    if offset:
        q += offset
    return q.astype(np.uint8 if offset else np.int8)


def squared_error(x: np.ndarray, s: np.ndarray, lo: int, hi: int, axis: int,
                  weight: np.ndarray | None = None) -> np.ndarray:
    """sum(weight * (x - s * q)^2) along axis, q the integers round_clip gives x at scales s."""
    inv = np.divide(np.float32(1), s, out=np.zeros_like(s), where=s != 0)
    e = np.clip(np.rint(x * inv), lo, hi)
    e *= s
    np.subtract(x, e, out=e)
    e *= e
    if weight is not None:
        e *= weight
    return e.sum(axis=axis)


def bf16_up(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16, rounding the magnitude up (a bfloat16 is a float32's top 16 bits)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    up = (bits.astype(np.uint64) + 0xFFFF).clip(max=0xFFFFFFFF).astype(np.uint32)
    # a finite value never rounds past the largest bfloat16 into inf/nan
    up = np.where((up & 0x7F800000) == 0x7F800000, bits, up)
    return (up >> 16).astype(np.uint16).view(bfloat16_dtype())


def quantize_matrix(w: np.ndarray, f: Format) -> QuantMatrix:
    """A float weight (..., out, in) as a QuantMatrix in format f, its scales searched."""
    return f(*quantize(w, f))


def on_cores(part, count: int) -> None:
    """part(a, b) over [0, count) cut into one consecutive span a core this process may use, the
    spans on threads at once, BLAS at one thread meanwhile (each span already has a core)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = max(1, min(cores, 8, count))
    bounds = [count * k // n for k in range(n + 1)]
    spans = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    if len(spans) < 2:
        for a, b in spans:
            part(a, b)
        return
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(len(spans)) as pool:
        for f in [pool.submit(part, a, b) for a, b in spans]:
            f.result()
