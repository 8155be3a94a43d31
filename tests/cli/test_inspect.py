"""`ds2 inspect`'s report: every figure checked against counts made here, independently, from the
raw safetensors headers and config.json, on the bundled ds2-tiny and the reference checkpoints."""

from __future__ import annotations

import io
import json
import math
import shutil
import struct
from pathlib import Path

import ml_dtypes  # lets safetensors.numpy round-trip bf16, and writes an fp8 dtype ds2 does not read
import numpy as np
import pytest
from click.testing import CliRunner
from rich.console import Console
from safetensors.numpy import load_file, save_file

from ds2cli.weights import checkpoint, hub
from ds2cli.model import rope
from ds2cli.weights.checkpoint import TensorInfo, expected_shapes
from ds2cli.cli.main import main
from ds2cli.model.config import DeepseekV2Config
from ds2cli.cli.inspect_report import describe, params_section, scan_values
from ds2cli.errors import ConfigError
from ds2cli.weights.source import bundled_model_dir
from ds2cli.cli.inspect_tables import render
from ds2cli.wording import article, human_bytes, human_count

REFERENCE = Path(__file__).parents[1] / "data" / "reference"
TINY = bundled_model_dir()
MODEL_DIRS = [TINY] + sorted(p.parent for p in REFERENCE.glob("*/config.json"))
IDS = [p.name for p in MODEL_DIRS]


# ---- independent readers: no ds2cli code ----

def raw_header(path: Path) -> dict[str, dict]:
    """{name: {"dtype", "shape", ...}} of one safetensors file, parsed by hand."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def raw_headers(model_dir: Path) -> dict[str, dict]:
    """raw_header over every *.safetensors file."""
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update(raw_header(path))
    return out


def raw_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def numel(entry: dict) -> int:
    return math.prod(entry["shape"])


def layer_of(name: str) -> int:
    return int(name.split(".")[2])


def independent_active(model_dir: Path) -> int:
    """Everything but the routed experts and the untied input embedding (a row lookup), plus
    top-k / n of each MoE layer's routed experts."""
    c, active, routed = raw_config(model_dir), 0, {}
    for name, e in raw_headers(model_dir).items():
        if ".mlp.experts." in name:
            routed[layer_of(name)] = routed.get(layer_of(name), 0) + numel(e)
        elif name != "model.embed_tokens.weight" or c.get("tie_word_embeddings"):
            active += numel(e)
    return active + sum(n * c["num_experts_per_tok"] // c["n_routed_experts"] for n in routed.values())


def copy_checkpoint(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("ref.npz"))
    return dst


def rewrite_single_file(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    return {p.name: describe(p) for p in MODEL_DIRS}


# ---- the figures ----

@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=IDS)
def test_parameter_counts_match_raw_headers(model_dir, reports):
    r, raw, c = reports[model_dir.name], raw_headers(model_dir), raw_config(model_dir)
    assert r["params"] == sum(numel(e) for e in raw.values())
    dtypes = {}
    for e in raw.values():
        dtypes[e["dtype"]] = dtypes.get(e["dtype"], 0) + numel(e)
    assert r["dtypes"] == dtypes
    p = r["params_by_category"]
    categories = ("embeddings", "attention", "dense_mlp", "routed_experts", "shared_experts",
                  "router", "norms", "lm_head", "other")
    assert sum(p[k] for k in categories) == p["total"] == r["params"]
    assert p["embeddings"] == c["vocab_size"] * c["hidden_size"]
    assert p["lm_head"] == (0 if c.get("tie_word_embeddings") else c["vocab_size"] * c["hidden_size"])
    assert p["routed_experts"] == sum(numel(e) for n, e in raw.items() if ".mlp.experts." in n)
    assert p["other"] == 0
    assert r["problems"] == [] and r["warnings"] == []


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=IDS)
def test_active_params_count_top_k_experts(model_dir, reports):
    r = reports[model_dir.name]
    assert r["active_params_per_token"] == r["params_by_category"]["active_per_token"] == independent_active(model_dir)
    assert r["active_params_per_token"] < r["params"]


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=IDS)
def test_cache_bytes_per_token(model_dir, reports):
    r, c = reports[model_dir.name], raw_config(model_dir)
    L, H = c["num_hidden_layers"], c["num_attention_heads"]
    latent = L * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 4
    mha = L * H * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * 4
    assert r["latent_cache_bytes_per_token"] == r["memory"]["latent_cache_bytes_per_token"] == latent
    assert r["mha_cache_bytes_per_token"] == r["memory"]["mha_cache_bytes_per_token"] == mha
    m = r["memory"]
    assert m["mha_to_latent_ratio"] == pytest.approx(mha / latent)
    assert m["latent_cache_bytes_at_context"] == latent * c["max_position_embeddings"]
    assert m["float32_weight_bytes"] == 4 * r["params"]


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=IDS)
def test_moe_layers_are_those_holding_experts(model_dir, reports):
    r, raw, c = reports[model_dir.name], raw_headers(model_dir), raw_config(model_dir)
    with_experts = sorted({layer_of(n) for n in raw if ".mlp.experts." in n})
    assert r["moe_layers"] == r["moe"]["moe_layers"] == with_experts
    assert r["dense_layers"] == [i for i in range(c["num_hidden_layers"]) if i not in with_experts]


