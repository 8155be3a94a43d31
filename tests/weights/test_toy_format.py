"""A weight format defined here, outside ds2, runs end to end: quantized into a checkpoint, loaded,
multiplied through by the default executor (its rows cut over the cores and the helper
processes) and by the reference one, and reported by `ds2 inspect`, without touching the
formats ds2 ships. The format: u8, a byte a weight with one float32 scale a row, value =
(q - 128) * s[o]."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from ds2cli.model.executor import Executor
from ds2cli.weights import loader, qcheckpoint, source
from ds2cli.weights.formats import FORMATS, QuantMatrix
from ds2cli.weights.formats.base import row_block
from ds2cli.weights.quantize import quantize_checkpoint

pytestmark = pytest.mark.slow      # left out of `pytest -m "not slow"` (docs/internals.md, Tests)


class U8(QuantMatrix):
    name, bits = "u8", 8
    qweight_dtype = np.dtype(np.uint8)
    scale_dtype = np.dtype(np.float32)
    small_matrix = 0                  # every product cut for the cores, ds2-tiny's as V2-Lite's are

    @classmethod
    def spec(cls) -> dict:
        return {"bits": 8, "qweight": "uint8", "offset": 128, "scales": "float32", "scale_group": "row"}

    @classmethod
    def quantize(cls, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = np.abs(w).max(axis=1) / np.float32(127)
        s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
        return (np.clip(np.rint(w / s[:, None]), -127, 127) + 128).astype(np.uint8), s

    @classmethod
    def unpack(cls, qweight: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = super().unpack(qweight, out)
        out -= np.float32(128)
        return out

    @classmethod
    def scale_rows(cls, w: np.ndarray, scales: np.ndarray, r0: int) -> None:
        w *= scales[r0:r0 + len(w), None]

    def scale_gathered(self, w: np.ndarray, ids: np.ndarray) -> None:
        w *= self.scales[ids][:, None]

    def span_gemv(self, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
        inp = self.shape[1]
        block = row_block(inp, self.ROW_ALIGN)
        for r0 in range(a, b, block):
            r1 = min(b, r0 + block)
            w = self.unpack(self.qweight[r0:r1])
            self.scale_rows(w, self.scales, r0)
            y[:, r0:r1] = x @ w.T


@pytest.fixture
def u8(monkeypatch):
    monkeypatch.setitem(FORMATS, "u8", U8)
    monkeypatch.setitem(qcheckpoint.RECIPES, 8, {**qcheckpoint.RECIPES[8], "routed_experts": "u8", "lm_head": "u8",
                                                 "attention": "u8"})
    return U8


def test_a_format_of_ones_own_loads_runs_and_is_inspected(u8, tmp_path):
    dst = tmp_path / "tiny-u8"
    quantize_checkpoint(source.bundled_model_dir(), dst, 8)
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert config["formats"]["routed_experts"] == "u8" and config["format_specs"]["u8"] == U8.spec()

    model = loader.load(dst)
    experts = model.layers[1].mlp.experts_gate_up
    assert isinstance(experts, U8) and experts.qweight.dtype == np.uint8
    assert isinstance(model.layers[0].self_attn.kv_a_proj_with_mqa, U8)

    # the same logits whoever multiplies: the cores and helpers, or the calling thread alone
    ids = model.tokenizer.encode("What is 2 + 2?")
    cores = model.forward(ids, model.new_cache(64), all_logits=True)
    model.executor = Executor()
    alone = model.forward(ids, model.new_cache(64), all_logits=True)
    np.testing.assert_allclose(cores, alone, rtol=0, atol=1e-4 * np.abs(alone).max())

    # close to the float model: the format's rounding, nothing else
    float_model = loader.load(None)             # the calling thread: the reference executor
    want = float_model.forward(ids, float_model.new_cache(64), all_logits=True)
    p, q = softmax(want), softmax(alone)
    kl = float(np.mean(np.sum(p * (np.log(p) - np.log(q)), axis=-1)))
    assert kl < 0.05 and (np.argmax(want, -1) == np.argmax(alone, -1)).mean() > 0.9

    from ds2cli.cli.main import main as cli
    result = CliRunner().invoke(cli, ["inspect", str(dst), "--json"])
    assert result.exit_code == 0, result.output
    assert "u8" in result.output


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.exp(x - x.max(axis=-1, keepdims=True), dtype=np.float64)
    return x / x.sum(axis=-1, keepdims=True)
