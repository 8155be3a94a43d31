"""DeepSeek-V2's mixture of experts: the gate (`route`), SwiGLU experts, and the mixture.

Weights (layers.MoE, prepared at load by weights/loader.py; every matrix but the gate is a weight
you can multiply by, linear.py): gate (E, D), an array (float32, or bfloat16 in a ds2 low-bit
checkpoint); experts_gate_up (E, 2*I, D) with each expert's gate_proj and up_proj stacked so one
matmul computes both; experts_down (E, D, I); shared_gate_up (2*I_s, D), shared_down (D, I_s)
when there are shared experts. Dense layers (layers.MLP) use the same `swiglu` with gate_up
(2*I, D) and down_proj (D, I). Products go to the executor `ex`, and a layer's experts to its
`experts(i, ...)`: where an expert lives (here, on disk, on another node) is the executor's."""

from __future__ import annotations

import numpy as np

from ds2cli.model.attention import softmax
from ds2cli.model.config import DeepseekV2Config
from ds2cli.model.layers import MoE
from ds2cli.model.linear import float32



def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def swiglu(ex, x: np.ndarray, gate_up, down) -> np.ndarray:
    """down(silu(gate(x)) * up(x)) with gate and up fused as one (2I, D) matrix."""
    return swiglu_all(ex, [(x, gate_up, down)])[0]                          # (T, D)