@pytest.mark.parametrize("name, moe, dense", [
    ("ds2-tiny", [1, 2, 3, 4, 5], [0]),
    ("normtopk_layerfreq2", [0, 2], [1, 3]),          # moe_layer_freq 2, first_k_dense_replace 0
    ("plain_rope_tied_fp16", [2, 3], [0, 1]),         # first_k_dense_replace 2
    ("lite_like_plainq_yarn", [1, 2, 3], [0]),
])
def test_known_layer_lists(reports, name, moe, dense):
    assert (reports[name]["moe_layers"], reports[name]["dense_layers"]) == (moe, dense)


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=IDS)
def test_storage_matches_files(model_dir, reports):
    s = reports[model_dir.name]["storage"]
    files = sorted(model_dir.glob("*.safetensors"))
    assert [f["name"] for f in s["files"]] == [p.name for p in files]
    assert s["total_bytes"] == sum(p.stat().st_size for p in files)
    data_bytes = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in raw_headers(model_dir).values())
    assert sum(d["bytes"] for d in s["dtypes"].values()) == data_bytes


def test_model_sections(reports):
    tiny = reports["ds2-tiny"]
    assert (tiny["model_type"], tiny["num_hidden_layers"], tiny["hidden_size"], tiny["vocab_size"]) == \
        ("deepseek_v2", 6, 256, 4096)
    m = tiny["model"]
    assert (m["heads"], m["context_length"], m["rope_theta"]) == (4, 1024, 10000.0)
    assert m["rope_scaling"] == {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    assert m["softmax_scale"] == rope.softmax_scale(DeepseekV2Config.from_file(TINY / "config.json"))
    assert tiny["mla"] == {"q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                           "qk_rope_head_dim": 16, "q_head_dim": 48, "v_head_dim": 32}
    moe = tiny["moe"]
    assert (moe["n_routed_experts"], moe["n_shared_experts"], moe["num_experts_per_tok"]) == (8, 1, 2)
    assert (moe["topk_method"], moe["n_group"], moe["topk_group"]) == ("group_limited_greedy", 4, 2)
    assert moe["routed_scaling_factor"] == 2.0 and moe["norm_topk_prob"] is False
    assert moe["moe_intermediate_size"] == 128
    plain = reports["plain_rope_tied_fp16"]["model"]
    assert plain["rope_scaling"] is None and plain["softmax_scale"] == pytest.approx(24 ** -0.5)
    assert plain["tie_word_embeddings"] is True
    f32 = reports["v2_like_loraq_grouplimited"]
    assert f32["dtypes"] == {"F32": f32["params"]}


def test_tokenizer_section(reports):
    t = reports["ds2-tiny"]["tokenizer"]
    assert t["tokenizer_json"] and t["tokenizer_config"]
    assert t["vocab_size"] == 4096
    assert (t["bos_token"], t["bos_token_id"]) == ("<｜begin▁of▁sentence｜>", 0)
    assert (t["eos_token"], t["eos_token_id"]) == ("<｜end▁of▁sentence｜>", 1)
    assert t["add_bos_token"] is True and t["chat_template"] is True
    assert t["generation_eos_token_ids"] == [1] and t["config_eos_token_ids"] == [1]


@pytest.mark.slow
def test_published_deepseek_sizes():
    """The counting convention reproduces DeepSeek's own figures: V2 236B total / 21B active,
    V2-Lite 15.7B / 2.4B (from the public configs, on headers synthesised from expected shapes)."""
    base = dict(model_type="deepseek_v2", vocab_size=102400, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1, n_shared_experts=2,
                num_experts_per_tok=6)
    lite = dict(base, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                num_hidden_layers=27, num_attention_heads=16, n_routed_experts=64)
    v2 = dict(base, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
              num_hidden_layers=60, num_attention_heads=128, n_routed_experts=160, q_lora_rank=1536,
              topk_method="group_limited_greedy", n_group=8, topk_group=3)
    sizes = []
    for d in (lite, v2):
        cfg = DeepseekV2Config.from_dict(d)
        tensors = {n: TensorInfo(n, "BF16", s, Path("x"), 2 * math.prod(s))
                   for n, s in expected_shapes(cfg).items()}
        p = params_section(cfg, tensors)
        sizes.append((p["total"], p["active_per_token"]))
    (lite_total, lite_active), (v2_total, v2_active) = sizes
    assert round(lite_total / 1e8) == 157 and int(lite_active / 1e8) == 24
    assert round(v2_total / 1e9) == 236 and round(v2_active / 1e9) == 21


# ---- defects ----

def test_missing_and_misshaped_tensors_are_problems(tmp_path):
    model_dir = copy_checkpoint(REFERENCE / "normtopk_layerfreq2", tmp_path)
    gone, bent = "model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.kv_a_layernorm.weight"

    def edit(t):
        del t[gone]
        t[bent] = np.ones(t[bent].shape[0] + 1, dtype=t[bent].dtype)
    rewrite_single_file(model_dir, edit)
    r = describe(model_dir)
    assert len(r["problems"]) == 2
    assert any(p.startswith("missing tensor") and gone in p for p in r["problems"])
    assert any(bent in p and "shape" in p for p in r["problems"])
    assert r["params"] == sum(numel(e) for e in raw_headers(model_dir).values())


def test_check_lists_nan_and_inf_as_problems(tmp_path):
    model_dir = copy_checkpoint(REFERENCE / "plain_rope_tied_fp16", tmp_path)
    bad = "model.layers.2.mlp.experts.5.down_proj.weight"

    def edit(t):
        t[bad] = t[bad].copy()
        t[bad].flat[7] = np.nan
        t[bad].flat[9] = np.inf
    rewrite_single_file(model_dir, edit)
    assert describe(model_dir)["problems"] == []
    r = describe(model_dir, check=True)
    assert r["problems"] == [f"tensor {bad} has 1 NaN and 1 Inf values"]
    assert r["warnings"] == [] and r["check"]["nonfinite_tensors"] == 1 and not r["check"]["stopped"]


def test_check_on_clean_model_warns_nothing():
    r = describe(TINY, check=True)
    assert r["warnings"] == [] and r["problems"] == []
    assert describe(TINY)["check"] is None


def test_check_says_the_scan_ran_and_what_it_found():
    """Without a problem to list, --check still says what it read: one line after the tables."""
    floats = sum(1 for e in raw_headers(TINY).values() if e["dtype"] in ("BF16", "F16", "F32"))
    r = describe(TINY, check=True)
    assert r["check"] == {"tensors_read": floats, "nonfinite_tensors": 0, "stopped": False}
    out = inspect("--check", TINY)
    assert out.exit_code == 0
    assert f"check: {floats:,} floating-point tensors read, all finite" in out.stdout.splitlines()
    assert "check:" not in inspect(TINY).stdout


def test_check_on_a_gguf_says_it_read_nothing():
    r = inspect("--check", Path(__file__).parents[1] / "data" / "gguf" / "plain_rope_tied_fp16.f16.gguf")
    assert "warning: --check scans a safetensors checkpoint's values; this GGUF file's were not read" in r.stderr


def test_a_gguf_s_memory_is_its_source_checkpoint_s_with_the_option_of_each_form(monkeypatch):
    """--json gives `memory` one shape: the F16 GGUF converted from a reference checkpoint reports
    that checkpoint's memory section, figure for figure, each form also naming its option."""
    monkeypatch.setenv("DS2_MEMORY_AVAILABLE", "8GB")
    gguf = json.loads(inspect("--json", Path(__file__).parents[1] / "data" / "gguf" /
                              "plain_rope_tied_fp16.f16.gguf").stdout)["memory"]
    source = json.loads(inspect("--json", REFERENCE / "plain_rope_tied_fp16").stdout)["memory"]
    options = [(f.pop("option"), f.pop("default")) for f in gguf["formats"]]
    commands = [(f.pop("command"), g.pop("command")) for f, g in zip(gguf["streaming"], source["streaming"])]
    assert gguf == source
    assert [c for c, _ in commands] == [f"ds2 quantize {g} OUT --bits {b}" for g, b in
                                        zip([Path(__file__).parents[1] / "data" / "gguf" / "plain_rope_tied_fp16.f16.gguf"] * 2, (8, 4))]
    assert options == [("--quantize auto", True), ("--quantize 8", False), ("--quantize 4", False)]


def test_tables_say_the_config_in_words():
    """Rows are words a reader knows; the config's field names stay in --json."""
    out = inspect(TINY).stdout
    for words in ("routed experts", "experts per token", "dense layers first", "query latent rank",
                  "yarn original context"):
        assert f"│ {words} " in out, words
    for field in ("n routed experts", "num experts per tok", "first k dense replace", "kv lora rank",
                  "original_max_position_embeddings"):
        assert field not in out, field
    assert json.loads(inspect("--json", TINY).stdout)["moe"]["first_k_dense_replace"] == 1


def test_describe_reads_no_tensor_data(tmp_path):
    """The report needs the shards' headers only: a folder without its shard files, their
    headers given as a Hub id's are (hub.RemoteShards: no data can be read through it), reports
    no problem and the same parameters."""
    model_dir = tmp_path / "headers-only"
    shutil.copytree(TINY, model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    heads = {}
    for path in TINY.glob("*.safetensors"):
        data = path.read_bytes()
        heads[path.name] = (len(data), data[:8 + int.from_bytes(data[:8], "little")])
    report = describe(model_dir, shards=hub.RemoteShards(heads))
    assert report["problems"] == [] and report["params_by_category"] == describe(TINY)["params_by_category"]


def test_missing_tokenizer_is_reported_absent_and_is_a_problem(tmp_path):
    model_dir = copy_checkpoint(REFERENCE / "plain_rope_tied_fp16", tmp_path)
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "tokenizer_config.json").unlink()
    (model_dir / "generation_config.json").unlink()
    r = describe(model_dir)
    t = r["tokenizer"]
    assert not t["tokenizer_json"] and not t["tokenizer_config"]
    assert t["vocab_size"] is None and t["bos_token_id"] is None
    assert t["generation_eos_token_ids"] == [] and t["generation_config"] is False
    assert r["problems"] == [f"{model_dir / 'tokenizer.json'} not found: generate and chat need "
                             f"a Hugging Face tokenizer.json"]
    out = io.StringIO()
    render(r, Console(file=out, width=120))
    assert "absent (no tokenizer.json, tokenizer_config.json)" in out.getvalue()


def test_absent_generation_config_reads_as_absent(tmp_path):
    model_dir = copy_checkpoint(TINY, tmp_path)
    (model_dir / "generation_config.json").unlink()
    r = describe(model_dir)
    assert r["tokenizer"]["generation_config"] is False and r["problems"] == []
    out = io.StringIO()
    render(r, Console(file=out, width=100))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in out.getvalue().splitlines() if line.count("│") == 3}
    assert rows["generation_config.json"] == "absent"
    assert rows["eos ids (generation_config)"] == "-"


def edit_json(path: Path, edit) -> None:
    d = json.loads(path.read_text(encoding="utf-8"))
    edit(d)
    path.write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")


EXTRA_TOKEN = {"id": 4096, "content": "<extra>", "single_word": False, "lstrip": False,
               "rstrip": False, "normalized": False, "special": True}


@pytest.mark.parametrize("breaks, message", [
    (lambda d: (d / "tokenizer.json").write_text("{}"), "is not a valid tokenizer.json"),
    (lambda d: edit_json(d / "tokenizer.json", lambda t: t["added_tokens"].append(EXTRA_TOKEN)),
     "the tokenizer has 4097 token ids but the model's vocab_size is 4096"),
    (lambda d: edit_json(d / "tokenizer_config.json", lambda c: c.update(bos_token="<nope>")),
     "bos_token '<nope>' is not in tokenizer.json"),
    (lambda d: edit_json(d / "tokenizer_config.json", lambda c: c.update(eos_token="<nope>")),
     "eos_token '<nope>' is not in tokenizer.json"),
    (lambda d: edit_json(d / "tokenizer_config.json",
                         lambda c: c.update(chat_template="{{ messages[0].content.missing.deeper }}")),
     "chat template line 1"),
    (lambda d: edit_json(d / "tokenizer_config.json", lambda c: c.update(chat_template="{% for %}")),
     "chat template line 1"),
], ids=["tokenizer_json_invalid", "ids_beyond_vocab", "bos_not_in_vocab", "eos_not_in_vocab",
        "template_does_not_render", "template_syntax"])
def test_tokenizer_that_generate_refuses_is_a_problem(tmp_path, breaks, message):
    model_dir = copy_checkpoint(TINY, tmp_path)
    breaks(model_dir)
    problems = describe(model_dir)["problems"]
    assert len(problems) == 1 and message in problems[0], problems


def test_added_token_objects_and_broken_tokenizer(tmp_path):
    model_dir = copy_checkpoint(REFERENCE / "plain_rope_tied_fp16", tmp_path)
    added = lambda s: {"__type": "AddedToken", "content": s, "lstrip": False, "rstrip": False}  # noqa: E731
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": added("<｜begin▁of▁sentence｜>"),
         "eos_token": added("<｜end▁of▁sentence｜>")}))
    t = describe(model_dir)["tokenizer"]
    assert (t["bos_token_id"], t["eos_token_id"]) == (0, 1)
    assert t["add_bos_token"] is None and t["chat_template"] is False
    (model_dir / "tokenizer.json").write_text("{not json")
    r = describe(model_dir)
    assert r["tokenizer"]["vocab_size"] is None
    assert len(r["problems"]) == 1 and "tokenizer.json" in r["problems"][0]


