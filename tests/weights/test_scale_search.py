"""The scale search (scales.search_scales): on any weights it never does worse than round to
nearest, by the (weighted) squared error it minimizes; and checkpoints written before it, by
round to nearest with today's quantization_config, still load and run."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ds2cli
from ds2cli.weights import checkpoint
from ds2cli.weights import qcheckpoint
from ds2cli.weights import scales
from ds2cli.weights.source import bundled_model_dir
from ds2cli.weights.qcheckpoint import VERSION
from ds2cli.weights.formats import FORMATS, QuantMatrix


def weighted_error(w, m, weight=None):
    """Per row (q8), per block of 32 inputs of a row (q8b) or per group of 32 rows of a column
    (q4): sum(weight * (w - dequantized)^2), in float64."""
    e = (m.dequantize().astype(np.float64) - w) ** 2
    if weight is not None:
        e *= weight
    if m.f.block is not None:
        return e.reshape(*e.shape[:-1], -1, m.f.block).sum(axis=-1)         # (out, in / 32)
    if m.f.group_size is None:
        return e.sum(axis=-1)                                               # (out,)
    out, inp = w.shape
    e = np.concatenate([e, np.zeros((-out % 32, inp))])
    return e.reshape(-1, 32, inp).sum(axis=1)                               # (G, in)


@st.composite
def matrices(draw):
    """Random (out, in) weights with what trained ones have: outliers, whole zero rows or
    groups, constant groups, and scales from tiny to large."""
    out, inp = draw(st.integers(1, 70)), 2 * draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out, inp)) * 10.0 ** draw(st.integers(-6, 2))
    kind = draw(st.sampled_from(["normal", "outliers", "zeros", "constant", "heavy"]))
    if kind == "outliers":
        idx = rng.integers(0, w.size, size=max(1, w.size // 50))
        w.flat[idx] *= rng.uniform(5, 50, size=len(idx))
    elif kind == "zeros":
        w[rng.random(out) < 0.3] = 0
        w[:, rng.random(inp) < 0.3] = 0
    elif kind == "constant":
        w[:, : inp // 2] = w[0, 0]
    elif kind == "heavy":
        w = rng.standard_t(2, size=w.shape) * 0.01
    return w.astype(np.float32)


@settings(max_examples=60, deadline=None)
@given(w=matrices(), weighted=st.booleans(), seed=st.integers(0, 1000), name=st.sampled_from(["q8", "q4", "q8b"]))
def test_the_search_never_does_worse_than_round_to_nearest(w, weighted, seed, name):
    f = FORMATS[name]
    if not f.supports(w.shape):   # q8b: rows of whole 32-blocks, 16 copies of an even width
        w = np.ascontiguousarray(np.tile(w, (1, 16)))
    weight = np.random.default_rng(seed).exponential(size=w.shape[1]).astype(np.float32) if weighted else None
    if weight is not None and seed % 3 == 0:
        weight[: len(weight) // 2] = 0            # channels calibration never saw
    searched = QuantMatrix(*scales.quantize(w, f, weight), f)
    nearest = QuantMatrix(*scales.quantize(w, f, search=False), f)
    # q4's groups lie in one column, so the column weight is common to a group: q4 minimizes the
    # plain error, and its weighted error is that times the weight
    weight = weight if name != "q4" else None
    got, ref = weighted_error(w, searched, weight), weighted_error(w, nearest, weight)
    # the search compares errors summed in float32: ties within its rounding may go either way
    assert np.all(got <= ref * (1 + 1e-5) + 1e-30), (got - ref).max()
    assert np.all(np.isfinite(searched.dequantize()))


def test_the_search_lowers_the_error_of_normal_weights():
    """Not only no worse: on Gaussian weights with an outlier the error falls (ds2-tiny's MLPs:
    by 5% at 8 bits, 10% at 4 bits)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 512)).astype(np.float32) * 0.02
    w[3, 5] = 0.3
    for name, gain in (("q8", 0.97), ("q4", 0.93)):
        f = FORMATS[name]
        searched = weighted_error(w, QuantMatrix(*scales.quantize(w, f), f)).sum()
        nearest = weighted_error(w, QuantMatrix(*scales.quantize(w, f, search=False), f)).sum()
        assert searched < gain * nearest, (name, searched / nearest)


def test_q8_row_scales_follow_the_column_weights():
    """A column that calibration says carries most of the energy is quantized more finely
    at the others' expense: its weighted error falls against the unweighted search."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    weight = np.ones(256, np.float32)
    weight[:8] = 1000
    f = FORMATS["q8"]
    plain = weighted_error(w, QuantMatrix(*scales.quantize(w, f), f), weight).sum()
    weighted = weighted_error(w, QuantMatrix(*scales.quantize(w, f, weight), f), weight).sum()
    assert weighted < 0.9 * plain


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_a_checkpoint_quantized_before_the_search_still_loads_and_runs(tmp_path, bits):
    """What ds2 wrote before the scale search: round-to-nearest tensors, w_uk, w_uv and the
    router gate float32, under a quantization_config without scale_search, calibration or
    unquantized. It loads, as a memory map, and runs: its next token after a prompt is the one
    this ds2's searched scales give."""
    from click.testing import CliRunner

    from ds2cli.cli.main import main

    old = scales.quantize
    try:   # today's writer is this one with round to nearest and float32 unquantized matrices
        scales.quantize = lambda w, f, importance=None, search=True: old(w, f, importance, search=False)
        qcheckpoint.UNQUANTIZED = "f32"
        dst = tmp_path / f"old-q{bits}"
        r = CliRunner().invoke(main, ["quantize", str(bundled_model_dir()), str(dst), "--bits", str(bits)])
        assert r.exit_code == 0, r.output
    finally:
        scales.quantize, qcheckpoint.UNQUANTIZED = old, "bf16"
    config = json.loads((dst / "config.json").read_text())
    qc = config["quantization_config"]
    del qc["scale_search"]
    assert qc.pop("unquantized") == "f32"
    assert checkpoint.read_headers(dst)["model.layers.1.self_attn.w_uk.weight"].dtype == "F32"
    assert set(qc) == {"quant_method", "version", "bits", "layout", "formats", "format_specs"} and qc["version"] == VERSION
    (dst / "config.json").write_text(json.dumps(config))
    model = ds2cli.load(dst)
    assert model.quantization.bits == bits and model.quantization.calibration is None
    searched = ds2cli.load(quantize=bits)   # this ds2's own scales, the same kernels
    ids = model.tokenizer.encode("ROMEO:\n")
    a = model.forward(ids, model.new_cache(len(ids)))
    b = searched.forward(ids, searched.new_cache(len(ids)))
    assert np.all(np.isfinite(a)) and np.argmax(a) == np.argmax(b)
