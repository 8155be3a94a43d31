"""Low-bit weights: the formats, the kernels against float32 products of the dequantized
weights, `ds2 quantize` round trips, memory-mapped loading, and quality against float32."""

import json
import random

import numpy as np
import pytest
from click.testing import CliRunner

import ds2cli
from ds2cli.execution.cores import Workers, allowed_cores
from ds2cli.execution.machine import Machine
from ds2cli.model.linear import FEW_TOKENS
from support.machines import quiet_machine
from ds2cli.weights import formats as quant
from ds2cli.weights import scales
from ds2cli.cli.main import main
from ds2cli.weights.formats import Dense
from ds2cli.model.transformer import Step
from ds2cli.weights.source import bundled_model_dir
from ds2cli.weights.qcheckpoint import QuantConfig
from ds2cli.weights.formats import FORMATS, QuantMatrix

SHAPES = [(80, 256), (96, 64), (512, 384), (2, 30, 64)]   # partial last group; several groups; a stack


def weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    w[..., 3, 5] = 0.3              # an outlier, as trained weights have
    return w


@pytest.mark.parametrize("name", ["q8", "q4", "q8b", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("search", [False, True])
def test_round_trip_error_is_at_most_half_a_step(name, shape, search):
    """Round to nearest: every value within half a step (q4: but the far side's extreme). The
    searched scales may clip a row's or group's extremes, when that lowers its error (see
    test_scale_search.py); every value they do not clip is within half a step too. bf16: within
    half a bfloat16 ulp (at most 2^-8 of the value: 7 stored mantissa bits)."""
    f = FORMATS[name]
    w = weights(shape)
    m = QuantMatrix(*scales.quantize(w, f, search=search), f)
    assert m.qweight.dtype == f.qweight_dtype and m.scales.dtype == f.scale_dtype
    assert m.qweight.shape == f.qweight_shape(shape) and m.scales.shape == f.scales_shape(shape)
    assert m.nbytes == f.nbytes_of(shape)
    if name == "bf16":
        assert np.all(m.scales == 1)
        assert np.all(np.abs(m.dequantize() - w) <= np.abs(w) * 2 ** -8)
        return
    if name == "q8":   # one float32 scale per output row
        assert m.scales.dtype == np.float32
        step = np.broadcast_to(m.scales[..., None], shape)
    elif name == "q8b":  # one float32 scale per 32 inputs of a row, stored by panels of R rows
        *lead, panels, nb, r = m.scales.shape
        assert panels * r == shape[-2] and nb * 32 == shape[-1]
        by_row = np.swapaxes(m.scales, -1, -2).reshape(*lead, shape[-2], nb)          # (..., out, nb)
        step = np.repeat(by_row, 32, axis=-1)
    else:              # one bfloat16 scale per 32 output rows of a column
        assert m.scales.dtype == quant.BF16
        step = np.repeat(np.abs(m.scales.astype(np.float32)), 32, axis=-2)[..., :shape[-2], :]
    err = np.abs(m.dequantize() - w)
    tol = 1 + 1e-6
    if search:
        inside = np.abs(w) <= (7.5 if name == "q4" else 127.5) * step
        assert np.all(err[inside] <= step[inside] / 2 * tol) and inside.mean() > 0.9
    elif name in ("q8", "q8b"):
        assert np.all(err <= step / 2 * tol)
    else:
        # Q4_0's range is [-8, 7] steps: the extreme maps to -8 exactly, and a value past 7.5 steps
        # on the other side is clipped to 7, at most one step off
        inside = np.abs(w) <= 7.5 * step
        assert np.all(err[inside] <= step[inside] / 2 * tol) and np.all(err <= step * tol)


def test_bf16_scales_round_up_so_the_extreme_never_clips():
    x = np.array([1.0, 1.0000001, 3.14159, 1e-30, 3e38, -2.5, 0.0], np.float32)
    up = scales.bf16_up(x).astype(np.float32)
    assert np.all(np.abs(up) >= np.abs(x)) and np.all(np.isfinite(up))
    assert np.all(np.abs(up) <= np.abs(x) * (1 + 2 ** -7) + 1e-38)
    w = np.full((32, 4), 0.127, np.float32)
    m = scales.quantize_matrix(w, FORMATS["q8"])
    assert np.all(np.abs(m.qweight) <= 127)


def narrow_panels(m: quant.QuantMatrix, r: int = 8) -> quant.QuantMatrix:
    """q8b `m` laid out again in panels of `r` rows, several a tile as in a large matrix (a
    matrix as small as the tests' is one panel)."""
    q = m.qweight.transpose(0, 2, 1).reshape(m.shape)                           # (out, in)
    s = m.scales.transpose(0, 2, 1).reshape(m.shape[0], -1)                     # (out, in/32)
    return type(m)(*quant.to_panels(q, s, r))


@pytest.mark.parametrize("name, shape", [(name, shape) for name in ["q8", "q4", "q8b", "bf16"]   # (81, 30): odd byte counts
                                         for shape in [(80, 256), (2816 // 8, 2048 // 8), (512, 384), (81, 30)]
                                         if FORMATS[name].supports(shape)])   # q8b: rows of whole 32-blocks
@pytest.mark.parametrize("threaded", [False, True])
def test_kernels_equal_float32_products_of_the_dequantized_weight(name, threaded, shape):
    m = scales.quantize_matrix(weights(shape), FORMATS[name])
    if threaded:  # force the row-block path with its thread split, and chunked prefill
        m = narrow_panels(m) if name == "q8b" else m
        m.small_matrix = 0
        m.l2_block_bytes = 64 * 4 * shape[1]
        m.dequantize_block_bytes = 32 * 4 * shape[1]
        m.prefill_chunk_bytes = 96 * 4 * shape[1]
    w = m.dequantize().astype(np.float64)
    rng = np.random.default_rng(1)
    for tokens in (1, 3, 40, 100):     # 100: more than FEW_TOKENS, a prefill
        x = rng.standard_normal((tokens, shape[1]), dtype=np.float32)
        exact = x.astype(np.float64) @ w.T
        got = m.matmul(x)
        assert got.shape == (tokens, shape[0]) and got.dtype == np.float32
        # float32 rounding of a length-`in` dot product, nothing more
        np.testing.assert_allclose(got, exact, rtol=0, atol=2e-6 * np.abs(exact).max())
    ids = np.array([0, 33, shape[0] - 1, 33])
    np.testing.assert_array_equal(m.rows(ids), m.dequantize()[ids])


def test_stacked_experts_index_like_arrays():
    w = weights((3, 64, 32))
    m = scales.quantize_matrix(w, FORMATS["q4"])
    assert len(m) == 3 and m[1].shape == (64, 32)
    np.testing.assert_array_equal(m[1].dequantize(), m.dequantize()[1])
    d = Dense(w)
    np.testing.assert_array_equal(d[2].w, w[2])                     # expert 2's weight, as stored
    x = w[0, :5, :]
    got = d[2].matmul(x)
    assert got.shape == (5, 64) and got.dtype == np.float32
    # x @ w[2].T, up to float32 rounding: Dense and `@` may call different BLAS kernels
    assert_within_dot_rounding(got, x, w[2])


def assert_within_dot_rounding(got, x, w):
    """got == x @ w.T up to the float32 rounding of its dot products, whatever their order:
    |got - exact| <= gamma_n * (|x| @ |w|.T), gamma_n = n*u / (1 - n*u), n the dot length and u
    float32's unit roundoff (plus float64's own, for the reference)."""
    n = x.shape[-1]
    gamma = sum(n * u / (1 - n * u) for u in (2.0 ** -24, 2.0 ** -53))
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    exact, scale = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    err = np.abs(got.astype(np.float64) - exact)
    assert np.all(err <= gamma * scale), f"worst excess {(err - gamma * scale).max():.2e}"


def test_four_bit_needs_an_even_input_width_else_the_matrix_stays_float():
    from ds2cli.weights.qcheckpoint import format_for
    qc = QuantConfig.recipe(4)
    assert format_for(qc, "mlp", "experts_down", (4, 64, 31)) is None
    assert format_for(qc, "mlp", "experts_down", (4, 64, 32)).name == "q4"
    assert format_for(qc, "attn", "o_proj", (64, 31)).name == "q8"


# ---- quantize, load, inspect ----

@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    out = {}
    for bits in (8, 4):
        dst = tmp_path_factory.mktemp("q") / f"tiny-q{bits}"
        r = CliRunner().invoke(main, ["quantize", str(bundled_model_dir()), str(dst), "--bits", str(bits)])
        assert r.exit_code == 0, r.output
        out[bits] = dst
    return out


@pytest.mark.slow
def test_quantized_checkpoint_is_self_describing(quantized):
    for bits, path in quantized.items():
        config = json.loads((path / "config.json").read_text())
        qc = config["quantization_config"]
        assert qc["quant_method"] == "ds2" and qc["bits"] == bits and qc["version"] == 2
        assert qc["format_specs"]["q8"]["scale_group"] == "row"
        assert bits == 8 or qc["format_specs"]["q4"]["group_size"] == 32
        assert qc["formats"]["routed_experts"] == ("q8" if bits == 8 else "q4")
        # the recipes (qcheckpoint.RECIPES): 8-bit keeps attention, the dense MLP and the
        # embedding bfloat16; 4-bit keeps everything but the routed experts 8-bit
        want = {8: {"attention": "bf16", "dense_mlp": "bf16", "embed_tokens": "bf16", "shared_experts": "q8",
                    "lm_head": "q8"},
                4: {"attention": "q8", "dense_mlp": "q8", "embed_tokens": "q8", "shared_experts": "q8",
                    "lm_head": "q8"}}[bits]
        assert {role: qc["formats"][role] for role in want} == want
        assert qc["format_specs"].get("bf16", {}).get("scale_value", 1) == 1
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert "model.layers.1.mlp.experts_gate_up.qweight" in index["weight_map"]
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (path / name).read_bytes() == (bundled_model_dir() / name).read_bytes()
        shards = sorted(path.glob("*.safetensors"))
        assert len(shards) == 7 and not list(path.parent.glob(".*partial*"))


@pytest.mark.slow
def test_a_copy_s_readme_says_its_format_and_its_source(quantized):
    """ds2-tiny's README says "stored in bfloat16": the copy's README.md says what the copy is,
    role by role from its config, and keeps the source's card, unchanged, under another name."""
    source = (bundled_model_dir() / "README.md").read_bytes()
    words = {"q8": "int8, a float32 scale a row", "q4": "4-bit, a bfloat16 scale a group of 32", "bf16": "bfloat16"}
    for bits, path in quantized.items():
        readme = (path / "README.md").read_text(encoding="utf-8")
        formats = json.loads((path / "config.json").read_text())["quantization_config"]["formats"]
        assert readme.startswith(f"# ds2-tiny, {bits}-bit (ds2)\n") and f"ds2 quantize --bits {bits}" in readme
        assert "stored in bfloat16" not in readme and "README.source.md" in readme
        for role, name in formats.items():
            assert f"- {role}: {words[name]}\n" in readme
        assert (path / "README.source.md").read_bytes() == source


@pytest.mark.slow
def test_a_copy_s_readme_carries_the_source_card_s_front_matter(tmp_path):
    import shutil
    from ds2cli.weights.quantize import quantize_checkpoint
    src = tmp_path / "src"
    shutil.copytree(bundled_model_dir(), src)
    (src / "README.md").write_text("---\nlicense: mit\ntags: [tiny]\n---\n# a card\nstored in bfloat16\n")
    quantize_checkpoint(src, tmp_path / "q8", 8)
    readme = (tmp_path / "q8" / "README.md").read_text()
    assert readme.startswith("---\nlicense: mit\ntags: [tiny]\n---\n# src, 8-bit (ds2)\n")
    assert "stored in bfloat16" not in readme


def test_the_unquantized_matrices_are_stored_bfloat16(quantized):
    """w_uk, w_uv and the router gate, which no recipe quantizes, are stored bfloat16 (from a
    float32 source, rounded to nearest); ds2-tiny is a bfloat16 checkpoint, so they hold its
    values exactly. The model widens them to float32 for its products."""
    from ds2cli.weights import checkpoint
    from ds2cli.weights.qcheckpoint import UNQUANTIZED_MATRICES, stored_name
    source = ds2cli.load(None)
    for bits, path in quantized.items():
        assert json.loads((path / "config.json").read_text())["quantization_config"]["unquantized"] == "bf16"
        headers, mapped, seen = checkpoint.read_headers(path), ds2cli.load(path), 0
        for i, layer in enumerate(mapped.layers):
            for part, key in UNQUANTIZED_MATRICES:
                if key in layer.part(part):
                    assert headers[stored_name(i, part, key) + ".weight"].dtype == "BF16"
                    stored, float = (getattr(w, "w", w) for w in (layer.part(part)[key], source.layers[i].part(part)[key]))
                    np.testing.assert_array_equal(stored.astype(np.float32), float)   # w_uk, w_uv: linear.Heads
                    seen += 1
        assert seen == 3 * (len(mapped.layers) - 1) + 2      # one dense layer, without a gate


@pytest.mark.slow
def test_loading_is_a_memory_map_and_equals_quantizing_at_load(quantized):
    ids = [0, 74, 75, 76, 77, 300, 12]
    for bits, path in quantized.items():
        mapped = ds2cli.load(path)
        w = mapped.layers[1].mlp.experts_gate_up
        assert isinstance(w, QuantMatrix)
        base = w.qweight
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        base = base.obj if isinstance(base, memoryview) else base
        assert type(base).__name__ == "mmap" and not w.qweight.flags.writeable
        in_memory = ds2cli.load(quantize=bits)
        a = mapped.forward(ids, mapped.new_cache(16), all_logits=True)
        b = in_memory.forward(ids, in_memory.new_cache(16), all_logits=True)
        np.testing.assert_array_equal(a, b)
        assert mapped.quantization.bits == bits


@pytest.mark.slow
def test_every_command_takes_the_quantized_checkpoint(quantized):
    r = CliRunner().invoke(main, ["generate", "-m", str(quantized[8]), "--chat", "What is 451 - 123?",
                                  "--temperature", "0"])
    assert r.exit_code == 0 and r.output == "451 - 123 = 328.\n"
    r = CliRunner().invoke(main, ["chat", "-m", str(quantized[4]), "--temperature", "0"], input="What is 17 + 25?\n")
    assert r.exit_code == 0 and "17 + 25 = 42." in r.output
    r = CliRunner().invoke(main, ["inspect", "--json", str(quantized[4])])
    report = json.loads(r.stdout)
    assert r.exit_code == 0 and report["problems"] == []
    assert report["quantization"]["bits"] == 4 and report["params"] == 7887232
    assert report["quantization"]["file_bytes"] == sum(p.stat().st_size for p in quantized[4].glob("*.safetensors"))
    r = CliRunner().invoke(main, ["inspect", "--json"])
    report = json.loads(r.stdout)
    formats = {f["format"]: f for f in report["memory"]["formats"]}
    assert report["quantization"] is None and set(formats) == {"float32", "8-bit", "4-bit"}
    assert formats["float32"]["weight_bytes"] == 4 * report["params"]
    # 8-bit holds the embedding (a third of ds2-tiny) as bfloat16: 0.34x of float32, not 0.27x
    assert formats["4-bit"]["weight_bytes"] < formats["8-bit"]["weight_bytes"] < formats["float32"]["weight_bytes"] / 2.8


def test_sizes_match_the_files(quantized):
    """memory.weight_bytes (used by inspect, the memory check and quantize's disk check) is the
    sum of the tensors written, to the byte."""
    from ds2cli.weights import checkpoint
    from ds2cli.weights import memory
    cfg = ds2cli.DeepseekV2Config.from_file(bundled_model_dir() / "config.json")
    for bits, path in quantized.items():
        stored = sum(t.nbytes for t in checkpoint.read_headers(path).values())
        assert memory.weight_bytes(cfg, QuantConfig.recipe(bits)) == stored
    assert memory.weight_bytes(cfg, None) == 4 * 7887232


# ---- quality against float32 on ds2-tiny ----

def sampled_text(model, n_seqs=6, length=160, seed=0):
    """n_seqs sequences of `length` tokens sampled from the model at temperature 1. The very text
    that sampling one sequence after the other with `rng.choice(len(p), p=p)` gives (the same
    uniform draw a token, in the same order, through the same inverse CDF in float64), but all
    sequences advance in one forward_batch pass a step: ~4 s rather than ~14 s. The thresholds
    below were set on this text: another sample would move KL and top-1 across them."""
    u = np.random.default_rng(seed).random((n_seqs, length))    # sequence k's j-th draw: rng's (k*length+j)-th
    seqs = []
    for k in range(n_seqs):
        prompt = ["ROMEO:\n", "What is 12 + 34?", "KING.\n"][k % 3]
        ids = (model.tokenizer.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
               if "?" in prompt else model.tokenizer.encode(prompt))
        seqs.append(list(ids))
    caches = [model.new_cache(len(ids) + length) for ids in seqs]
    logits = model.forward_batch([Step(ids, cache) for ids, cache in zip(seqs, caches)])
    for j in range(length):
        for k, (out, row) in enumerate(zip(seqs, logits)):
            p = np.exp(row - row.max())
            cdf = (p / p.sum()).astype(np.float64).cumsum()     # as Generator.choice(n, p=p) does
            out.append(int(np.searchsorted(cdf / cdf[-1], u[k, j], side="right")))
        if j < length - 1:
            logits = model.forward_batch([Step(out[-1:], cache) for out, cache in zip(seqs, caches)])
    return seqs


def log_softmax(x):
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def additions(model, n=100, max_new_tokens=24):
    """How many of n random two-digit additions the model answers right, greedily through its chat
    template: examples/arithmetic.py's `ask` for every question, its loop unchanged, but all the
    questions in one forward_batch pass a step (as the server batches them) rather than one
    question at a time: each question has its own cache and its rows run independently, so the
    answers are `ask`'s (all 100 equal, float32, 8-bit and 4-bit, when this was written) in ~1 s
    rather than ~25 s. test_examples.py still runs `ask` itself, one question at a time."""
    rng, questions, want = random.Random(0), [], []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        questions.append(f"What is {a} + {b}?")
        want.append(f"{a} + {b} = {a + b}.")
    ids = [model.tokenizer.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True)
           for q in questions]
    caches = [model.new_cache(len(t) + max_new_tokens) for t in ids]
    logits = model.forward_batch([Step(t, c) for t, c in zip(ids, caches)])
    out, live = [[] for _ in questions], list(range(n))
    for step in range(max_new_tokens):
        going = []
        for k, row in zip(live, logits):
            token = int(np.argmax(row))
            if token not in model.eos_token_ids:       # ask's `break`: this question is done
                out[k].append(token)
                going.append(k)
        live = going
        if not live or step == max_new_tokens - 1:
            break
        logits = model.forward_batch([Step([out[k][-1]], caches[k]) for k in live])
    return sum(model.tokenizer.decode(o).strip() == w for o, w in zip(out, want))


@pytest.fixture(scope="module")
def float_model():
    return ds2cli.load()


@pytest.fixture(scope="module")
def reference(float_model):
    """Text sampled from the float32 model and the float32 next-token log-probabilities on it."""
    seqs = sampled_text(float_model)
    return seqs, np.concatenate([log_softmax(float_model.forward(s, float_model.new_cache(len(s)), all_logits=True))
                                 for s in seqs])


@pytest.mark.slow
@pytest.mark.parametrize("bits, max_kl, min_top1, min_additions", [(8, 9e-3, 0.965, 100), (4, 0.20, 0.78, 98)])
def test_quality_against_float32(reference, bits, max_kl, min_top1, min_additions):
    seqs, ref = reference
    q = ds2cli.load(quantize=bits)
    got = np.concatenate([log_softmax(q.forward(s, q.new_cache(len(s)), all_logits=True)) for s in seqs])
    assert len(ref) > 900
    kl = float((np.exp(ref) * (ref - got)).sum(-1).mean())
    top1 = float((ref.argmax(-1) == got.argmax(-1)).mean())
    assert kl <= max_kl and top1 >= min_top1, (kl, top1)
    assert additions(q) >= min_additions


@pytest.mark.slow
@pytest.mark.skipif(allowed_cores() < 2, reason="needs two cores")
def test_a_low_bit_prefill_shares_its_heads_across_the_cores(monkeypatch):
    machine = quiet_machine()
    model = ds2cli.load(quantize=8, machine=machine)
    ids = list(range(0, 800, 10))      # more than FEW_TOKENS: a prefill, not a few-token pass
    assert len(ids) > FEW_TOKENS
    splits = []
    real = machine.workers.heads

    def spy(n, tokens):                # how a sequence's heads are cut for the cores
        splits.append(real(n, tokens))
        return splits[-1]

    monkeypatch.setattr(machine.workers, "heads", spy)
    shared = model.forward(ids, model.new_cache(128), all_logits=True)
    heads = model.config.num_attention_heads
    assert len(splits) == model.config.num_hidden_layers
    assert all(len(s) == machine.workers.n and s[0].start == 0 and s[-1].stop == heads for s in splits)
    one_core = ds2cli.load(quantize=8, machine=Machine(threads=1))   # every head in one call
    whole = one_core.forward(ids, one_core.new_cache(128), all_logits=True)
    np.testing.assert_allclose(shared, whole, rtol=0, atol=1e-5 * np.abs(whole).max())


def test_the_cores_take_the_next_item_when_they_are_free():
    """Workers.map hands items out one at a time: a core held up by a long item leaves the rest
    to the other cores, rather than owning every other item from the start."""
    import threading
    pool = Workers(2)
    pool.held = 1                    # as in a low-bit forward pass: items go to both cores
    ran, done, lock, rest_done = {}, set(), threading.Lock(), threading.Event()

    def run(k: int) -> int:
        ran[k] = threading.get_ident()
        if k == 0:
            # held up until items 1..5 are done: by the other core, if it takes the next item
            # when free (a core that owned some of them from the start would leave this wait
            # to its deadline, then run them itself, and the check below fails)
            rest_done.wait(60)
        else:
            with lock:
                done.add(k)
                if len(done) == 5:
                    rest_done.set()
        return k * k

    assert pool.lanes == 2
    assert pool.map(run, range(6)) == [k * k for k in range(6)]
    assert len({ran[k] for k in range(1, 6)}) == 1 and ran[1] != ran[0]
    pool.pool.shutdown()


def test_an_item_that_fails_stops_the_other_cores_after_their_current_one():
    """Ctrl-C (or any error) in one core's item: the others take no new items, and map raises."""
    import threading
    pool = Workers(2)
    pool.held = 1
    started = []
    # the pool's one thread is busy until item 0 has begun, so this thread's core takes item 0
    # and the pool's core item 1 (and further items, if the failure did not stop it)
    item0_began, other_began, failed = threading.Event(), threading.Event(), threading.Event()
    pool.pool.submit(item0_began.wait, 60)

    def run(k: int) -> int:
        started.append(k)
        if k == 0:
            item0_began.set()
            other_began.wait(60)     # the other core is in the middle of an item
            raise KeyboardInterrupt
        other_began.set()
        failed.wait(60)              # its current item ends only once map has raised
        return k

    with pytest.raises(KeyboardInterrupt):
        pool.map(run, range(50))
    failed.set()
    pool.pool.shutdown(wait=True)    # the other core's item ends; it must not start more
    assert len(started) < 10


# ---- the routed experts, quantized an expert at a time as they load ----

@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_experts_quantized_as_they_load_equal_the_whole_stack_quantized(bits):
    """Loading with --quantize, each routed expert is quantized once it is read; every integer
    and scale equals quantizing the layer's float32 stack at once (the same per-matrix search)."""
    source, low = ds2cli.load(None), ds2cli.load(None, quantize=bits)
    qc, seen = QuantConfig.recipe(bits), 0
    for float_layer, layer in zip(source.layers, low.layers):
        for key in ("experts_gate_up", "experts_down"):
            if key in layer.mlp:
                w = float_layer.mlp[key].w                                  # (E, out, in)
                q, s = scales.quantize(w, qc.format_of("mlp", key))
                assert layer.mlp[key].f is qc.format_of("mlp", key)
                np.testing.assert_array_equal(layer.mlp[key].qweight, q)
                np.testing.assert_array_equal(layer.mlp[key].scales, s)
                seen += 1
    assert seen == 2 * (len(source.layers) - 1)


def test_a_layer_loading_never_holds_its_float32_expert_stack():
    """With a batch of one expert, loading a MoE layer with a recipe allocates at most a few
    experts' float32 at once: far less than its (E, 2I, D) + (E, D, I) float32 stacks, which
    loading it as float32 allocates."""
    import tracemalloc

    from ds2cli.weights import checkpoint
    from ds2cli.weights import loader
    path = bundled_model_dir()
    cfg = ds2cli.DeepseekV2Config.from_file(path / "config.json")
    tensors = checkpoint.validate(cfg, path)
    names = loader.names_by_layer(tensors, cfg.num_hidden_layers)[1]
    names = sorted(names, reverse=True)   # any order: an expert's tensors are read together
    E, inter, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    stacks = E * 3 * inter * D * 4

    def peak(qc):
        tracemalloc.start()
        layer = loader.load_layer(tensors, names, cfg, 1, qc, expert_batch=1)   # one expert at a time
        top = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return layer, top

    peak(QuantConfig.recipe(4))           # once first: what the first quantization allocates for good
    as_float, float_peak = peak(None)
    layer, low_peak = peak(QuantConfig.recipe(4))
    assert isinstance(layer.mlp.experts_gate_up, QuantMatrix)
    assert float_peak > stacks and float_peak - low_peak > (E - 4) * 3 * inter * D * 4
    np.testing.assert_array_equal(layer.mlp.experts_down.dequantize(),
                                  scales.quantize_matrix(as_float.mlp.experts_down.w, FORMATS["q4"]).dequantize())


def test_an_expert_stack_names_the_experts_it_never_got_whole():
    from ds2cli.weights.qcheckpoint import ExpertStack
    stack = ExpertStack((3, 4, 32), FORMATS["q8"])
    rng = np.random.default_rng(0)
    stack[0, slice(0, 4)] = rng.standard_normal((4, 32))
    stack[2, slice(0, 2)] = rng.standard_normal((2, 32))
    with pytest.raises(quant.QuantError, match=r"experts \[1, 2\]"):
        stack.finish()


def test_the_memory_check_counts_a_few_experts_in_float32_not_the_layer():
    """memory.required's staging for quantizing at load: V2-Lite's largest float32 layer less
    its routed experts, plus two batches and one expert (0.44 GB, where a whole MoE layer is
    2.3 GB and the dense layer 0.33)."""
    from ds2cli.weights import memory
    from ds2cli.weights import qcheckpoint
    from ds2cli.cli.bench.synthetic import lite_config
    cfg = ds2cli.DeepseekV2Config.from_dict(lite_config(27))
    expert = 3 * 1408 * 2048 * 4
    for bits in (8, 4):
        qc = QuantConfig.recipe(bits)
        moe = memory.staging_bytes(cfg, 1, qc)
        assert moe == memory.layer_bytes(cfg, 1, None) - (64 - 2 * qcheckpoint.EXPERT_BATCH - 1) * expert
        assert memory.staging_bytes(cfg, 0, qc) == memory.layer_bytes(cfg, 0, None)     # dense: whole
        need, old = memory.required(cfg, qc, 128, quantize_at_load=True), memory.layer_bytes(cfg, 1, None)
        assert need["margin"] == memory.required(cfg, qc, 128)["margin"] + max(moe, memory.layer_bytes(cfg, 0, None))
        assert 0.4e9 < moe < 0.5e9 < 2.2e9 < old