def cell_widths(text: str) -> list[int]:
    from rich.cells import cell_len
    return [cell_len(line) for line in text.splitlines()]


def test_tables_fit_80_columns_and_the_path_is_never_cut(tmp_path):
    deep = tmp_path / ("checkpoints-" + "x" * 60) / "deepseek-ai" / "DeepSeek-V2-Lite-Chat"
    shutil.copytree(TINY, deep)
    r = describe(deep)
    out = io.StringIO()
    render(r, Console(file=out, width=80))
    lines = out.getvalue().splitlines()
    assert lines[0] == f"checkpoint {deep}"                   # whole, on its own line
    assert "…" not in out.getvalue()
    assert max(cell_widths("\n".join(lines[1:]))) <= 80


def test_parameter_table_categories_add_up_to_the_total(reports):
    r = reports["ds2-tiny"]
    out = io.StringIO()
    render(r, Console(file=out, width=80))
    text = out.getvalue()
    table = text[text.index("Parameters"):text.index("Storage")]
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines() if line.count("│") == 4]
    counts = {label: int(count.replace(",", "")) for label, _, count in rows}
    labels = list(counts)
    categories = labels[:labels.index("total")]
    assert sum(counts[c] for c in categories) == counts["total"] == r["params"]
    assert labels[labels.index("total") + 1:] == ["active per token", "of which routed experts"]
    assert counts["active per token"] == r["active_params_per_token"]


