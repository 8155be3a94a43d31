"""The engine against the original DeepSeek-V2 math: every reference row, for several
prefill/decode splits; absorbed == expanded; the cache's contract; the trained witness."""

from pathlib import Path

import numpy as np
import pytest

import ds2cli
from ds2cli.model import attention
from ds2cli.model.executor import Executor
from ds2cli.model import rope
from ds2cli.errors import ContextFullError, Ds2Error
from ds2cli.weights.source import bundled_model_dir
from conftest import assert_reference_rows

REFERENCE = Path(__file__).parents[1] / "data" / "reference"
CASES = sorted(p.name for p in REFERENCE.iterdir() if (p / "ref.npz").is_file())
TOL = 1e-3  # the reference README: expect about 1e-4, above 1e-3 is a bug


def case_model_dir(case: str) -> Path:
    d = REFERENCE / case
    return d if (d / "config.json").is_file() else bundled_model_dir()


@pytest.fixture(scope="module", params=CASES)
def case(request):
    z = np.load(REFERENCE / request.param / "ref.npz")
    return request.param, ds2cli.load(case_model_dir(request.param)), z["ids"], z["logits"]


@pytest.mark.slow
@pytest.mark.parametrize("split", ["all_at_once", "one_at_a_time", "third_then_decode",
                                   "two_chunks_then_decode"])
def test_reference_logits_every_row(case, split):
    assert_reference_rows(case, split, TOL)


def test_last_position_logits_equal_all_logits_row(case):
    _, model, ids, ref = case
    logits = model.forward(ids[:7], model.new_cache(8))
    assert logits.shape == (model.config.vocab_size,)
    np.testing.assert_allclose(logits, ref[6], atol=TOL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", [1, 3, 70])
def test_a_head_stack_multiplies_each_head_by_its_own_matrix(dtype, T):
    """linear.Heads: y[t, h] = x[t, h] @ W[h], each head's rows within float32 rounding of the
    float64 product (bfloat16 weights widened exactly), whole or a span of heads at a time."""
    import ml_dtypes
    from ds2cli.model.linear import Heads
    rng = np.random.default_rng(1)
    H, n_in, n_out = 6, 24, 40
    stored = rng.standard_normal((H, n_in, n_out), dtype=np.float32).astype(getattr(ml_dtypes, dtype, dtype))
    w = Heads(stored)
    assert w.shape == (H * n_out, n_in) and w.nbytes == stored.nbytes
    x = rng.standard_normal((T, H, n_in), dtype=np.float32)
    exact = np.einsum("thi,hio->tho", x.astype(np.float64), stored.astype(np.float64))
    bound = 1e-5 * np.einsum("thi,hio->tho", np.abs(x.astype(np.float64)), np.abs(stored.astype(np.float64)))
    assert np.all(np.abs(w.heads(x) - exact) <= bound)
    y = np.full((T, H * n_out), np.nan, np.float32)
    for a, b in ((0, 2 * n_out), (2 * n_out, 3 * n_out), (3 * n_out, H * n_out)):
        w.span(x.reshape(T, -1), y, a, b)
    assert np.all(np.abs(y.reshape(T, H, n_out) - exact) <= bound)


def test_absorbed_equals_expanded():
    rng = np.random.default_rng(0)
    T, S, H, C, R, d, v = 5, 12, 3, 32, 8, 16, 16
    q_nope = rng.standard_normal((T, H, d), dtype=np.float32)
    q_pe = rng.standard_normal((T, H, R), dtype=np.float32)
    latent = rng.standard_normal((S, C), dtype=np.float32)
    k_pe = rng.standard_normal((S, R), dtype=np.float32)
    w_uk = rng.standard_normal((H, d, C), dtype=np.float32) * 0.2
    w_uv = rng.standard_normal((H, C, v), dtype=np.float32) * 0.2
    a = attention.attend_absorbed(Executor(), q_nope, q_pe, [(slice(0, T), latent, k_pe)], w_uk, w_uv, 0.3)
    b = attention.attend_expanded(q_nope, q_pe, latent, k_pe, w_uk, w_uv, 0.3)
    assert a.shape == (T, H, v)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # and against a plain per-head loop that builds K and V explicitly
    for h in range(H):
        k = np.concatenate([latent @ w_uk[h].T, k_pe], axis=-1)              # (S, d+R)
        q = np.concatenate([q_nope[:, h], q_pe[:, h]], axis=-1)              # (T, d+R)
        s = q @ k.T * 0.3
        s[np.arange(S)[None] > (S - T + np.arange(T))[:, None]] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(a[:, h], p @ (latent @ w_uv[h]), rtol=1e-4, atol=1e-4)


def test_decode_attends_to_the_latent_without_reprojection():
    """The cache holds exactly kv_a_layernorm(latent) and RoPE'd k_pe: recomputing them from the
    hidden state by hand gives the cached values."""
    model = ds2cli.load()
    cache = model.new_cache(16)
    model.forward([0, 74, 75, 76], cache)
    assert cache.latent.shape == (6, 16, 64) and cache.k_pe.shape == (6, 16, 16)
    assert np.all(cache.latent[:, 4:] == 0) and np.abs(cache.latent[:, :4]).sum() > 0
    # layer 0 from scratch
    cfg, w = model.config, model.layers[0]
    x = model.embed_tokens.w[[0, 74, 75, 76]]
    h = attention.rms_norm(x, w.input_layernorm, cfg.rms_norm_eps)
    kv = h @ w.self_attn.kv_a_proj_with_mqa.w.T
    np.testing.assert_allclose(cache.latent[0, :4], attention.rms_norm(kv[:, :64], w.self_attn.kv_a_layernorm,
                                                                       cfg.rms_norm_eps), atol=1e-6)


def test_bundled_model_answers_arithmetic_greedily():
    model = ds2cli.load()
    tok = model.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "What is 451 - 123?"}], add_generation_prompt=True)
    cache = model.new_cache(64)
    logits, out = model.forward(ids, cache), []
    while (token := int(np.argmax(logits))) not in model.eos_token_ids and len(out) < 30:
        out.append(token)
        logits = model.forward([token], cache)
    assert tok.decode(out).strip() == "451 - 123 = 328."


