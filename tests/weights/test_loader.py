"""loader.py on its own: the form a checkpoint loads in (load_form), a range of layers with only
the top weights it needs, and what it refuses before reading a weight."""

import numpy as np
import pytest

import ds2cli
from ds2cli.errors import ConfigError
from ds2cli.model.layers import Layer
from ds2cli.weights.loader import formats_of, load_form, names_by_layer
from ds2cli.weights.quantize import quantize_checkpoint
from ds2cli.weights.source import bundled_model_dir, open_model


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    out = tmp_path_factory.mktemp("loader") / "tiny-q4"
    quantize_checkpoint(bundled_model_dir(), out, 4)
    return out


@pytest.mark.slow
def test_the_form_of_a_float_and_of_a_low_bit_checkpoint(q4):
    tiny = open_model(bundled_model_dir())
    assert load_form(tiny, None) == (None, None) and formats_of(tiny, None, None) is None
    assert load_form(tiny, 8)[0] == 8 and formats_of(tiny, 8, None).bits == 8
    stored = open_model(q4)
    assert load_form(stored, None) == (None, None) and formats_of(stored, None, None).bits == 4
    with pytest.raises(ConfigError, match="already a 4-bit ds2 checkpoint"):
        load_form(stored, 8)
    with pytest.raises(ConfigError, match="keeps a Q8_0 GGUF's own blocks"):
        load_form(tiny, "exact")
    with pytest.raises(ConfigError, match="quantize must be"):
        load_form(tiny, 3)


@pytest.mark.parametrize("where", ["float", "q4"])
def test_a_range_of_layers_loads_those_and_the_top_weights_it_needs(where, q4):
    path = bundled_model_dir() if where == "float" else q4
    L = open_model(path).config.num_hidden_layers
    first, middle, last = (ds2cli.load(path, layers=r) for r in (range(0, 2), range(2, 4), range(4, L)))
    assert first.embed_tokens is not None and first.lm_head is None and first.norm is None
    assert middle.embed_tokens is None and middle.lm_head is None
    assert last.lm_head is not None and last.norm is not None and last.embed_tokens is None
    assert [isinstance(x, Layer) for x in middle.layers] == [False, False, True, True] + [False] * (L - 4)


def test_every_layer_finds_its_tensors_in_one_pass():
    source = open_model(bundled_model_dir())
    names = names_by_layer(source.tensors, source.config.num_hidden_layers)
    assert all(all(n.startswith(f"model.layers.{i}.") for n in layer) and layer for i, layer in enumerate(names))


def test_loading_the_same_checkpoint_twice_gives_the_same_weights():
    a, b = ds2cli.load(bundled_model_dir()), ds2cli.load(bundled_model_dir())
    np.testing.assert_array_equal(a.layers[0].self_attn.o_proj.w, b.layers[0].self_attn.o_proj.w)


def test_bfloat16_read_from_bits_equals_ml_dtypes_values(tmp_path):
    import ml_dtypes
    from safetensors.numpy import save_file
    from ds2cli.model.linear import bfloat16_bits
    from ds2cli.weights import checkpoint
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((33, 70)) * np.exp(rng.uniform(-30, 30, (33, 70)))).astype(np.float32)
    x[0, :4] = [0.0, -0.0, 1e-40, 3.3895314e38]                          # zeros, a subnormal, near max
    stored = x.astype(ml_dtypes.bfloat16)
    save_file({"w": stored, "b": np.ones(3, np.float32)}, str(tmp_path / "model.safetensors"))
    tensors = checkpoint.read_header(tmp_path / "model.safetensors")
    got = dict(checkpoint.iter_tensors(tensors, ["w", "b"]))
    assert got["w"].dtype == np.float32 and np.array_equal(got["w"], stored.astype(np.float32))
    assert np.array_equal(got["b"], np.ones(3, np.float32))
    assert np.array_equal(bfloat16_bits(x), stored.view(np.uint16))     # rounds as ml_dtypes does


@pytest.mark.slow
@pytest.mark.parametrize("where", ["float", "quantized at load", "q4"])
def test_a_range_of_experts_loads_those_experts_of_every_moe_layer_alone(where, q4):
    """load(experts=...): a node of a cluster spread by experts holds those routed experts of
    every MoE layer (stacked from 0, the same values as the whole model's), and of the layers
    outside its range nothing else."""
    path = q4 if where == "q4" else bundled_model_dir()
    quantize = 8 if where == "quantized at load" else None
    whole = ds2cli.load(path, quantize=quantize, memory_check=False)
    cfg = whole.config
    E = cfg.n_routed_experts
    part = ds2cli.load(path, quantize=quantize, memory_check=False, layers=range(0, 1), experts=range(E // 2, E))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, cfg.hidden_size)).astype(np.float32)
    for i in range(cfg.num_hidden_layers):
        layer = part.layers[i]
        if not cfg.is_moe_layer(i):
            assert layer is None or i == 0
            continue
        mlp = layer.mlp
        assert len(mlp.experts_down) == E - E // 2
        for e in (E // 2, E - 1):
            got = mlp.experts_gate_up[e - E // 2].matmul(x)
            assert np.array_equal(got, whole.layers[i].mlp.experts_gate_up[e].matmul(x))
        if i != 0:
            assert not layer.self_attn.keys() and mlp.gate is None and mlp.shared_gate_up is None
    # no experts at all: the layers' other weights alone
    bare = ds2cli.load(path, quantize=quantize, memory_check=False, layers=range(0, 2), experts=range(0))
    assert all(layer.mlp.experts_gate_up is None and layer.self_attn.keys() for layer in bare.layers[:2]
               if layer.is_moe)
    assert all(layer is None for layer in bare.layers[2:])