def test_plurals(tmp_path):
    model_dir = copy_checkpoint(REFERENCE / "plain_rope_tied_fp16", tmp_path)
    r = describe(model_dir)
    r = {**r, "storage": {**r["storage"], "n_tensors": 1}, "problems": ["missing tensor x"]}
    out = io.StringIO()
    render(r, Console(file=out, width=100))
    assert "total (1 file, 1 tensor)" in out.getvalue() and "1 problem:" in out.getvalue()
    r = {**r, "storage": {**r["storage"], "files": []}, "problems": ["a", "b"]}
    out = io.StringIO()
    render(r, Console(file=out, width=100))
    assert "total (0 files, 1 tensor)" in out.getvalue() and "2 problems:" in out.getvalue()


def test_without_a_usable_config_there_is_no_report(tmp_path):
    """Only config.json is needed for a report: everything else broken is a problem in it
    (see the tests of broken checkpoints below)."""
    with pytest.raises(ConfigError):
        describe(tmp_path / "nowhere")
    with pytest.raises(ConfigError):
        describe(tmp_path)                                          # no config.json
    model_dir = copy_checkpoint(REFERENCE / "plain_rope_tied_fp16", tmp_path)
    (model_dir / "config.json").write_text(json.dumps({**raw_config(model_dir), "hidden_size": "big"}))
    with pytest.raises(ConfigError):
        describe(model_dir)


