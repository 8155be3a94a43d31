"""Multi-head Latent Attention (MLA) over the latent cache.

Shape legend: T new tokens of one sequence, N new tokens of all the sequences of a batched
pass, S cached positions (including the new ones), H heads, C kv_lora_rank,
R qk_rope_head_dim, d qk_nope_head_dim, v v_head_dim, D hidden size.

Weights (prepared once at load by weights/loader.py, Hugging Face names kept); the projections are
weights you can multiply by (linear.py: float32 or low-bit, `w.matmul(x)` = x @ W.T):
  q_proj (H*(d+R), D)  or  q_a_proj (q_lora_rank, D), q_a_layernorm, q_b_proj (H*(d+R), q_lora_rank)
  kv_a_proj_with_mqa (C+R, D), kv_a_layernorm (C,), o_proj (D, H*v)
  w_uk (H, d, C), w_uv (H, C, v): kv_b_proj split per head, the MLA weight absorption; arrays,
    float32 or (in a ds2 low-bit checkpoint) bfloat16, since both forms below use them in both
    orientations
The RoPE rows of q and kv_a_proj_with_mqa are stored de-interleaved (see rope.deinterleave_rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ds2cli.parallel import cores
from ds2cli.model.rope import apply_rope


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return weight * (x / np.sqrt(variance + np.float32(eps)))


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.exp(x - np.max(x, axis=-1, keepdims=True))
    x /= np.sum(x, axis=-1, keepdims=True)
    return x


def project_q(x: np.ndarray, w: dict, H: int, eps: float) -> np.ndarray:
    if "q_proj" in w:
        q = w["q_proj"].matmul(x)                                           # (T, H*(d+R))
    else:
        q_a = rms_norm(w["q_a_proj"].matmul(x), w["q_a_layernorm"], eps)    # (T, q_lora_rank)
        q = w["q_b_proj"].matmul(q_a)                                       # (T, H*(d+R))
    return q.reshape(len(x), H, -1)                                         # (T, H, d+R)


def absorbed_cost(T: int, S: int, H: int, C: int, R: int, d: int, v: int) -> int:
    """Multiply-adds of attention straight against the latent (q folded through W_UK)."""
    return H * T * (d * C + S * (2 * C + R) + C * v)


def expanded_cost(T: int, S: int, H: int, C: int, R: int, d: int, v: int) -> int:
    """Multiply-adds of expanding the cached latent into per-head k_nope and v first."""
    return H * S * C * (d + v) + H * T * S * (d + R + v)


def causal_mask(T: int, S: int) -> np.ndarray:
    """True where query t (absolute position S-T+t) must not see cached position s."""
    return np.arange(S)[None, :] > (S - T + np.arange(T))[:, None]          # (T, S)


def attend_absorbed(q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale) -> np.ndarray:
    """q_lat = q_nope.W_UK; scores = q_lat.latent^T + q_pe.k_pe^T; ctx = (probs.latent).W_UV

    The products against the cache are written cache-major (`latent @ q_lat.T`,
    `latent.T @ probs.T`): with few query rows OpenBLAS streams the latent up to twice as fast
    that way round, and long-context decode is mostly these two passes over the latent. The
    softmax runs on a contiguous (H*T, S) copy: NumPy reduces a narrow axis 0 slowly."""
    T, H, _ = q_nope.shape
    S = len(latent)
    q_lat = np.matmul(q_nope.transpose(1, 0, 2), w_uk)                      # (H, T, C)
    q_pe = q_pe.transpose(1, 0, 2).reshape(H * T, -1)                       # (H*T, R)
    scores = latent @ q_lat.reshape(H * T, -1).T                            # (S, H*T)
    scores += k_pe @ q_pe.T
    scores *= np.float32(scale)
    if T > 1:   # query t sees no position after its own, in every head
        future = causal_mask(T, S).T[:, None, :]                            # (S, 1, T)
        np.copyto(scores.reshape(S, H, T), -np.inf, where=future)
    probs = softmax(np.ascontiguousarray(scores.T))                         # (H*T, S)
    ctx_lat = (latent.T @ probs.T).T.reshape(H, T, -1)                      # (H, T, C)
    return np.matmul(ctx_lat, w_uv).transpose(1, 0, 2)                      # (T, H, v)


def attend_expanded(q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale) -> np.ndarray:
    """The original's form: k_nope and v re-expanded from the latent for every cached position."""
    T = q_nope.shape[0]
    S = len(latent)
    k_nope = np.matmul(latent, w_uk.transpose(0, 2, 1))                     # (H, S, d)
    value = np.matmul(latent, w_uv)                                         # (H, S, v)
    scores = np.matmul(q_nope.transpose(1, 0, 2), k_nope.transpose(0, 2, 1))  # (H, T, S)
    scores += np.matmul(q_pe.transpose(1, 0, 2), k_pe.T)
    scores *= np.float32(scale)
    if T > 1:
        scores[:, causal_mask(T, S)] = -np.inf
    return np.matmul(softmax(scores), value).transpose(1, 0, 2)            # (T, H, v)


