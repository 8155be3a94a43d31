"""`ds2 bench`: the figures it reports on ds2-tiny, its byte and FLOP accounting against counts
made here from the config, and the synthetic checkpoint it writes."""

import json
import os
import math
import re
import sys
from collections import namedtuple
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from support.documented_json import check_against_docs
from safetensors import safe_open

import ds2cli
from ds2cli.weights import checkpoint
from ds2cli.cli.bench import bench, compare_hf, formats, synthetic
from ds2cli.cli.bench import probes as probes_module
from conftest import use_small_probes
from ds2cli.cli.bench import report as report_module
from ds2cli.cli.bench.settings import BenchError
from ds2cli.cli.bench.synthetic import lite_config, synthesise
from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights.source import bundled_model_dir
from ds2cli.wording import human_bytes, human_count

TINY_ARGS = ["--repeats", "1", "--contexts", "16,64", "--prompt-lengths", "4,16", "--decode-steps", "2", "--json"]


def run_bench(*args):
    return CliRunner().invoke(bench, ["-m", str(bundled_model_dir()), *args])


@pytest.fixture(scope="module")
def report():
    with pytest.MonkeyPatch.context() as mp:
        use_small_probes(mp)
        result = run_bench(*TINY_ARGS)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def tiny():
    return DeepseekV2Config.from_file(bundled_model_dir() / "config.json")


def numbers(x):
    """Every number inside a JSON value (bools aside)."""
    if isinstance(x, dict):
        return [n for v in x.values() for n in numbers(v)]
    if isinstance(x, list):
        return [n for v in x for n in numbers(v)]
    return [x] if isinstance(x, (int, float)) and not isinstance(x, bool) else []


@pytest.mark.slow
def test_every_figure_is_there_positive_and_finite(report):
    assert report["settings"] == {"repeats": 1, "prompt_lengths": [4, 16], "contexts": [16, 64],
                                  "decode_steps": 2, "passes": [2, 4]}
    # passes of k tokens after the smallest context, each against a decode step of the same repeat
    assert [(p["tokens"], p["context"]) for p in report["passes"]] == [(2, 16), (4, 16)]
    for p in report["passes"]:
        assert p["step_ratio"]["median"] > 0 and p["pass_s"]["median"] > 0
        assert 1 <= p["routed_experts_per_layer"] <= 64 and p["weight_bytes"] > 0
    assert [p["tokens"] for p in report["prefill"]] == [4, 16]
    assert [d["context"] for d in report["decode"]] == [16, 64]
    probes = [report["probes"]["matvec"]["gb_per_s"],
              *(g["gflop_per_s"] for g in report["probes"]["gemm"].values())]
    measured = [report["load_s"], *(p[k] for p in report["prefill"] for k in ("tok_per_s", "gflop_per_s")),
                *(d["tok_per_s"] for d in report["decode"])]
    beside = [point["probes"][k] for point in report["prefill"] + report["decode"]
              for k in ("matvec_gb_per_s", "gemm_gflop_per_s")]
    for s in probes + beside + measured:
        assert set(s) == {"min", "median", "max", "runs"}
        assert s["min"] <= s["median"] <= s["max"]
    assert all(len(s["runs"]) == 1 for s in measured)
    assert all(len(s["runs"]) == probes_module.PROBE_RUNS for s in probes)
    for key in ("gflop", "gemm_ratio", "routed_experts", "weight_bytes", "weight_gb_per_s", "matvec_ratio"):
        assert all(key in p for p in report["prefill"])
    for key in ("routed_experts_per_step", "weight_bytes_per_token", "cache_bytes_per_token",
                "bytes_per_token", "gb_per_s", "matvec_ratio"):
        assert all(key in d for d in report["decode"])
    assert set(report["memory"]) == {"peak_rss_bytes", "helper_private_bytes", "weight_bytes", "float32_weight_bytes", "cache_bytes", "rss_ratio"}
    assert report["memory"]["helper_private_bytes"] >= 0     # 0 for a float32 model: no helpers
    memory = {k: v for k, v in report["memory"].items() if k != "helper_private_bytes"}
    figures = numbers([report[k] for k in ("probes", "load_s", "prefill", "decode", "model")] + [memory])
    assert figures and all(math.isfinite(n) and n > 0 for n in figures)
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["numpy"] == np.__version__


