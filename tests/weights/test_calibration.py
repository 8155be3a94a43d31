"""Calibration (calibration.py): what each projection's statistics are made of (a routed
expert's only of the tokens routed to it), GPTQ's compensation against plain rounding on the
calibration inputs, and `ds2 quantize --calibration` with good and bad texts."""

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner

import ds2cli
from ds2cli.weights import calibration
from ds2cli.weights import scales
from ds2cli.cli.main import main
from ds2cli.model.config import DeepseekV2Config
from ds2cli.model.executor import Executor
from ds2cli.model.layers import Attention, Layer, MoE
from ds2cli.weights.formats import Dense
from ds2cli.weights.source import bundled_model_dir
from ds2cli.text.tokenizer import Tokenizer
from ds2cli.model.moe import moe
from ds2cli.weights.formats import FORMATS, QuantMatrix

TINY = bundled_model_dir()


def test_a_routed_expert_counts_only_the_tokens_routed_to_it():
    """A gate that sends token t to experts 2t mod 8 and 2t+3 mod 8 (one-hot directions in the
    gate's rows, scaled far past the others): each expert's moments are exactly the sum of x x^T
    over its tokens, its down projection's over what its gate_up made of them."""
    cfg = dataclasses.replace(DeepseekV2Config.from_file(TINY / "config.json"), n_group=1, topk_group=1,
                              topk_method="greedy")
    E, D, inter, T = cfg.n_routed_experts, cfg.hidden_size, 16, 12
    rng = np.random.default_rng(0)
    routes = [(2 * t % E, (2 * t + 3) % E) for t in range(T)]
    x = rng.standard_normal((T, D)).astype(np.float32) * 0.1
    for t, (a, b) in enumerate(routes):
        x[t, a] += 20
        x[t, b] += 19
    gate = np.zeros((E, D), np.float32)
    gate[np.arange(E), np.arange(E)] = 1
    w = MoE(gate=gate, experts_gate_up=Dense(rng.standard_normal((E, 2 * inter, D)).astype(np.float32) * 0.05),
            experts_down=Dense(rng.standard_normal((E, D, inter)).astype(np.float32) * 0.05))
    layer = Layer(None, Attention(), None, w)
    moments = calibration.record(layer)
    trace = []
    moe(Executor(), 0, x, layer.mlp, cfg, trace)
    calibration.unrecord(layer)
    assert [set(r) for r in trace[0].tolist()] == [set(r) for r in routes]   # the routing is as built
    up, down = moments["mlp", "experts_gate_up"], moments["mlp", "experts_down"]
    for e in range(E):
        mine = [t for t, r in enumerate(routes) if e in r]
        xe = x[mine].astype(np.float64)
        assert up.count[e] == down.count[e] == len(mine)
        np.testing.assert_allclose(up.sum[e], xe.T @ xe, rtol=1e-5, atol=1e-3)
        h = xe @ w["experts_gate_up"].w[e].T.astype(np.float64)
        act = h[:, :inter] / (1 + np.exp(-h[:, :inter])) * h[:, inter:]
        np.testing.assert_allclose(down.sum[e], act.T @ act, rtol=1e-4, atol=1e-6)