def test_cache_capacity_is_enforced_and_nothing_is_overwritten():
    model = ds2cli.load()
    cache = model.new_cache(5)
    model.forward([0, 74, 75], cache)
    before = cache.latent.copy()
    with pytest.raises(ContextFullError, match="capacity of 5"):
        model.forward([76, 77, 78], cache)
    assert cache.length == 3
    np.testing.assert_array_equal(cache.latent, before)
    model.forward([76, 77], cache)
    assert cache.length == 5 and cache.free == 0
    with pytest.raises(ContextFullError):
        model.forward([1], cache)


def test_cache_reports_size_and_bytes_per_token():
    model = ds2cli.load()
    cfg = model.config
    cache = model.new_cache(100)
    per_token = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert cache.bytes_per_token == per_token == 6 * 80 * 4
    assert cache.nbytes == 100 * per_token and cache.capacity == 100
    with pytest.raises(ContextFullError):
        model.new_cache(0)


def test_truncate_then_refeed_reproduces_logits():
    model = ds2cli.load()
    ids = [0, 74, 75, 76, 77, 78]
    cache = model.new_cache(8)
    full = model.forward(ids, cache, all_logits=True)
    cache.truncate(3)
    again = model.forward(ids[3:], cache, all_logits=True)
    np.testing.assert_allclose(again, full[3:], atol=1e-4)


def test_forward_rejects_bad_token_ids():
    model = ds2cli.load()
    with pytest.raises(Ds2Error, match="out of range"):
        model.forward([5000], model.new_cache(4))
    with pytest.raises(Ds2Error, match="at least one token"):
        model.forward([], model.new_cache(4))
    for ids in ([5.0], np.array([5.0, 6.0]), ["5"], [True]):
        cache = model.new_cache(4)
        with pytest.raises(Ds2Error, match="token ids must be integers"):
            model.forward(ids, cache)
        assert cache.length == 0
    assert model.forward(np.array([5], dtype=np.uint16), model.new_cache(4)).shape == (model.config.vocab_size,)


def test_new_cache_beyond_max_position_embeddings_and_bad_truncate_are_ds2_errors():
    model = ds2cli.load()
    limit = model.config.max_position_embeddings
    assert model.new_cache(limit).capacity == limit
    with pytest.raises(ContextFullError, match=f"max_position_embeddings \\({limit}\\)"):
        model.new_cache(limit + 1)
    cache = model.new_cache(8)
    model.forward([0, 74, 75], cache)
    for bad in (4, -1):
        with pytest.raises(Ds2Error, match=f"cannot truncate a cache of length 3 to {bad}"):
            cache.truncate(bad)
    assert cache.length == 3


def test_softmax_scale_of_bundled_model():
    # the ds2-tiny README: 48^-0.5 * 1.0980^2 = 0.17402
    assert rope.softmax_scale(ds2cli.load().config) == pytest.approx(0.17402, abs=1e-5)


def test_yarn_correction_range_and_ramp_follow_the_original():
    # dim 64, base 10000, 4096 original positions, beta 32/1 (DeepSeek-V2's settings)
    low, high = rope.yarn_find_correction_range(32, 1, 64, 10000, 4096)
    assert (low, high) == (10, 23)
    np.testing.assert_allclose(rope.yarn_linear_ramp_mask(0, 4, 5), [0, 0.25, 0.5, 0.75, 1])
    # a zero-width ramp gets the +0.001 guard instead of dividing by zero
    np.testing.assert_allclose(rope.yarn_linear_ramp_mask(1, 1, 4), [0, 0, 1, 1])
    assert rope.yarn_get_mscale(1.0, 0.707) == 1.0
    assert rope.yarn_get_mscale(40, 0.707) == pytest.approx(0.1 * 0.707 * np.log(40) + 1)


def test_rope_pair_layout_matches_the_original_deinterleave():
    """The original views (R/2, 2), transposes, then applies rotate_half; our weights are permuted
    once at load by deinterleave_rows: the two must agree on a vector."""
    R = 8
    x = np.arange(R, dtype=np.float32)
    original = x.reshape(R // 2, 2).T.reshape(R)
    np.testing.assert_array_equal(x[rope.deinterleave_rows(R)], original)
