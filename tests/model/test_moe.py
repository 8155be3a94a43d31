"""moe.py on its own: the router (softmax scores, group-limited greedy top-k, scaling) against a
per-token statement of the original MoEGate, and the mixture (each chosen expert over its
tokens, weighted, plus the shared experts) against a float64 sum written token by token, from
the bundled model's first MoE layer."""

import numpy as np
import pytest

import ds2cli
from ds2cli.model.executor import Executor

REFERENCE = Executor()      # the calling thread
from ds2cli.model.moe import moe, route
from ds2cli.weights.source import bundled_model_dir


@pytest.fixture(scope="module")
def model():
    return ds2cli.load(bundled_model_dir())


def per_token_route(scores_row, cfg):
    """The original MoEGate for one token (group_limited_greedy, softmax), in float64."""
    E, k = len(scores_row), cfg.num_experts_per_tok
    groups = scores_row.reshape(cfg.n_group, -1)
    best_groups = np.argsort(-groups.max(-1), kind="stable")[:cfg.topk_group]
    masked = np.zeros(E)
    for g in best_groups:
        masked[g * (E // cfg.n_group):(g + 1) * (E // cfg.n_group)] = groups[g]
    idx = np.argsort(-masked, kind="stable")[:k]
    w = masked[idx]
    w = w / (w.sum() + 1e-20) if cfg.norm_topk_prob and k > 1 else w * cfg.routed_scaling_factor
    return idx, w


def softmax64(a):
    a = np.exp(a - a.max(-1, keepdims=True))
    return a / a.sum(-1, keepdims=True)


def test_the_router_picks_and_weighs_as_the_original(model):
    cfg, layer = model.config, model.layers[1]
    x = np.random.default_rng(0).standard_normal((40, cfg.hidden_size)).astype(np.float32)
    idx, w = route(x, np.asarray(layer.mlp.gate, np.float32), cfg)
    scores = softmax64(x.astype(np.float64) @ np.asarray(layer.mlp.gate, np.float64).T)
    for t in range(len(x)):
        want_idx, want_w = per_token_route(scores[t], cfg)
        order = np.argsort(idx[t])
        assert sorted(want_idx) == list(idx[t][order])
        np.testing.assert_allclose(w[t][order], want_w[np.argsort(want_idx)], rtol=1e-5)


def expert(h, gate_up, down):
    g, u = np.split(h @ gate_up.T, 2, axis=-1)
    return (g / (1 + np.exp(-g)) * u) @ down.T


def test_the_mixture_sums_each_tokens_experts_and_the_shared_ones(model):
    cfg, w = model.config, model.layers[1].mlp
    x = np.random.default_rng(1).standard_normal((9, cfg.hidden_size)).astype(np.float32)
    got = moe(REFERENCE, 0, x, w, cfg)
    idx, weight = route(x, np.asarray(w.gate, np.float32), cfg)
    x64 = x.astype(np.float64)

    def f64(m):
        return np.asarray(m.w if hasattr(m, "w") else m.dequantize(), np.float64)
    want = expert(x64, f64(w.shared_gate_up), f64(w.shared_down))
    for t in range(len(x)):
        for e, wt in zip(idx[t], weight[t]):
            want[t] += wt * expert(x64[t], f64(w.experts_gate_up)[e], f64(w.experts_down)[e])
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