def swiglu_all(ex, experts: list) -> list[np.ndarray]:
    """[swiglu(x, gate_up, down) for x, gate_up, down in experts] for independent experts: the
    gate/up products of all of them together, then the down products of all of them."""
    hs = ex.matmul_all([(gate_up, x) for x, gate_up, _ in experts])        # each (T_e, 2I)
    acts = [silu(h[:, :h.shape[1] // 2]) * h[:, h.shape[1] // 2:] for h in hs]   # each (T_e, I)
    return ex.matmul_all([(down, a) for (_, _, down), a in zip(experts, acts)])  # each (T_e, D)


def topk(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices and values of the k largest entries of each row (unsorted, like torch.topk(sorted=False))."""
    idx = np.argpartition(-scores, k - 1, axis=-1)[:, :k]                  # (T, k)
    return idx, np.take_along_axis(scores, idx, axis=-1)


def route(x: np.ndarray, gate: np.ndarray, cfg: DeepseekV2Config,
          e_score_correction_bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The original MoEGate: softmax scores, (group-limited) greedy top-k, then normalise or scale.
    DeepSeek-V3's topk_method noaux_tc goes to route_noaux_tc."""
    if cfg.topk_method == "noaux_tc":
        return route_noaux_tc(x, gate, e_score_correction_bias, cfg)
    scores = softmax(x @ gate.T)                                            # (T, E)
    k = cfg.num_experts_per_tok
    if cfg.topk_method == "group_limited_greedy":
        T, E = scores.shape
        group_scores = scores.reshape(T, cfg.n_group, -1).max(axis=-1)      # (T, n_group)
        group_idx, _ = topk(group_scores, cfg.topk_group)                   # (T, topk_group)
        keep = np.zeros_like(group_scores, dtype=bool)
        np.put_along_axis(keep, group_idx, True, axis=-1)
        scores = np.where(np.repeat(keep, E // cfg.n_group, axis=-1), scores, np.float32(0))
    idx, weight = topk(scores, k)                                           # (T, k) each
    if k > 1 and cfg.norm_topk_prob:
        weight = weight / (weight.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    else:
        weight = weight * np.float32(cfg.routed_scaling_factor)
    return idx, weight.astype(np.float32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for x < -88 and 1/inf is the right answer, 0: no warning wanted
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def top2_group_mask(scores: np.ndarray, n_group: int, topk_group: int) -> np.ndarray:
    """True for the experts in each token's topk_group best groups, a group ranked by the sum
    of its two highest scores (DeepSeek-V3's node-limited routing)."""
    T, E = scores.shape
    grouped = scores.reshape(T, n_group, E // n_group)                      # (T, G, E/G)
    best_two = -np.partition(-grouped, 1, axis=-1)[..., :2]                 # (T, G, 2)
    group_idx, _ = topk(best_two.sum(axis=-1), topk_group)                  # (T, topk_group)
    keep = np.zeros((T, n_group), dtype=bool)
    np.put_along_axis(keep, group_idx, True, axis=-1)
    return np.repeat(keep, E // n_group, axis=-1)                           # (T, E)


def route_noaux_tc(x: np.ndarray, gate: np.ndarray, bias: np.ndarray,
                   cfg: DeepseekV2Config) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's router: sigmoid scores; the correction bias only decides which experts
    (groups first), the chosen experts are weighted by their unbiased scores, normalised when
    norm_topk_prob, and always multiplied by routed_scaling_factor."""
    scores = sigmoid(x @ gate.T)                                            # (T, E) float32
    for_choice = scores + bias                                              # (T, E)
    if cfg.n_group > 1:
        keep = top2_group_mask(for_choice, cfg.n_group, cfg.topk_group)     # (T, E)
        for_choice = np.where(keep, for_choice, -np.inf)
    idx, _ = topk(for_choice, cfg.num_experts_per_tok)                      # (T, k)
    weight = np.take_along_axis(scores, idx, axis=-1)                       # (T, k) unbiased
    if cfg.norm_topk_prob:
        weight = weight / (weight.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return idx, (weight * np.float32(cfg.routed_scaling_factor)).astype(np.float32)


class Routed:
    """Each routed expert's input rows, x[tokens[j]] for expert j, made when read: an executor
    that sends them elsewhere (a node holding the experts) sends each token's row once from `x`."""

    def __init__(self, x: np.ndarray, tokens: list[np.ndarray]):
        self.x, self.tokens = x, tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, j: int) -> np.ndarray:
        return self.x[self.tokens[j]]

    def __iter__(self):
        return (self.x[t] for t in self.tokens)


def gate(h: np.ndarray, w: MoE, cfg: DeepseekV2Config, weights: np.ndarray | None = None):
    """The experts a MoE layer picks for its normed input h (T, D), and their weights, (T, k)
    each: its router over its gate (`weights`: the gate already widened to float32)."""
    return route(h, float32(w.gate) if weights is None else weights, cfg, w.e_score_correction_bias)


def moe(ex, i: int, x: np.ndarray, w: MoE, cfg: DeepseekV2Config, trace: list | None = None) -> np.ndarray:
    """MoE layer i over x (T, D): the gate picks k experts a token; each chosen expert runs once
    over the tokens routed to it, the shared experts over every token; the output is the
    routed outputs weighted by the gate, summed in expert order, plus the shared ones. The
    executor computes the experts wherever they live; the chosen ids (T, k) are appended to
    `trace` when one is given."""
    idx, weight = gate(x, w, cfg)                                           # (T, k) each
    if trace is not None:
        trace.append(idx)
    k = idx.shape[1]
    flat = idx.ravel()
    order = np.argsort(flat, kind="stable")                                 # (T*k,) grouped by expert
    counts = np.bincount(flat, minlength=cfg.n_routed_experts)              # (E,) tokens per expert
    bounds = np.cumsum(counts)
    experts = np.flatnonzero(counts)
    picks = [order[bounds[e] - counts[e]:bounds[e]] for e in experts]       # each expert's (token, slot)s

    shared = x if w.shared_gate_up is not None else None
    outs = ex.experts(i, w, experts, Routed(x, [p // k for p in picks]), shared)   # each (T_e, D), then (T, D)
    y = np.zeros_like(x)                                                    # (T, D)
    for j in range(len(experts)):
        y[picks[j] // k] += outs[j] * weight.ravel()[picks[j]][:, None]
    if shared is not None:
        y += outs[-1]
    return y