# ---- output ----

def test_report_is_json(reports):
    r = reports["ds2-tiny"]
    assert json.loads(json.dumps(r)) == r
    for key in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "params",
                "active_params_per_token", "dtypes", "moe_layers", "dense_layers",
                "latent_cache_bytes_per_token", "mha_cache_bytes_per_token", "problems", "warnings",
                "model", "mla", "moe", "params_by_category", "storage", "memory", "tokenizer"):
        assert key in r


def test_human_units():
    assert human_count(15_761_408) == "15.8M"
    assert human_count(235_741_434_880) == "236B"
    assert human_count(999) == "999" and human_count(999_600) == "1M"
    assert human_bytes(2_160_000_000) == "2.16 GB"
    assert human_bytes(640) == "640 B" and human_bytes(1920) == "1.92 kB"


def test_render_shows_key_figures(reports):
    r = reports["ds2-tiny"]
    out = io.StringIO()
    render(r, Console(file=out, width=120))
    text = out.getvalue()
    for title in ("Model", "MLA", "MoE", "Parameters", "Storage", "Memory", "Tokenizer"):
        assert title in text
    for figure in (human_count(r["params"]), human_count(r["active_params_per_token"]),
                   human_bytes(r["latent_cache_bytes_per_token"]),
                   human_bytes(r["mha_cache_bytes_per_token"]),
                   human_bytes(r["storage"]["total_bytes"]), "deepseek_v2", "group-limited greedy", "BF16",
                   "1, 2, 3, 4, 5", "4.0x"):
        assert figure in text
    assert "problem" not in text