Dims = namedtuple("Dims", "D V H d R C v")


def dims(cfg):
    return Dims(cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.qk_nope_head_dim,
                cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim)


def attention_params(cfg):
    D, V, H, d, R, C, v = dims(cfg)
    q = cfg.q_lora_rank * D + cfg.q_lora_rank + H * (d + R) * cfg.q_lora_rank  # q_a_proj, q_a_layernorm, q_b
    return q + (C + R) * D + C + H * (d + v) * C + D * H * v  # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj


def weight_params(cfg, routed_experts, tokens=1):
    """Parameters one forward reads when its gates picked `routed_experts` distinct routed experts
    over all MoE layers, counted here from the config."""
    D, V = cfg.hidden_size, cfg.vocab_size
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    expert = 3 * cfg.moe_intermediate_size * D
    return (tokens * D + D + V * D                                       # embedding rows, norm, lm_head
            + cfg.num_hidden_layers * (2 * D + attention_params(cfg))    # layer norms, attention
            + cfg.first_k_dense_replace * 3 * cfg.intermediate_size * D
            + moe_layers * (cfg.n_routed_experts * D + cfg.n_shared_experts * expert)  # router, shared
            + routed_experts * expert)


def test_json_is_what_the_page_says(report):
    check_against_docs("bench", report)
    assert report["model"]["path"] == str(bundled_model_dir())


def test_each_point_says_the_cores_it_was_given_and_kept_busy(report):
    """Every prefill, decode and pass point's `cores`: the machine's bound (`threads`), the cores
    its passes were given (at most that), and the CPU seconds a second this process and its
    helpers spent (cli/cores_used.py). These points last a few milliseconds, to which the
    kernel's count of the other threads' time is a scheduler tick behind: busy is only some."""
    for point in report["prefill"] + report["decode"] + report["passes"]:
        c = point["cores"]
        assert set(c) == {"threads", "given", "busy"} and 1 <= c["threads"] <= os.cpu_count()
        assert 1 <= c["given"]["min"] <= c["given"]["median"] <= c["given"]["max"] <= c["threads"]
        assert c["busy"] > 0


@pytest.mark.slow
def test_threads_bound_the_cores_every_figure_had(small_probes):
    """--threads 1 reaches the model's machine, not only BLAS: an 8-bit run (whose kernels would
    use every core and a helper process) is given one core in every pass, and over points of a
    tenth of a second or more keeps busy some of the machine's CPUs, never more than there are."""
    result = run_bench("--repeats", "3", "--contexts", "64", "--prompt-lengths", "256", "--decode-steps", "24",
                       "--passes", "4", "--json", "--quantize", "8", "--threads", "1")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for point in report["prefill"] + report["decode"] + report["passes"]:
        assert point["cores"]["threads"] == 1 and point["cores"]["given"] == {"min": 1, "median": 1, "max": 1}
        assert 0 < point["cores"]["busy"] <= os.cpu_count()
    assert report["memory"]["helper_private_bytes"] == 0                 # no helper forked


def test_decode_weight_bytes_match_a_count_from_the_config(report, tiny):
    moe_layers = tiny.num_hidden_layers - tiny.first_k_dense_replace
    for point in report["decode"]:
        # one token picks num_experts_per_tok distinct experts in every MoE layer
        assert point["routed_experts_per_step"] == moe_layers * tiny.num_experts_per_tok
        assert point["weight_bytes_per_token"] == 4 * weight_params(tiny, point["routed_experts_per_step"])
        # steps at positions context .. context+1 attend to context+1 and context+2 positions
        cache = 4 * tiny.num_hidden_layers * (tiny.kv_lora_rank + tiny.qk_rope_head_dim) * (point["context"] + 1.5)
        assert point["cache_bytes_per_token"] == cache
        assert point["gb_per_s"] == pytest.approx(point["bytes_per_token"] * point["tok_per_s"]["median"] / 1e9)


def test_prefill_weight_bytes_count_each_picked_expert_once(report, tiny):
    moe_layers = tiny.num_hidden_layers - tiny.first_k_dense_replace
    for point in report["prefill"]:
        T = point["tokens"]
        assert moe_layers * tiny.num_experts_per_tok < point["routed_experts"]
        assert point["routed_experts"] <= moe_layers * min(tiny.n_routed_experts, T * tiny.num_experts_per_tok)
        assert point["weight_bytes"] == 4 * weight_params(tiny, point["routed_experts"], T)


