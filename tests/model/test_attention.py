"""attention.py on its own: MLA over the latent cache, in both of its forms (absorbed for few
tokens, expanded for many), against the original's expanded multi-head attention written out in
float64 from the same weights (the bundled model's first layer), for a prompt and for decode
steps after it, and against a batch that holds both."""

import numpy as np
import pytest

import ds2cli
from ds2cli.model import rope
from ds2cli.model.attention import Span, mla
from ds2cli.model.executor import Executor

REFERENCE = Executor()      # the calling thread
from ds2cli.weights.source import bundled_model_dir

T = 12


@pytest.fixture(scope="module")
def model():
    return ds2cli.load(bundled_model_dir())


def dense(w) -> np.ndarray:
    return np.asarray(w.w if hasattr(w, "w") else w.dequantize(), np.float64)


def reference_mla(model, x: np.ndarray) -> np.ndarray:
    """The original DeepSeek-V2 attention, expanded (per-head K and V), causal, in float64."""
    cfg, w = model.config, model.layers[0].self_attn
    H, d, R, C, v = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                     cfg.v_head_dim)
    eps, x = cfg.rms_norm_eps, x.astype(np.float64)

    def norm(a, g):
        return np.asarray(g, np.float64) * a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + eps)

    q = norm(x @ dense(w.q_a_proj).T, w.q_a_layernorm) @ dense(w.q_b_proj).T       # (T, H*(d+R))
    q = q.reshape(T, H, d + R)
    kv = x @ dense(w.kv_a_proj_with_mqa).T                                           # (T, C+R)
    latent, k_pe = norm(kv[:, :C], w.kv_a_layernorm), kv[:, C:]
    cos, sin = rope.cos_sin(np.arange(T), model.inv_freq, model.rope_scale)
    cos, sin = cos.astype(np.float64), sin.astype(np.float64)
    q_pe = rope.apply_rope(q[..., d:], cos[:, None], sin[:, None])                  # (T, H, R)
    k_pe = rope.apply_rope(k_pe, cos, sin)                                           # (T, R)
    k_nope = np.einsum("tc,hdc->thd", latent, np.asarray(w.w_uk.w, np.float64))     # (T, H, d)
    value = np.einsum("tc,hcv->thv", latent, np.asarray(w.w_uv.w, np.float64))      # (T, H, v)
    scores = (np.einsum("thd,shd->hts", q[..., :d], k_nope) + np.einsum("thr,sr->hts", q_pe, k_pe))
    scores = scores * model.softmax_scale + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ctx = np.einsum("hts,shv->thv", p, value).reshape(T, H * v)
    return ctx @ dense(w.o_proj).T                                                   # (T, D)


def run(model, x, chunks):
    """mla over x fed in `chunks` of tokens, through one cache; the rows of every chunk."""
    cfg = model.config
    latent = np.zeros((T, cfg.kv_lora_rank), np.float32)
    k_pe = np.zeros((T, cfg.qk_rope_head_dim), np.float32)
    out, at = [], 0
    for n in chunks:
        cos, sin = rope.cos_sin(np.arange(at, at + n), model.inv_freq, model.rope_scale)
        out.append(mla(REFERENCE, x[at:at + n], model.layers[0].self_attn, [Span(slice(0, n), latent, k_pe, at)], cos, sin,
                       cfg.rms_norm_eps, model.softmax_scale))
        at += n
    return np.concatenate(out)


@pytest.mark.parametrize("chunks", [[T], [1] * T, [7, 1, 1, 1, 1, 1]], ids=["prompt", "decode", "prompt_then_decode"])
def test_mla_equals_the_original_expanded_attention(model, chunks):
    x = np.random.default_rng(0).standard_normal((T, model.config.hidden_size)).astype(np.float32)
    want = reference_mla(model, x)
    got = run(model, x, chunks)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_a_batch_attends_each_sequence_to_its_own_cache(model):
    cfg = model.config
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((T, cfg.hidden_size)).astype(np.float32) for _ in range(2))
    caches = [(np.zeros((T, cfg.kv_lora_rank), np.float32), np.zeros((T, cfg.qk_rope_head_dim), np.float32))
              for _ in range(2)]
    cos_a, sin_a = rope.cos_sin(np.arange(T), model.inv_freq, model.rope_scale)
    cos_b, sin_b = rope.cos_sin(np.arange(5), model.inv_freq, model.rope_scale)
    x = np.concatenate([a, b[:5]])
    spans = [Span(slice(0, T), *caches[0], 0), Span(slice(T, T + 5), *caches[1], 0)]
    got = mla(REFERENCE, x, model.layers[0].self_attn, spans, np.concatenate([cos_a, cos_b]),
              np.concatenate([sin_a, sin_b]), cfg.rms_norm_eps, model.softmax_scale)
    np.testing.assert_allclose(got[:T], reference_mla(model, a), rtol=0, atol=1e-4 * np.abs(got).max())
    x_b = np.concatenate([b[:5], np.zeros((T - 5, cfg.hidden_size), np.float32)])
    np.testing.assert_allclose(got[T:], reference_mla(model, x_b)[:5], rtol=0, atol=1e-4 * np.abs(got).max())