def test_render_lists_problems_in_red_and_leaves_warnings_to_the_cli(reports):
    r = {**reports["ds2-tiny"], "problems": ["missing tensor model.norm.weight [256]"],
         "warnings": ["tensor x has 1 NaN and 0 Inf values"]}
    out = io.StringIO()
    render(r, Console(file=out, width=120, force_terminal=True, color_system="standard"))
    text = out.getvalue()
    assert "\x1b[1;31m1 problem:" in text
    assert "\x1b[31m  missing tensor model.norm.weight [256]\x1b[0m" in text
    assert "NaN" not in text                                        # the CLI prints warnings


# ---- broken checkpoints: `ds2 inspect` reports them (JSON or tables) and exits 1 ----

def inspect(*args):
    return CliRunner().invoke(main, ["inspect", *map(str, args)])


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def edit_index(model_dir: Path, edit) -> None:
    edit_json(model_dir / checkpoint.INDEX_NAME, lambda index: edit(index["weight_map"]))


SHARD_1, SHARD_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def duplicate_shard_1(model_dir: Path) -> None:
    shutil.copy(model_dir / SHARD_1, model_dir / "model-extra.safetensors")
    edit_index(model_dir, lambda weights: weights.update({"extra": "model-extra.safetensors"}))


BROKEN = {  # how a copy of ds2-tiny is broken, and the one problem inspect lists for it
    "truncated_shard": (lambda d: truncate(d / SHARD_1, 4_000_000),
                        f"{SHARD_1}: tensor model.embed_tokens.weight offsets [2097152, 4194304] lie outside"),
    "header_not_json": (lambda d: (d / SHARD_2).write_bytes(b"\x07\x00\x00\x00\x00\x00\x00\x00{broken"),
                        f"{SHARD_2}: header is not valid JSON: not a safetensors file"),
    "header_past_the_end": (lambda d: truncate(d / SHARD_2, 100),
                            "is larger than the file (100 bytes): truncated or not a safetensors file"),
    "empty_shard": (lambda d: truncate(d / SHARD_2, 0), f"{SHARD_2}: truncated safetensors file (0 bytes)"),
    "missing_shard": (lambda d: (d / SHARD_2).unlink(), f"names shards that do not exist: {SHARD_2}"),
    "index_not_json": (lambda d: (d / checkpoint.INDEX_NAME).write_text("{"),
                       "is not a valid safetensors index (no weight_map)"),
    "index_outside": (lambda d: edit_index(d, lambda weights: weights.update(x="../x.safetensors")),
                      "names shard files outside the model folder: ['../x.safetensors']"),
    "no_weights": (lambda d: [p.unlink() for p in (d / SHARD_1, d / SHARD_2, d / checkpoint.INDEX_NAME)],
                   "no model.safetensors or model.safetensors.index.json in"),
    "duplicate_shard": (duplicate_shard_1, f"tensor lm_head.weight appears in both {SHARD_1} and "
                                           f"model-extra.safetensors (and 63 more tensors)"),
    "added_tokens_not_a_list": (lambda d: edit_json(d / "tokenizer.json", lambda t: t.update(added_tokens=5)),
                                "tokenizer.json is not a valid tokenizer.json"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", BROKEN)
def test_inspect_reports_a_broken_checkpoint(tmp_path, name):
    """The report is printed whole, with the defect as its one problem (not one per tensor of an
    unreadable shard), and inspect exits 1 naming it; the parameters the config describes are
    counted even when the headers cannot all be read."""
    breaks, message = BROKEN[name]
    model_dir = copy_checkpoint(TINY, tmp_path)
    breaks(model_dir)
    result = inspect("--json", model_dir)
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert len(report["problems"]) == 1 and message in report["problems"][0], report["problems"]
    assert report["params"] == describe(TINY)["params"]
    assert result.stderr.startswith("error: the checkpoint has 1 problem (listed above); first: ")
    tables = inspect(model_dir)
    assert tables.exit_code == 1
    for title in ("Model", "Parameters", "Storage", "Memory", "Tokenizer", "1 problem:"):
        assert title in tables.stdout


def test_an_unreadable_shard_leaves_the_others_in_the_storage_table(tmp_path):
    model_dir = copy_checkpoint(TINY, tmp_path)
    truncate(model_dir / SHARD_1, 4_000_000)
    s = describe(model_dir)["storage"]
    assert s["files"] == [{"name": SHARD_1, "bytes": 4_000_000},
                          {"name": SHARD_2, "bytes": (TINY / SHARD_2).stat().st_size}]
    shard_2 = raw_header(TINY / SHARD_2)
    assert s["dtypes"] == {"BF16": {"params": sum(numel(e) for e in shard_2.values()),
                                    "bytes": sum(2 * numel(e) for e in shard_2.values())}}
    assert s["n_tensors"] == len(shard_2)


def test_check_lists_an_unreadable_tensor_and_an_unsupported_fp8_dtype(tmp_path):
    model_dir = copy_checkpoint(REFERENCE / "plain_rope_tied_fp16", tmp_path)
    rewrite_single_file(model_dir, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(
        ml_dtypes.float8_e5m2)}))
    result = inspect("--json", "--check", model_dir)
    assert result.exit_code == 1
    assert json.loads(result.stdout)["problems"] == [
        "tensor model.norm.weight has unsupported dtype F8_E5M2 (ds2 loads F32, F16, BF16)"]

    shard = model_dir / "model.safetensors"                         # changed after its header was read
    tensors = checkpoint.read_header(shard)
    shard.write_bytes(shard.read_bytes()[:-1000])
    scanned, problems = scan_values(tensors)
    assert scanned["stopped"] and len(problems) == 1
    assert problems[0].startswith("model.safetensors: cannot read tensors: ")
    assert problems[0].endswith(" (the --check scan stopped there)")