def test_prefill_flops_match_a_count_from_the_config(report, tiny):
    D, V, H, d, R, C, v = dims(tiny)
    matrices = lambda width: 3 * width * D  # noqa: E731  (gate, up and down projections)
    per_token = (tiny.num_hidden_layers * (attention_params(tiny) - tiny.q_lora_rank - C)   # norms are no matrices
                 + tiny.first_k_dense_replace * matrices(tiny.intermediate_size)
                 + (tiny.num_hidden_layers - tiny.first_k_dense_replace)
                 * (tiny.n_routed_experts * D + matrices(tiny.moe_intermediate_size)
                    * (tiny.n_shared_experts + tiny.num_experts_per_tok)))
    for point in report["prefill"]:
        T = point["tokens"]
        # beyond the projections, scores and context cost H*P*(2C+R) absorbed or H*P*(d+R+v)
        # expanded, over the P = T(T+1)/2 causal query-key pairs (no block above the diagonal runs)
        attention = tiny.num_hidden_layers * H * (T * (T + 1) // 2) * min(2 * C + R, d + R + v)
        assert point["gflop"] * 1e9 == pytest.approx(2 * (T * per_token + attention + V * D), rel=1e-12)


def test_bad_options_are_one_line_errors():
    assert run_bench("--contexts", "12,abc").exit_code == 2
    assert run_bench("--prompt-lengths", "0").exit_code == 2
    for args, message in ((["--contexts", "1020"], "max_position_embeddings"),
                          (["--prompt-lengths", "2000"], "max_position_embeddings"),
                          (["--layers", "2"], "--layers")):
        result = run_bench(*args)
        assert isinstance(result.exception, BenchError) and message in str(result.exception)
        assert "\n" not in str(result.exception)


@pytest.mark.slow
def test_default_counts_are_cut_to_the_positions_the_model_holds(monkeypatch, small_probes):
    """ds2-tiny holds 1024 positions and the default contexts reach 4096: with no -c, bench cuts
    them to fit and says so in one line, before loading; counts the user gave are still refused."""
    result = run_bench("--repeats", "1", "--decode-steps", "2", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["settings"] == {"repeats": 1, "prompt_lengths": [16, 512],
                                                     "contexts": [128, 1022], "decode_steps": 2,
                                                     "passes": [2, 4]}
    err = result.stderr.splitlines()
    [note] = [k for k, line in enumerate(err) if "max_position_embeddings" in line]
    assert "1024" in err[note] and "--contexts 128,1022" in err[note] and "--prompt-lengths" not in err[note]
    assert note < err.index("load 1/1")
    result = run_bench("--contexts", "128,1024,4096")
    assert isinstance(result.exception, BenchError) and "--contexts 4096" in str(result.exception)


@pytest.mark.slow
def test_piped_table_keeps_every_row_on_one_line(report, capsys):
    """Piped, rich would wrap at 80 columns and split cells over lines: every row's cells stand
    on one line of the output, in order."""
    report_module.render(report, report_module.stdout_console())     # as bench draws it, stdout a pipe
    lines = capsys.readouterr().out.splitlines()
    rows = report_module.table_rows(report)
    # probes 3, the ceiling's 4 formats, load, then a row for each figure: prefill 2 x 3, decode 2 x 3
    # (tok/s, the ceiling, the cores), passes 2 x 2 (ms, what each reads) and their cores, peak RSS
    # and the weights + cache
    assert len(rows) == 27
    for row in rows:
        cells = r"\s+".join(re.escape(cell) for cell in row if cell)
        assert any(re.search(cells, line) for line in lines), row


@pytest.mark.slow
def test_tables_fit_80_columns(report, monkeypatch, small_probes):
    """Every table fits an 80-column terminal as it is: rendered 80 columns wide it is the same as
    rendered as wide as its cells want (nothing wrapped), no line is past 80 columns, and the
    figures are all there, small ones to three significant figures, never "0.0"."""
    from rich.console import Console

    def rendered(draw, what, width):
        console = Console(record=True, width=width)
        draw(what, console)
        return console.export_text()

    result = CliRunner().invoke(bench, ["-m", str(bundled_model_dir()), *TINY_ARGS[:-1], "--profile"],
                                env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert max(map(len, result.stdout.splitlines())) <= 80
    runs = {"f32": [report, report], "q8": [report, report], "q4": [report, report]}
    tables = [(report_module.render, report),
              (report_module.render_formats, {"formats": runs, "comparison": formats.format_ratios(runs)})]
    for draw, what in tables:
        text = rendered(draw, what, 80)
        assert max(map(len, text.splitlines())) <= 80
        assert text == rendered(draw, what, 1000)          # nothing wrapped: the same as unbounded
    text = rendered(report_module.render, report, 80)
    fig = report_module.fig
    assert "vs probe" in text and "vs probe beside it" not in text and " 0.0 " not in text
    for d in report["decode"]:
        assert f"tg @ {d['context']} tok/s" in text and fig(d["tok_per_s"]["median"]) in text
        assert f"{fig(d['gb_per_s'])} GB/s" in text and f"{fig(d['ceiling_tok_per_s'])} tok/s" in text
    for p in report["prefill"]:
        assert f"{fig(p['gflop_per_s']['median'])} GFLOP/s" in text and f"{fig(p['weight_gb_per_s'])} GB/s" in text
    for r in report["passes"]:
        assert f"{r['step_ratio']['median']:.2f}x" in text and f"{r['routed_experts_per_layer']:.1f} exp/layer" in text
    for name, p in [(f"pp{p['tokens']}", p) for p in report["prefill"]] + [
            (f"tg @ {d['context']}", d) for d in report["decode"]] + [("passes", report["passes"][0])]:
        c = p["cores"]
        given = f"{c['given']['min']}" + (f"-{c['given']['max']}" if c["given"]["max"] != c["given"]["min"] else "")
        assert re.search(rf"{re.escape(name)} cores\s+{re.escape(fig(c['busy']))} busy of {given} given", text)
    for f, rate in report["probes"]["ceiling"]["g_weights_per_s"].items():
        assert re.search(rf"ceiling {f} G w/s\s+{re.escape(fig(rate))}", text)
    assert f"{human_count(report['model']['params'])} params" in text
    assert f"peak RSS {human_bytes(report['memory']['peak_rss_bytes'])}" in " ".join(text.split())
    assert f"{report['memory']['rss_ratio']:.2f}x weights + cache" in text
    assert f"{report['probes']['ceiling']['cores']} cores at once" in text   # the footnote
    # three significant figures, whole numbers whole; a share below 1% is not 0%
    assert [fig(x) for x in (994.54, 16.84, 1.234, 0.0703, 0.000123, 1322.05, 0)] == \
        ["995", "16.8", "1.23", "0.0703", "0.000123", "1322", "0"]
    assert [report_module.pct(x) for x in (0.104, 0.0012, 0)] == ["10%", "0.1%", "0%"]


def test_compare_hf_is_skipped_with_a_note_without_torch(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail, installed or not
    assert compare_hf.compare_hf(bundled_model_dir(), [4], [8], 1, 1) is None
    err = capsys.readouterr().err
    assert "--compare-hf skipped: torch is not importable" in err and err.count("\n") == 1


def small_config():
    """DeepSeek-V2-Lite's structure (plain q_proj, 2 shared experts, YaRN) at toy sizes; the vocab
    stays 4096 because the synthetic checkpoint ships ds2-tiny's 4096-token tokenizer."""
    return {**lite_config(2), "vocab_size": 4096, "hidden_size": 64, "num_attention_heads": 2,
            "num_key_value_heads": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
            "num_experts_per_tok": 2}


def test_synthesised_checkpoint_loads_and_runs(tmp_path):
    target = synthesise(tmp_path / "small", small_config(), shard_bytes=300_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small"]  # no partial folder left behind
    cfg = DeepseekV2Config.from_file(target / "config.json")
    tensors = checkpoint.validate(cfg, target)
    assert set(tensors) == set(checkpoint.expected_shapes(cfg))
    assert {t.dtype for t in tensors.values()} == {"BF16"}
    assert len(checkpoint.shard_files(target)) > 1
    with safe_open(str(target / tensors["model.norm.weight"].file.name), framework="numpy") as f:
        assert f.get_tensor("model.norm.weight").dtype == ml_dtypes.bfloat16
    with safe_open(str(tensors["lm_head.weight"].file), framework="numpy") as f:
        lm_head = f.get_tensor("lm_head.weight").astype(np.float32)
    assert lm_head.std() == pytest.approx(0.02, rel=0.02) and abs(lm_head.mean()) < 1e-3
    model = ds2cli.load(target)
    assert np.all(model.norm == 1) and model.config.q_lora_rank is None
    logits = model.forward(np.arange(40), model.new_cache(40), all_logits=True)
    assert logits.shape == (40, 4096) and np.isfinite(logits).all()


def test_synthesis_is_seeded(tmp_path):
    a = synthesise(tmp_path / "a", small_config())
    b = synthesise(tmp_path / "b", small_config(), shard_bytes=300_000)
    ta, tb = checkpoint.read_headers(a), checkpoint.read_headers(b)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    [(_, wa)], [(_, wb)] = checkpoint.iter_float32(ta, [name]), checkpoint.iter_float32(tb, [name])
    np.testing.assert_array_equal(wa, wb)


def test_interrupted_synthesis_leaves_nothing_to_reuse(tmp_path):
    def interrupted(line):           # Ctrl-C as the first shard is written
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        synthesise(tmp_path / "small", small_config(), shard_bytes=300_000, show=interrupted)
    assert list(tmp_path.iterdir()) == []


def test_stale_partial_folders_are_removed(tmp_path):
    stale = tmp_path / ".small.partial-999999999"  # above any pid_max: that process is gone
    stale.mkdir()
    synthesise(tmp_path / "small", small_config())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small"]


def test_not_enough_disk_is_an_error():
    """Refused before anything is written: in /proc, a file system with no free byte (and no
    partial folder could be made there either)."""
    with pytest.raises(BenchError, match="not enough disk .* in /proc/self: .* 0.0 GB is free"):
        synthesise(Path("/proc/self/small"), small_config())


@pytest.mark.slow
@pytest.mark.slow
def test_without_model_bench_runs_ds2_tiny_and_writes_nothing(tmp_path, monkeypatch, small_probes):
    """A bare `ds2 bench` (the README's first runs) benches the bundled ds2-tiny, as every command
    runs it without -m: it synthesises nothing and writes nothing into DS2_BENCH_DIR."""
    result = CliRunner().invoke(bench, TINY_ARGS, env={"DS2_BENCH_DIR": str(tmp_path / "bench")})
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model"]["path"] == str(bundled_model_dir()) and not report["model"]["synthetic"]
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize("layers, words", [(1, "1 layer, "), (2, "2 layers, ")])
def test_the_model_line_counts_layers_in_words(layers, words):
    m = {"num_hidden_layers": layers, "params": 7_900_000}
    assert report_module.model_line(m, 31_600_000, "float32").startswith(words)


def test_layers_target_the_synthetic_lite_slice(tmp_path, monkeypatch, small_probes):
    """With --layers N, bench synthesises the slice into DS2_BENCH_DIR once, then reuses it."""
    made = []

    def fake_synthesise(target, config):
        made.append(config)
        return synthesise(target, small_config())

    monkeypatch.setattr(synthetic, "synthesise", fake_synthesise)
    args = ["--layers", "2", "--repeats", "1", "--contexts", "8", "--prompt-lengths", "4", "--decode-steps", "1",
            "--json"]
    for _ in range(2):
        result = CliRunner().invoke(bench, args, env={"DS2_BENCH_DIR": str(tmp_path)})
        assert result.exit_code == 0, result.output
    assert len(made) == 1
    assert made[0]["num_hidden_layers"] == 2 and made[0]["hidden_size"] == 2048
    report = json.loads(result.stdout)
    assert report["model"]["synthetic"] and report["model"]["hidden_size"] == 64
    assert report["model"]["path"] == str(tmp_path / "deepseek-v2-lite-2-layers")


def test_format_ratios_are_taken_within_each_round(report):
    """--formats: each round's ratio pairs runs made close in time; a machine that slows down
    between rounds moves the figures, not the ratios."""
    import copy

    def scaled(r, speed, rss):
        r = copy.deepcopy(r)
        for point in r["prefill"] + r["decode"]:
            point["tok_per_s"]["median"] *= speed
        r["memory"]["peak_rss_bytes"] = rss
        return r

    base_rss = report["memory"]["peak_rss_bytes"]
    # round 2 runs on a machine half as fast; q8 is 0.9x f32 within each round
    runs = {"f32": [scaled(report, 1.0, base_rss), scaled(report, 0.5, base_rss)],
            "q8": [scaled(report, 0.9, base_rss // 2), scaled(report, 0.45, base_rss // 4)]}
    out = formats.format_ratios(runs)
    row = next(k for k in out["q8"]["ratios"] if k.startswith("tg @"))
    assert out["q8"]["ratios"][row] == pytest.approx(0.9)
    assert out["q8"]["ratio_range"][row] == pytest.approx([0.9, 0.9])
    first = report["decode"][0]["tok_per_s"]["median"]
    assert out["f32"]["figures"][row] == pytest.approx(0.75 * first)   # the median of 1.0x and 0.5x
    assert out["q8"]["rounds"] == 2
    # the highest peak RSS of the rounds
    assert out["q8"]["rss_vs_float32_weights"] == pytest.approx(
        base_rss // 2 / report["model"]["float32_weight_bytes"])
    from rich.console import Console
    console = Console(record=True, width=200)
    report_module.render_formats({"formats": runs, "comparison": out}, console)
    text = console.export_text()
    assert "0.90x (0.90-0.90)" in text and "medians of 2 rounds" in text


@pytest.mark.slow
def test_side_by_side_pairs_samples_of_every_format_in_one_process(report, tmp_path, monkeypatch):
    """--formats' speed ratios: every format loaded in one process, sample k of each taken in
    turn on the same ids, the ratio within each k; skipped when they do not fit together."""
    from ds2cli.weights.quantize import quantize_checkpoint
    q8 = tmp_path / "tiny-q8"
    quantize_checkpoint(bundled_model_dir(), q8, 8)
    targets = {"f32": bundled_model_dir(), "q8": q8}
    loaded = []

    def load(path, **kw):
        loaded.append(path)
        return ds2cli.load(path, **kw)
    out = formats.side_by_side(targets, 3, [8], [8, 24], 2, loader=load)
    assert loaded == [bundled_model_dir(), q8]           # each format once, all in this process
    assert out["samples"] == 3 and set(out["rows"]) == {"pp8 tok/s", "tg @ 8 tok/s", "tg @ 24 tok/s"}
    for row in out["rows"].values():
        base, other = row["f32"], row["q8"]
        assert base["ratios"] == [1.0] * 3 and base["ratio"] == 1.0
        ratios = [q / f for q, f in zip(other["tok_per_s"]["runs"], base["tok_per_s"]["runs"])]
        assert other["ratios"] == pytest.approx(ratios) and len(ratios) == 3
        assert other["ratio"] == pytest.approx(float(np.median(ratios)))
        assert other["ratio_range"] == pytest.approx([min(ratios), max(ratios)])
        assert all(v > 0 for v in other["tok_per_s"]["runs"] + base["tok_per_s"]["runs"])
    # the table shows these ratios for the speed rows
    comparison = {name: {"figures": {"pp8 tok/s": 100.0, "load s": 1.0}, "ratios": {"pp8 tok/s": 0.5, "load s": 0.1},
                         "ratio_range": {"pp8 tok/s": [0.5, 0.5], "load s": [0.1, 0.1]}, "rounds": 1,
                         "rss_vs_float32_weights": 1.0} for name in targets}
    runs = {name: [report] for name in targets}
    from rich.console import Console
    console = Console(record=True, width=400)
    report_module.render_formats({"formats": runs, "comparison": comparison, "side_by_side": out}, console)
    text = " ".join(console.export_text().split())
    r = out["rows"]["pp8 tok/s"]["q8"]
    assert f"{r['ratio']:.2f}x ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})" in text
    assert report_module.fig(r["tok_per_s"]["median"]) in text and " 100 " not in text   # its figures too
    assert "0.10x (0.10-0.10)" in text and "medians of 3 samples of every format" in text
    # formats that would not fit in memory together are not loaded side by side
    loaded.clear()
    assert formats.side_by_side(targets, 3, [8], [8], 2, loader=load, available_bytes=lambda: 10**6) is None
    assert loaded == []


def test_decode_is_held_against_numpys_own_ceiling(report, tiny):
    """The ceiling probe's rates by format, and each decode point's ceiling: the step's weights
    (every matrix but the embedding, top-k routed experts) over those rates, and decode's share."""
    ceiling = report["probes"]["ceiling"]
    rates, matvec = ceiling["g_weights_per_s"], report["probes"]["matvec"]["gb_per_s"]["max"]
    assert set(rates) == {"f32", "bf16", "q8", "q4"}
    for f, per_value in {"f32": 4, "bf16": 2, "q8": 1, "q4": 0.5}.items():   # every core's best, at most memory's
        assert rates[f] == pytest.approx(min(ceiling["cores_at_once"][f]["max"], matvec / per_value))
        assert ceiling["core"][f]["median"] > 0
    D, V = tiny.hidden_size, tiny.vocab_size
    for d in report["decode"]:
        values = d["weights_by_format"]
        assert set(values) == {"f32"}                     # the bundled model is float32
        matrices = sum(n for n in values.values())
        assert matrices > V * D                           # lm_head and every layer's matrices
        beside = d["probes"]["ceiling"]["g_weights_per_s"]
        best = d["ceiling_g_weights_per_s"]           # the best of this run's probes so far, by format
        assert all(best[f] >= max(beside[f], rates[f]) for f in rates)
        assert d["ceiling_tok_per_s"] == pytest.approx(1e9 * best["f32"] / matrices, rel=1e-9)
        assert d["ceiling_share"] == pytest.approx(d["tok_per_s"]["median"] / d["ceiling_tok_per_s"], rel=1e-9)


@pytest.mark.slow
def test_profile_accounts_for_the_whole_step(monkeypatch, small_probes):
    """--profile: the step split into products (by format), attention, the router and the rest,
    each exclusive of what it calls, summing to the step's measured time; the engine's classes
    and functions are as they were afterwards."""
    from ds2cli.execution.compute import CoreCompute
    from ds2cli.model import block, moe
    originals = (CoreCompute.start_product, block.mla, moe.route)
    result = run_bench(*TINY_ARGS, "--profile", "-r", "2")        # 2 repeats: steps x 2 in one cache
    assert result.exit_code == 0, result.output
    p = json.loads(result.stdout)["profile"]
    whats = [r["what"] for r in p["rows"]]
    assert {"attention (latent cache, heads)", "products f32", "router"} <= set(whats)
    assert whats[-1].startswith("the rest")
    assert sum(r["per_step_s"] for r in p["rows"]) == pytest.approx(p["step_s"], rel=1e-9)
    assert all(r["per_step_s"] >= 0 for r in p["rows"][:-1])
    tiny = DeepseekV2Config.from_file(bundled_model_dir() / "config.json")
    router = next(r for r in p["rows"] if r["what"] == "router")
    assert router["calls_per_step"] == len(tiny.moe_layers)      # one route a MoE layer a step
    assert (CoreCompute.start_product, block.mla, moe.route) == originals
    products = next(r for r in p["rows"] if r["what"] == "products f32")
    assert products["g_weights_per_s"] > 0 and products["calls_per_step"] > 0


@pytest.mark.slow
def test_numpy_at_the_steps_shapes_replays_exactly_what_the_ceiling_counts(monkeypatch, every_matrix_split, small_probes):
    """The step-shapes probe replays the profiled steps' own matrices: a step's weights by
    format are exactly those the ceiling divides (a one-token step routes exactly top-k
    experts a layer), low-bit formats included; its rates and the decode's share of it follow."""
    for extra in ([], ["--quantize", "4"]):
        result = run_bench(*TINY_ARGS, "--profile", *extra)
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        shapes, point = report["profile"]["numpy_at_step_shapes"], report["decode"][0]
        values = {f: r["values_per_step"] for f, r in shapes["by_format"].items()}
        assert values == pytest.approx(point["weights_by_format"], rel=1e-12)
        assert all(r["g_weights_per_s"] > 0 for r in shapes["by_format"].values())
        assert shapes["products_s"] == pytest.approx(sum(r["seconds_per_step"] for r in shapes["by_format"].values()))
        assert shapes["ceiling_share"] == pytest.approx(point["tok_per_s"]["median"] / shapes["ceiling_tok_per_s"])
    args = [a for a in TINY_ARGS if a != "--json"]
    text = run_bench(*args, "--profile").stdout
    assert "numpy at this step's shapes" in text and "products at these shapes:" in text


def test_stored_rows_are_the_weights_own_bytes():
    """The probes read a weight's stored values in place: every format's rows hold its weights
    (q4 two a byte) without a copy."""
    from ds2cli.cli.bench.probes import stored_rows
    from ds2cli.weights.formats import Dense
    from ds2cli.weights import formats as quant, scales
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 96), dtype=np.float32)
    for f in ("q8", "q4", "q8b", "bf16"):
        q = scales.quantize_matrix(w, quant.FORMATS[f])
        fmt, a = stored_rows(q)
        assert fmt == ("q8" if f == "q8b" else f)
        assert a.size * (2 if f == "q4" else 1) == w.size and np.shares_memory(a, q.qweight)
    fmt, a = stored_rows(Dense(w))
    assert fmt == "f32" and np.shares_memory(a, w)


@pytest.mark.slow
def test_profile_of_a_low_bit_model_counts_the_coordination_apart(monkeypatch, every_matrix_split, small_probes):
    """At 8 bits a decode step's products go to the helper processes in plans: the products'
    rows hold this process's share of them (with the kernels' rate), the coordination its own
    row (when the helpers took part: a machine busy with other work runs the plans alone), and
    the rows still sum to the step."""
    from ds2cli.execution import helpers as processes
    from ds2cli.weights import formats as quant
    originals = (quant.QuantMatrix.span, processes.Helpers.send, processes.Helpers.finish)
    result = run_bench(*TINY_ARGS, "--quantize", "8", "--profile")
    assert result.exit_code == 0, result.output
    p = json.loads(result.stdout)["profile"]
    rows = {r["what"]: r for r in p["rows"]}
    assert sum(r["per_step_s"] for r in p["rows"]) == pytest.approx(p["step_s"], rel=1e-9)
    products = [r for w, r in rows.items() if w.startswith("products ")]
    assert products and all(r["g_weights_per_s"] > 0 for r in products)
    coordination = rows.get("coordination: plans sent, helpers awaited")
    if coordination is not None:
        # fewer plans than products: a plan carries several (q with kv, the experts)
        assert 0 < coordination["calls_per_step"] < sum(r["calls_per_step"] for r in products)
    assert (quant.QuantMatrix.span, processes.Helpers.send, processes.Helpers.finish) == originals


def test_the_ceiling_probes_team_of_several_ends_whole():
    """Every member of the all-cores probe runs its share when told and ends when its pipe
    closes, however many there are (each holds only its own pipes)."""
    import mmap
    from ds2cli.cli.bench import probes
    ran = mmap.mmap(-1, 4)                    # anonymous and shared: the forked members write it too

    def share(i):
        ran[i] += 1

    team = probes._Team(share, 4)
    pids = [pid for pid, _, _ in team.members]
    assert len(pids) == 3
    assert team.seconds() > 0 and team.seconds() > 0
    assert ran[:] == bytes([2, 2, 2, 2])     # each member its own share, once a run
    team.close()
    for pid in pids:                          # reaped: no such child any more
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


@pytest.mark.slow
def test_a_streamed_bench_holds_the_step_against_the_disks_own_rate(tmp_path, monkeypatch, small_probes):
    """--memory-budget: each decode point's `stream` counts the bytes read and measures the
    disk's rate for expert reads in the same run; the step is held against that rate."""
    from ds2cli.weights import memory
    from ds2cli.weights.quantize import quantize_checkpoint
    q8 = tmp_path / "tiny-q8"
    quantize_checkpoint(bundled_model_dir(), q8, 8)
    model = ds2cli.load(q8)
    plan = memory.streamed(model.config, model.quantization, 64, 10**12)
    budget = plan["resident"] + 4 * plan["expert"]          # the context bench asks for takes a slot or two
    result = CliRunner().invoke(bench, ["-m", str(q8), *TINY_ARGS, "--memory-budget", str(budget)])
    assert result.exit_code == 0, result.output
    for point in json.loads(result.stdout)["decode"]:
        st = point["stream"]
        assert st["slots"] >= 1 and st["bytes_read"] == (st["misses"] + st["read_ahead"]) * plan["expert"] > 0
        assert st["disk_gb_per_s"] > 0 and st["disk_seconds_per_token"] == pytest.approx(
            st["bytes_read_per_token"] / (st["disk_gb_per_s"] * 1e9))
        assert st["step_vs_disk"] == pytest.approx(1 / point["tok_per_s"]["median"] / st["disk_seconds_per_token"])