def test_an_expert_that_saw_few_tokens_takes_its_layers_statistics():
    m = calibration.Moments(4, experts=3)
    rng = np.random.default_rng(0)
    many = rng.standard_normal((500, 4)).astype(np.float32)
    few = rng.standard_normal((calibration.MIN_EXPERT_TOKENS - 1, 4)).astype(np.float32) * 10
    m.add(many, 0)
    m.add(few, 1)                                  # expert 2 saw nothing
    h, count = m.hessian()
    pool = (many.T.astype(np.float64) @ many + few.T @ few) / (len(many) + len(few))
    assert count.tolist() == [500, len(few), 0]
    np.testing.assert_allclose(h[1], pool, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h[2], pool, rtol=1e-5, atol=1e-5)
    # an expert that saw enough keeps mostly its own, shrunk toward the layer's by SHRINK * in tokens
    k = calibration.SHRINK * 4
    np.testing.assert_allclose(h[0], (many.T.astype(np.float64) @ many + k * pool) / (500 + k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["q8", "q4"])
def test_gptq_lowers_the_output_error_on_the_calibration_inputs(name):
    """Inputs with correlated channels of unequal energy, as activations are: GPTQ's product
    error ||(W - Q) X^T||^2 on them is well under plain rounding's (searched scales, no
    compensation), for one matrix and for a stack of experts, each with its own inputs."""
    rng = np.random.default_rng(0)
    f = FORMATS[name]
    E, out, inp, n = 2, 64, 96, 2000
    w = rng.standard_normal((E, out, inp)).astype(np.float32) * 0.02
    mix = rng.standard_normal((E, inp, inp)) * np.exp(rng.standard_normal(inp))[None, :, None]
    x = np.einsum("etj,eji->eti", rng.standard_normal((E, n, inp)), mix).astype(np.float32)  # (E, n, in)
    h = np.einsum("eti,etj->eij", x.astype(np.float64), x) / n
    plain = QuantMatrix(*scales.quantize(w, f), f).dequantize()
    gptq = QuantMatrix(*calibration.quantize_calibrated(w, f, h.astype(np.float32)), f).dequantize()
    single = QuantMatrix(*calibration.quantize_calibrated(w[0], f, h[0].astype(np.float32)), f).dequantize()
    err = lambda q: float(np.sum(np.einsum("eti,eoi->eto", x, q - w) ** 2))  # noqa: E731
    assert err(gptq) < 0.7 * err(plain), (err(gptq), err(plain))
    np.testing.assert_allclose(single, gptq[0], rtol=0, atol=float(np.abs(w).max()) * 1e-6)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """ds2-tiny at 4 bits, calibrated on the built-in text's first lines (309 tokens, a quick run:
    the whole text is 4107), written to sonnets.txt beside it."""
    folder = tmp_path_factory.mktemp("calibrated")
    builtin, name, _ = calibration.read_text(calibration.BUILTIN)
    assert name == "builtin"
    (folder / "sonnets.txt").write_text(builtin[:builtin.index("\n", 990) + 1], encoding="utf-8")
    dst = folder / "q4"
    r = CliRunner().invoke(main, ["quantize", str(TINY), str(dst), "--bits", "4",
                                  "--calibration", str(folder / "sonnets.txt"), "--json"])
    assert r.exit_code == 0, r.output
    return dst, json.loads(r.output)


@pytest.mark.slow
def test_quantize_records_the_calibration_and_the_result_loads(calibrated):
    dst, summary = calibrated
    recorded = json.loads((dst / "config.json").read_text())["quantization_config"]["calibration"]
    assert recorded == summary["calibration"]
    text = (dst.parent / "sonnets.txt").read_text(encoding="utf-8")
    assert recorded["text"] == "sonnets.txt" and recorded["tokens"] == len(Tokenizer.load(TINY).encode(text)) > 256
    assert len(recorded["sha256"]) == 64
    model = ds2cli.load(dst)
    assert model.quantization.calibration == recorded
    ids = model.tokenizer.encode_chat([{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True)
    cache = model.new_cache(len(ids) + 16)
    logits, out = model.forward(ids, cache), []
    while len(out) < 16 and int(np.argmax(logits)) not in model.eos_token_ids:
        out.append(int(np.argmax(logits)))
        logits = model.forward(out[-1:], cache)
    assert model.tokenizer.decode(out).strip() == "17 + 25 = 42."


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"   \n\n", "is empty"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 40, "not UTF-8 text"),
    (b"ROMEO:\nBut soft, what light through yonder window breaks?\n", "needs at least 256"),
])
def test_bad_calibration_text_is_one_error_line_and_nothing_is_written(tmp_path, content, message):
    text = tmp_path / "calib.txt"
    text.write_bytes(content)
    dst = tmp_path / "out"
    r = CliRunner().invoke(main, ["quantize", str(TINY), str(dst), "--bits", "8", "--calibration", str(text)])
    assert r.exit_code == 1 and message in r.output and r.output.count("error:") == 1, r.output
    assert "Traceback" not in r.output and not dst.exists()


@pytest.mark.slow
def test_a_missing_text_or_an_already_quantized_source_is_an_error(tmp_path, calibrated):
    r = CliRunner().invoke(main, ["quantize", str(TINY), str(tmp_path / "a"), "--bits", "8",
                                  "--calibration", str(tmp_path / "nope.txt")])
    assert r.exit_code == 1 and "does not exist" in r.output
    r = CliRunner().invoke(main, ["quantize", str(calibrated[0]), str(tmp_path / "b"), "--bits", "8",
                                  "--calibration", "builtin"])
    assert r.exit_code == 1 and "already a ds2 low-bit checkpoint" in r.output and "float source" in r.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