def test_fp8_block_size_that_is_not_a_list_is_shown_as_given(tmp_path):
    model_dir = copy_checkpoint(REFERENCE.parent / "reference_v3" / "v3_like_fp8_mtp", tmp_path)
    edit_json(model_dir / "config.json", lambda c: c["quantization_config"].update(weight_block_size=128))
    result = inspect(model_dir)
    assert result.exit_code == 1, result.output
    assert "e4m3, 128 blocks" in result.stdout
    assert "quantization_config.weight_block_size 128 is not supported" in result.stderr


# ---- low-bit checkpoints: weights counted, not bytes ----

@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[int, Path]:
    out = {}
    for bits in (8, 4):
        out[bits] = tmp_path_factory.mktemp("q") / f"tiny-q{bits}"
        result = CliRunner().invoke(main, ["quantize", str(TINY), str(out[bits]), "--bits", str(bits)])
        assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_low_bit_storage_counts_weights_not_bytes(quantized, bits):
    """A q4 byte holds two weights; scales (q8's per row, q4's per group) hold none: their bytes
    are listed with 0 parameters, so the parameters add up to the model's and the bytes to the
    files' data."""
    r, raw = describe(quantized[bits]), raw_headers(quantized[bits])
    # a pair's format from its qweight's dtype (the recipes use q8, q4 and bf16; see qcheckpoint)
    kind = {"I8": "q8", "U8": "q4", "BF16": "bf16"}
    label = {"I8": "q8 (I8)", "U8": "q4 (U8, 2 per byte)", "BF16": "bf16 (BF16)"}
    want, scale_bytes = {}, {}
    for name, e in raw.items():
        if name.endswith((".qweight", ".weight")):
            # a float tensor (a norm; F32 or, for w_uk, w_uv and the gate, BF16) by its dtype
            key = label[e["dtype"]] if name.endswith(".qweight") else e["dtype"]
            want[key] = want.get(key, 0) + numel(e) * (2 if e["dtype"] == "U8" else 1)
        if name.endswith(".scales"):
            key = f"{kind[raw[name[:-len('scales')] + 'qweight']['dtype']]} scales ({e['dtype']})"
            scale_bytes[key] = scale_bytes.get(key, 0) + e["data_offsets"][1] - e["data_offsets"][0]
    assert set(want) == ({"q8 (I8)", "bf16 (BF16)", "BF16", "F32"} if bits == 8
                         else {"q4 (U8, 2 per byte)", "q8 (I8)", "BF16", "F32"})
    assert r["dtypes"] == want
    assert sum(want.values()) == r["params"] == describe(TINY)["params"]
    s = r["storage"]["dtypes"]
    for key, nbytes in scale_bytes.items():
        assert s[key] == {"params": 0, "bytes": nbytes}
    assert sum(d["bytes"] for d in s.values()) == sum(e["data_offsets"][1] - e["data_offsets"][0]
                                                      for e in raw.values())
    assert r["params_by_category"] == describe(TINY)["params_by_category"] and r["problems"] == []