@dataclasses.dataclass
class Span:
    """One sequence of a batched pass: its rows of x, its cache slots in this layer, and the
    position of its first new token."""
    rows: slice
    latent: np.ndarray              # (capacity, C)
    k_pe: np.ndarray                # (capacity, R)
    start: int


def mla(x, w, spans, cos, sin, H, eps, scale) -> np.ndarray:
    """One MLA block for a batch: x (N, D) stacks each sequence's new tokens (span.rows, at
    positions [span.start, span.start+T)). The projections run on all rows at once; each
    sequence writes its latent and k_pe into its own cache slots and attends to its own cache.
    Returns the attention output (N, D)."""
    N = len(x)
    C = w["kv_a_layernorm"].shape[0]
    q = project_q(x, w, H, eps)                                             # (N, H, d+R)
    # kv_b_proj's halves in float32, once a pass (a low-bit checkpoint stores them bfloat16)
    w_uk, w_uv = (np.asarray(w[k], np.float32) for k in ("w_uk", "w_uv"))  # (H, d, C), (H, C, v)
    d = w_uk.shape[1]
    q_nope, q_pe = q[..., :d], apply_rope(q[..., d:], cos[:, None], sin[:, None])
    kv = w["kv_a_proj_with_mqa"].matmul(x)                                  # (N, C+R)
    latent_new = rms_norm(kv[:, :C], w["kv_a_layernorm"], eps)              # (N, C)
    k_pe_new = apply_rope(kv[:, C:], cos, sin)                              # (N, R)
    work = []                       # (sequence, heads) pieces: heads are independent
    for s in spans:
        T = s.rows.stop - s.rows.start
        s.latent[s.start:s.start + T], s.k_pe[s.start:s.start + T] = latent_new[s.rows], k_pe_new[s.rows]
        work += [(s, T, heads) for heads in cores.split(H, tokens=T)]

    def attend(piece) -> np.ndarray:
        s, T, h = piece
        latent, k_pe = s.latent[:s.start + T], s.k_pe[:s.start + T]         # (S, C), (S, R)
        dims = (T, s.start + T, H, C, k_pe.shape[1], d, w_uv.shape[2])
        form = attend_absorbed if absorbed_cost(*dims) <= expanded_cost(*dims) else attend_expanded
        return form(q_nope[s.rows, h], q_pe[s.rows, h], latent, k_pe, w_uk[h], w_uv[h], scale)

    # the cores may share the pieces (cores.py decides when that pays), the costliest first
    outs = cores.map(attend, work, cost=[T * (s.start + T) for s, T, _ in work])
    ctx = np.empty((N, H, w_uv.shape[2]), dtype=q.dtype)                    # (N, H, v)
    for (s, _, h), out in zip(work, outs):
        ctx[s.rows, h] = out                                                # (T, h, v)
    return w["o_proj"].matmul(ctx.reshape(N, -1))                           # (N, D)
