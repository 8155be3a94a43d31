"""Multi-head Latent Attention (MLA) over the latent cache.

Shape legend: T new tokens of one sequence, N new tokens of all the sequences of a batched
pass, S cached positions (including the new ones), H heads, C kv_lora_rank,
R qk_rope_head_dim, d qk_nope_head_dim, v v_head_dim, D hidden size.

Weights (layers.Attention, prepared once at load by weights/loader.py, Hugging Face names kept);
the projections are weights you can multiply by (linear.py, any format):
  q_proj (H*(d+R), D)  or  q_a_proj (q_lora_rank, D), q_a_layernorm, q_b_proj (H*(d+R), q_lora_rank)
  kv_a_proj_with_mqa (C+R, D), kv_a_layernorm (C,), o_proj (D, H*v)
  w_uk (H, d, C), w_uv (H, C, v): kv_b_proj split per head, the MLA weight absorption; stacks
    of per-head matrices (linear.Heads): the absorbed form multiplies each head's vectors by
    them (`ex.heads(w, x)`), the expanded form multiplies the cached latent by all of them
The RoPE rows of q and kv_a_proj_with_mqa are stored de-interleaved (see rope.deinterleave_rows).
Products and each sequence's attention go to the executor `ex` (executor.py), which decides where
they run and how they are cut (by heads, by keys): the math here states them whole.
"""

from __future__ import annotations

import dataclasses
import numpy as np

from ds2cli.model.layers import Attention
from ds2cli.model.linear import as_heads
from ds2cli.model.rope import apply_rope


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return weight * (x / np.sqrt(variance + np.float32(eps)))


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.exp(x - np.max(x, axis=-1, keepdims=True))
    x /= np.sum(x, axis=-1, keepdims=True)
    return x


def causal_pairs(T: int, S: int) -> int:
    """Query-key pairs a causal pass of T new tokens over S cached positions computes: query t
    (position S-T+t) sees S-T+t+1 keys; the blocks above the diagonal are skipped, not masked."""
    return T * (S - T) + T * (T + 1) // 2


def absorbed_cost(T: int, S: int, H: int, C: int, R: int, d: int, v: int) -> int:
    """Multiply-adds of attention straight against the latent (q folded through W_UK)."""
    return H * (T * d * C + causal_pairs(T, S) * (2 * C + R) + T * C * v)


def expanded_cost(T: int, S: int, H: int, C: int, R: int, d: int, v: int) -> int:
    """Multiply-adds of expanding the cached latent into per-head k_nope and v first."""
    return H * S * C * (d + v) + H * causal_pairs(T, S) * (d + R + v)


# Bounded working memory: attention never holds more than this many bytes of scores,
# probabilities and expanded keys at once, whatever the prompt's length (the memory check counts
# it beside the cache). 64 MiB keeps a block's GEMMs large (512+ keys for a 1,024-token chunk of
# V2-Lite's 16 heads) while a 16k-token prompt's whole (H, T, S) scores would take 16 GiB.
ATTENTION_BUDGET_BYTES = 64 * 2 ** 20