@pytest.mark.slow
def test_low_bit_storage_table(quantized):
    out = io.StringIO()
    render(describe(quantized[4]), Console(file=out, width=80))
    text = out.getvalue()
    rows = {cells[0]: cells[1:] for line in text[text.index("Storage"):text.index("Quantization")].splitlines()
            if len(cells := [c.strip() for c in line.split("│")[1:-1]]) == 3}
    # 4-bit: only the routed experts (5 MoE layers x 8 x 3 x 256 x 128 = 3,932,160); the dense MLP
    # (589,824) and shared experts (491,520) join the 2.76M of attention, embedding and lm_head at q8
    assert rows["q4 (U8, 2 per byte)"] == ["3.93M", "1.97 MB"]
    assert rows["q8 (I8)"] == ["3.84M", "3.84 MB"]
    assert rows["q4 scales (BF16)"][0] == rows["q8 scales (F32)"][0] == "-"


def test_a_broken_quantization_config_is_a_problem(quantized, tmp_path):
    for i, (edit, message) in enumerate([
            (lambda q: q["formats"].update(attention=[]), "gives attention the unknown format []"),
            (lambda q: q.update(bits=[8]), "quantization_config bits must be 8 or 4, got [8]")]):
        model_dir = tmp_path / f"broken-{i}"
        shutil.copytree(quantized[4], model_dir)
        edit_json(model_dir / "config.json", lambda c: edit(c["quantization_config"]))
        result = inspect("--json", model_dir)
        problems = json.loads(result.stdout)["problems"]
        assert result.exit_code == 1 and len(problems) == 1 and message in problems[0], problems


# ---- words ----

@pytest.mark.parametrize("word, a", [
    (8, "an"), (4, "a"), (11, "an"), (18, "an"), (80, "an"), (800, "an"), (8000, "an"), (11_000, "an"),
    (1, "a"), (110, "a"), (180, "a"), ("8.4 GB", "an"), ("18 GB", "an"), ("4.2 GB", "a"), ("1,800,000", "a"),
    ("800,000", "an"), ("MoE", "a"), ("expert", "an"), ("", "a")])
def test_article(word, a):
    assert article(word) == a


def test_an_8_bit_checkpoint_in_the_error_message(quantized):
    result = CliRunner().invoke(main, ["generate", "-m", str(quantized[8]), "--quantize", "4", "hi"])
    assert result.exit_code == 1 and "is already an 8-bit ds2 checkpoint" in result.stderr
    result = CliRunner().invoke(main, ["generate", "-m", str(quantized[4]), "--quantize", "8", "hi"])
    assert result.exit_code == 1 and "is already a 4-bit ds2 checkpoint" in result.stderr