def key_block(per_key_bytes: int) -> int:
    """How many cached positions one block takes, so that the block's arrays fit the budget."""
    return max(16, ATTENTION_BUDGET_BYTES // max(1, per_key_bytes))


def online_softmax(m: np.ndarray, l: np.ndarray, scores: np.ndarray):
    """One block of keys into a running softmax (FlashAttention's recurrence, Dao et al. 2022).

    For each query row, over the keys seen so far: m the running maximum of the scores, l the
    running sum of exp(score - m), acc the running sum of exp(score - m) * value. A new block of
    scores s_j (..., bk) updates them as
        m' = max(m, max_j s_j)      alpha = exp(m - m')      p_j = exp(s_j - m')
        l' = alpha * l + sum_j p_j  acc' = alpha * acc + p @ values
    and after the last block the attention output is acc / l: exactly softmax(all scores) @ values,
    without ever holding every key's score. Returns (m', l', p, alpha); the caller updates acc in
    whatever orientation its product prefers. Every row must see at least one key of the block
    (the causal loop below includes only such rows), so m' is finite."""
    m_new = np.maximum(m, scores.max(axis=-1))                              # (...)
    alpha = np.exp(m - m_new)                                               # (...), 0 on the first block
    p = np.exp(scores - m_new[..., None])                                   # (..., bk)
    return m_new, alpha * l + p.sum(axis=-1), p, alpha


def visible(start: int, T: int, s0: int, s1: int) -> tuple[int, np.ndarray | None]:
    """Which queries see keys [s0, s1): the first, t0 (query t, at position start+t, sees the
    keys up to its own position, so the rows before t0 see none of the block and are skipped),
    and the mask (T-t0, s1-s0) of keys still in their future, or None when no row has any."""
    t0 = max(0, s0 - start)
    if s1 - 1 <= start + t0:
        return t0, None
    return t0, np.arange(s0, s1)[None, :] > (start + np.arange(t0, T))[:, None]


def attend_absorbed(ex, q_nope, q_pe, seqs, w_uk, w_uv, scale) -> np.ndarray:
    """The absorbed form, the paper's three steps, for sequences whose new queries are stacked in
    q_nope (n, H, d) and q_pe (n, H, R); seqs[i] = (rows, latent, k_pe): sequence i's rows of them
    and its cache (S_i, C), (S_i, R), its new tokens last. The latent is never expanded:
        q_lat = q_nope . W_UK                                 each head's query in the latent space
        ctx   = softmax(q_lat . latent^T + q_pe . k_pe^T) . latent
        out   = ctx . W_UV"""
    n, H, _ = q_nope.shape
    q_lat = ex.heads(as_heads(w_uk), q_nope)                                # (n, H, C)
    ctx = np.empty_like(q_lat)                                              # (n, H, C)
    for rows, latent, k_pe in seqs:
        ctx[rows] = ex.attend_latent(q_lat[rows], q_pe[rows], latent, k_pe, scale)   # (T, H, C)
    return ex.heads(as_heads(w_uv), ctx)                                    # (n, H, v)


def attend_latent(q_lat, q_pe, latent, k_pe, scale) -> np.ndarray:
    """softmax(q_lat.latent^T + q_pe.k_pe^T) . latent: the T new queries' (T, H, C) context in
    the latent space, for queries already folded through W_UK. The T new queries (positions
    S-T..S-1, the last T of the cache) meet it a block of keys at a time (absorbed_sums); any
    split of the keys gives running sums that merge (merge_sums). Rows are query-major (t, h)."""
    T, H, C = q_lat.shape
    _, l, acc = absorbed_sums(q_lat, q_pe, latent, k_pe, scale, slice(0, len(latent)))
    return (acc / l[:, None]).reshape(T, H, C)                              # (T, H, C)


def absorbed_sums(q_lat, q_pe, latent, k_pe, scale, keys: slice):
    """The online softmax's (m, l, acc) of the queries q_lat (T, H, C), q_pe (T, H, R), as rows
    (T*H, C) query-major, over the cached
    positions `keys`, a block at a time. The products against the cache are written cache-major
    (`latent @ q_lat.T`, `latent.T @ p.T`): with few query rows OpenBLAS streams the latent up to
    twice as fast that way round, and long-context decode is mostly these two passes over the
    latent. The softmax runs on a contiguous (rows, keys) copy: NumPy reduces a narrow axis 0
    slowly. A row that sees none of the keys keeps m = -inf, l = 0 (merge_sums weighs it 0)."""
    T, H, C = q_lat.shape
    q_lat, q_pe = q_lat.reshape(T * H, C), q_pe.reshape(T * H, -1)         # (T*H, C), (T*H, R)
    rows, S = T * H, len(latent)
    start = S - T                                                           # position of query 0
    m = np.full(rows, -np.inf, np.float32)                                  # running max
    l = np.zeros(rows, np.float32)                                          # running sum
    acc = np.zeros((rows, C), np.float32)                                   # running numerator
    bk = key_block(4 * 3 * rows)           # scores, their contiguous copy, p
    for s0 in range(keys.start, keys.stop, bk):
        s1 = min(s0 + bk, keys.stop)
        t0, future = visible(start, T, s0, s1)
        if t0 >= T:
            break                                                           # no row sees these keys
        r = slice(t0 * H, rows)                                             # rows that see the block
        scores = latent[s0:s1] @ q_lat[r].T                                 # (bk, rows)
        scores += k_pe[s0:s1] @ q_pe[r].T
        scores *= np.float32(scale)
        scores = np.ascontiguousarray(scores.T)                             # (rows, bk)
        if future is not None:
            np.copyto(scores.reshape(T - t0, H, -1), -np.inf, where=future[:, None, :])
        m[r], l[r], p, alpha = online_softmax(m[r], l[r], scores)
        acc[r] *= alpha[:, None]
        acc[r] += (latent[s0:s1].T @ p.T).T                                 # (rows, C)
    return m, l, acc


def merge_sums(parts: list) -> tuple:
    """Running sums over disjoint key ranges into the sums over their union: each part's l and
    acc rescaled to the common maximum, exp(m_i - m), as one more step of the online softmax."""
    if len(parts) == 1:
        return parts[0]
    m = np.max([p[0] for p in parts], axis=0)                               # (rows,)
    l, acc = 0, 0
    for m_i, l_i, acc_i in parts:
        w = np.exp(m_i - m)                                                 # 0 where a part saw nothing
        l, acc = l + w * l_i, acc + w[:, None] * acc_i
    return m, l, acc


def attend_expanded(q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale) -> np.ndarray:
    """The original's form: k_nope and v re-expanded from the latent, a block of keys at a time,
    each block expanded once for every query that sees it."""
    T = q_nope.shape[0]
    S = len(latent)
    start = S - T                                                           # position of query 0
    H, d, _ = w_uk.shape
    v = w_uv.shape[2]
    q_nope, q_pe = q_nope.transpose(1, 0, 2), q_pe.transpose(1, 0, 2)       # (H, T, d), (H, T, R)
    m = np.full((H, T), -np.inf, np.float32)
    l = np.zeros((H, T), np.float32)
    acc = np.zeros((H, T, v), np.float32)
    bk = key_block(4 * H * (d + v + 3 * T))   # k_nope, value, scores, p
    for s0 in range(0, S, bk):
        s1 = min(s0 + bk, S)
        t0, future = visible(start, T, s0, s1)
        k_nope = np.matmul(latent[s0:s1], w_uk.transpose(0, 2, 1))         # (H, bk, d)
        value = np.matmul(latent[s0:s1], w_uv)                              # (H, bk, v)
        scores = np.matmul(q_nope[:, t0:], k_nope.transpose(0, 2, 1))       # (H, T-t0, bk)
        scores += np.matmul(q_pe[:, t0:], k_pe[s0:s1].T)
        scores *= np.float32(scale)
        if future is not None:
            scores[:, future] = -np.inf
        m[:, t0:], l[:, t0:], p, alpha = online_softmax(m[:, t0:], l[:, t0:], scores)
        acc[:, t0:] *= alpha[..., None]
        acc[:, t0:] += np.matmul(p, value)                                  # (H, T-t0, v)
    return (acc / l[..., None]).transpose(1, 0, 2)                          # (T, H, v)


@dataclasses.dataclass
class Span:
    """One sequence of a batched pass: its rows of x, its cache slots in this layer, and the
    position of its first new token."""
    rows: slice
    latent: np.ndarray              # (capacity, C)
    k_pe: np.ndarray                # (capacity, R)
    start: int

    @property
    def T(self) -> int:
        return self.rows.stop - self.rows.start

    def keys(self) -> tuple[np.ndarray, np.ndarray]:
        """The cache this sequence attends to, its new tokens included: (S, C), (S, R)."""
        return self.latent[:self.start + self.T], self.k_pe[:self.start + self.T]


def mla(ex, x, w: Attention, spans, cos, sin, eps, scale) -> np.ndarray:
    """One MLA block for a batch: x (N, D) stacks each sequence's new tokens (span.rows, at
    positions [span.start, span.start+T)). The projections run on all rows at once; each
    sequence writes its latent and k_pe into its own cache slots and attends to its own cache,
    in whichever form costs it less: absorbed (attend_absorbed) or expanded (the original's,
    attend_expanded). Returns (N, D)."""
    N = len(x)
    H, d, C = w.w_uk.w.shape
    v, R = w.w_uv.w.shape[2], w.kv_a_proj_with_mqa.shape[0] - C
    if w.q_proj is not None:
        q, kv = ex.matmul_all([(w.q_proj, x), (w.kv_a_proj_with_mqa, x)])  # (N, H*(d+R)), (N, C+R)
    else:
        q, kv = ex.matmul_all([(w.q_a_proj, x), (w.kv_a_proj_with_mqa, x)])
        q, = ex.matmul_all([(w.q_b_proj, rms_norm(q, w.q_a_layernorm, eps))])
    q = q.reshape(N, H, d + R)                                              # (N, H, d+R)
    q_nope, q_pe = q[..., :d], apply_rope(q[..., d:], cos[:, None], sin[:, None])
    latent, k_pe = rms_norm(kv[:, :C], w.kv_a_layernorm, eps), apply_rope(kv[:, C:], cos, sin)  # (N, C), (N, R)
    for s in spans:
        s.latent[s.start:s.start + s.T], s.k_pe[s.start:s.start + s.T] = latent[s.rows], k_pe[s.rows]

    costs = [(absorbed_cost(s.T, s.start + s.T, H, C, R, d, v), expanded_cost(s.T, s.start + s.T, H, C, R, d, v))
             for s in spans]
    absorbed = [s for s, (a, e) in zip(spans, costs) if a <= e]
    expanded = [s for s, (a, e) in zip(spans, costs) if a > e]
    ctx = np.empty((N, H, v), np.float32)                                   # (N, H, v)
    if absorbed:
        rows = np.concatenate([np.arange(s.rows.start, s.rows.stop) for s in absorbed])
        whole = len(rows) == N                  # every row absorbed (decode): no gather
        seqs, at = [], 0
        for s in absorbed:
            seqs.append((slice(at, at + s.T), *s.keys()))
            at += s.T
        ctx[rows] = attend_absorbed(ex, q_nope if whole else q_nope[rows], q_pe if whole else q_pe[rows],
                                    seqs, w.w_uk, w.w_uv, scale)            # (n, H, v)
    if expanded:
        uk, uv = w.w_uk.widened(), w.w_uv.widened()                        # (H, d, C), (H, C, v)
        for s in expanded:
            ctx[s.rows] = ex.attend_expanded(q_nope[s.rows], q_pe[s.rows], *s.keys(), uk, uv, scale)  # (T, H, v)
    return ex.matmul_all([(w.o_proj, ctx.reshape(N, -1))])[0]               # (N, D)
