"""Bad input, faults and hostile files: every one ends in exactly one `error:` line on stderr,
exit code 1 (2 for click's usage errors), no traceback and nothing on stdout; interrupts and
closed pipes exit cleanly; a conversation survives an interrupted reply and saves atomically.

Each case copies a good tiny checkpoint into tmp_path (conftest.checkpoint_copy) and breaks it.
"""

import json
import math
import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import ds2cli
from ds2cli.weights import checkpoint
from ds2cli.generation.conversation import ChatSession, read_messages, write_text_atomic as write_atomic
from ds2cli.cli.main import main
from ds2cli.errors import CheckpointError, ConfigError, Ds2Error, TokenizerError
from ds2cli.generation.sampling import SamplingParams, make_sampler

TINY = "ds2-tiny"                       # 2 bf16 shards + index; LoRA-Q, group-limited MoE, YaRN
SINGLE = "plain_rope_tied_fp16"         # one fp16 model.safetensors, tied embeddings
SHARDED = "lite_like_plainq_yarn"       # 10 bf16 shards with an index
F32 = "v2_like_loraq_grouplimited"      # one float32 model.safetensors


# ---- helpers ----

def cli(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def assert_one_error_line(result, contains=(), exit_code=1):
    """The CLI contract for a failure: one `error:` line on stderr, the exit code, nothing else."""
    contains = (contains,) if isinstance(contains, str) else contains
    assert isinstance(result.exception, SystemExit), f"uncaught {result.exception!r}\n{result.stderr}"
    assert result.exit_code == exit_code, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for text in contains:
        assert text in lines[0]
    return lines[0]


def assert_usage_error(result, contains=()):
    """Usage errors: exit 2, one `error: ...` line on stderr as every other error (not click's
    three lines ending in `Error:`), naming the command's --help, and nothing on stdout."""
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2, result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--help" in lines[0], result.stderr
    for text in (contains,) if isinstance(contains, str) else contains:
        assert text in result.stderr


def edit_json(path: Path, edit) -> None:
    d = json.loads(path.read_text(encoding="utf-8"))
    edit(d)
    path.write_text(json.dumps(d), encoding="utf-8")


def read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_safetensors(path: Path, header: dict, data: bytes) -> None:
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def edit_header(path: Path, edit) -> None:
    """Change header entries in place; the data bytes stay where they were."""
    header, data = read_safetensors(path)
    edit(header)
    write_safetensors(path, header, data)


def edit_tensors(path: Path, edit) -> None:
    """Change the tensors themselves: `edit` gets {name: [dtype, shape, bytes]} and the file is
    laid out again with consistent offsets."""
    header, data = read_safetensors(path)
    tensors = {name: [e["dtype"], e["shape"], data[e["data_offsets"][0]:e["data_offsets"][1]]]
               for name, e in header.items() if name != "__metadata__"}
    edit(tensors)
    header, chunks, offset = {}, [], 0
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        chunks.append(blob)
        offset += len(blob)
    write_safetensors(path, header, b"".join(chunks))


def fill(value):
    """An edit_tensors edit that sets model.norm.weight (float16) to `value` everywhere."""
    def edit(tensors):
        dtype, shape, _ = tensors["model.norm.weight"]
        tensors["model.norm.weight"][2] = np.full(shape, value, np.float16).tobytes()
    return edit


def without_eos(model_dir: Path) -> Path:
    """ds2-tiny that never stops by itself: no eos in config, generation_config or tokenizer."""
    edit_json(model_dir / "config.json", lambda d: d.pop("eos_token_id"))
    edit_json(model_dir / "generation_config.json", lambda d: d.pop("eos_token_id"))
    edit_json(model_dir / "tokenizer_config.json", lambda d: d.update(eos_token=None))
    return model_dir


# ---- the model directory ----

def test_model_directory_missing(tmp_path):
    assert_one_error_line(cli("generate", "-m", tmp_path / "nowhere", "hi"), "no such file or directory")
    # a missing GGUF file is not called a missing "model directory"
    line = cli("generate", "-m", tmp_path / "model.Q8_0.gguf", "hi").stderr
    assert "no such file or directory" in line and "model directory" not in line


def test_model_directory_empty(tmp_path):
    assert_one_error_line(cli("generate", "-m", tmp_path, "hi"), "has no config.json")


def test_model_directory_is_a_file(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    assert_one_error_line(cli("generate", "-m", tmp_path / "model.bin", "hi"), "is a file")


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["inspect"]])
def test_every_command_reports_a_missing_config(checkpoint_copy, command):
    model_dir = checkpoint_copy(SINGLE)
    (model_dir / "config.json").unlink()
    assert_one_error_line(cli(*command, "-m", model_dir, input="hi\n"), "has no config.json")


# ---- config.json ----

@pytest.mark.parametrize("text, message", [
    ("{\"model_type\": \"deepseek_v2\",", "is not valid JSON"),
    ("", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object, not list"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("{\"model_type\": \"deepseek_v2\", \"vocab_size\": " + "9" * 5000 + "}", "too many digits"),
], ids=["truncated", "empty", "list", "deeply_nested", "huge_integer"])
def test_config_not_json(checkpoint_copy, text, message):
    model_dir = checkpoint_copy(SINGLE)
    (model_dir / "config.json").write_text(text)
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), ("config.json", message))


def test_config_not_utf8(checkpoint_copy):
    model_dir = checkpoint_copy(SINGLE)
    (model_dir / "config.json").write_bytes(b"{\"model_type\": \"deepseek\xff\"}")
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), "is not valid JSON")


def setter(**fields):
    return lambda d: d.update(fields)


def remover(*keys):
    return lambda d: [d.pop(k) for k in keys]


CONFIG_CASES = {
    "missing_required_field": (remover("hidden_size"), "missing the required field hidden_size"),
    "string_for_int": (setter(hidden_size="256"), "hidden_size must be an integer, got '256'"),
    "bool_for_int": (setter(num_hidden_layers=True), "num_hidden_layers must be an integer"),
    "float_for_int": (setter(kv_lora_rank=64.5), "kv_lora_rank must be an integer"),
    "null_for_int": (setter(vocab_size=None), "vocab_size must be an integer"),
    "zero_heads": (setter(num_attention_heads=0), "num_attention_heads must be >= 1, got 0"),
    "negative_hidden_size": (setter(hidden_size=-256), "hidden_size must be >= 1, got -256"),
    "negative_intermediate": (setter(intermediate_size=-1), "intermediate_size must be >= 1"),
    "kv_lora_rank_zero": (setter(kv_lora_rank=0), "kv_lora_rank must be >= 1, got 0"),
    "q_lora_rank_zero": (setter(q_lora_rank=0), "q_lora_rank must be >= 1, got 0"),
    "negative_shared_experts": (setter(n_shared_experts=-1), "n_shared_experts must be >= 0"),
    "zero_context": (setter(max_position_embeddings=0), "max_position_embeddings must be >= 1"),
    "odd_rope_dim": (setter(qk_rope_head_dim=15), "qk_rope_head_dim must be even"),
    "topk_above_experts": (setter(num_experts_per_tok=9),
                           "num_experts_per_tok (9) is larger than n_routed_experts (8)"),
    "experts_not_divisible_by_groups": (setter(n_group=3),
                                        "n_routed_experts (8) is not divisible by n_group (3)"),
    "topk_group_above_groups": (setter(topk_group=5), "topk_group (5) is larger than n_group (4)"),
    "groups_missing": (remover("n_group"), "needs n_group and topk_group"),
    "topk_without_experts_count": (setter(num_experts_per_tok=None),
                                   "num_experts_per_tok is required when n_routed_experts is set"),
    "v3_router": (setter(topk_method="noaux_tc"), "unsupported topk_method 'noaux_tc'"),
    "sigmoid_scoring": (setter(scoring_func="sigmoid"), "unsupported scoring_func 'sigmoid'"),
    "gelu": (setter(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
    "zero_eps": (setter(rms_norm_eps=0), "rms_norm_eps and rope_theta must be > 0"),
    "nan_eps": (setter(rms_norm_eps=math.nan), "rms_norm_eps must be a number"),
    "string_theta": (setter(rope_theta="10k"), "rope_theta must be a number"),
    "linear_rope_scaling": (setter(rope_scaling={"type": "linear", "factor": 2.0}),
                            "unsupported rope_scaling type 'linear'"),
    "negative_yarn_factor": (setter(rope_scaling={"type": "yarn", "factor": -4.0}),
                             "rope_scaling.factor must be > 0"),
    "string_yarn_factor": (setter(rope_scaling={"type": "yarn", "factor": "4"}),
                           "rope_scaling.factor must be a number"),
    "rope_scaling_list": (setter(rope_scaling=[4.0]), "rope_scaling must be an object or null"),
    "rope_parameters_string": (lambda d: (d.pop("rope_scaling"), d.update(rope_parameters="yarn")),
                               "rope_parameters must be an object"),
    "eos_string": (setter(eos_token_id="</s>"), "eos_token_id must be an integer or a list"),
    "bool_flag_string": (setter(tie_word_embeddings="no"), "tie_word_embeddings must be true or false"),
    "absurd_layer_count": (setter(num_hidden_layers=10**12), "num_hidden_layers must be <="),
}


@pytest.mark.parametrize("edit, message", CONFIG_CASES.values(), ids=CONFIG_CASES.keys())
def test_config_field_errors_name_the_field(checkpoint_copy, edit, message):
    model_dir = checkpoint_copy(TINY)
    edit_json(model_dir / "config.json", edit)
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), message)
    with pytest.raises(ConfigError, match=re.escape(message)):
        ds2cli.load(model_dir)


@pytest.mark.parametrize("model_type", ["llama", "kimi_k2", "qwen2_moe", None])
def test_another_family_is_named(checkpoint_copy, model_type):
    model_dir = checkpoint_copy(SINGLE)
    edit_json(model_dir / "config.json", setter(model_type=model_type))
    for command in (["generate", "hi"], ["inspect"]):
        line = assert_one_error_line(cli(*command, "-m", model_dir), "not a DeepSeek-V2 checkpoint")
        assert repr(model_type) in line


def test_missing_model_type_is_another_family(checkpoint_copy):
    model_dir = checkpoint_copy(SINGLE)
    edit_json(model_dir / "config.json", remover("model_type"))
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"),
                          "not a DeepSeek-V2 checkpoint: model_type is None")


def test_config_describing_absurdly_many_experts_fails_fast(checkpoint_copy, monkeypatch):
    """A hostile expert count must not make ds2 build a table of billions of tensor names."""
    model_dir = checkpoint_copy(TINY)
    edit_json(model_dir / "config.json", setter(n_routed_experts=4 * 10**9))
    # the config describes over 10**10 tensor names; count those ds2 draws from the expected
    # names (ds2-tiny holds a few hundred tensors), and stop it if it goes on drawing
    real, drawn, most = checkpoint.iter_expected, [0], 100_000

    def counted(cfg):
        for item in real(cfg):
            drawn[0] += 1
            if drawn[0] > most:
                raise RuntimeError(f"drew more than {most} expected tensor names")
            yield item
    monkeypatch.setattr(checkpoint, "iter_expected", counted)
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"),
                          ("does not match its config", "n_routed_experts 4000000000"))
    assert 0 < drawn[0] <= most


def test_broken_generation_config(checkpoint_copy):
    model_dir = checkpoint_copy(SINGLE)
    (model_dir / "generation_config.json").write_text("{\"temperature\": 0.7,")
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), "generation_config.json is not valid JSON")


@pytest.mark.parametrize("text", ["{\"temperature\": " + "1" * 5000 + "}", "[" * 100_000],
                         ids=["huge_number", "deeply_nested"])
def test_hostile_generation_config(checkpoint_copy, text):
    model_dir = checkpoint_copy(SINGLE)
    (model_dir / "generation_config.json").write_text(text)
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), "generation_config.json")


def test_inspect_with_a_hostile_tokenizer_config(checkpoint_copy):
    pytest.importorskip("ds2cli.cli.inspect_report")
    model_dir = checkpoint_copy(SINGLE)
    (model_dir / "tokenizer_config.json").write_text("{\"add_bos_token\": " + "1" * 5000 + "}")
    result = cli("inspect", "--json", model_dir)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "tokenizer_config.json" in result.stderr and "Traceback" not in result.stderr


def test_cache_too_large_for_memory_is_an_error_line(checkpoint_copy):
    """A config that allows 10^15 positions and -n 10^13: the memory check counts the context
    generate will use (prompt + -n) and refuses it; past the check, numpy cannot allocate it."""
    model_dir = checkpoint_copy(SINGLE)
    edit_json(model_dir / "config.json", setter(max_position_embeddings=10**15))
    assert_one_error_line(cli("generate", "-m", model_dir, "hi", "-n", 10**13), ("is available",))
    assert_one_error_line(cli("generate", "-m", model_dir, "hi", "-n", 10**13, "--no-memory-check"),
                          ("out of memory", "Unable to allocate"))


# ---- safetensors files ----

def truncate(fraction):
    def edit(path: Path):
        raw = path.read_bytes()
        path.write_bytes(raw[:int(len(raw) * fraction)])
    return edit


def set_header_length(n):
    def edit(path: Path):
        raw = path.read_bytes()
        path.write_bytes(struct.pack("<Q", n) + raw[8:])
    return edit


def replace_header(text: bytes):
    def edit(path: Path):
        _, data = read_safetensors(path)
        path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return edit


def header_edit(edit):
    return lambda path: edit_header(path, edit)


def tensors_edit(edit):
    return lambda path: edit_tensors(path, edit)


def offsets(name, begin, end):
    return header_edit(lambda h: h[name].update(data_offsets=[begin, end]))


def overlap(h):
    # make layer 1's input_layernorm (same dtype and size) point at layer 0's bytes
    h["model.layers.1.input_layernorm.weight"]["data_offsets"] = \
        h["model.layers.0.input_layernorm.weight"]["data_offsets"]


def reshape(name, shape):
    def edit(tensors):
        dtype, _, _ = tensors[name]
        tensors[name][1:] = [shape, bytes(math.prod(shape) * checkpoint.DTYPE_SIZES[dtype])]
    return edit


def retype(name, dtype):
    def edit(tensors):
        _, shape, _ = tensors[name]
        tensors[name][::2] = [dtype, bytes(math.prod(shape) * checkpoint.DTYPE_SIZES[dtype])]
    return edit


NORM = "model.norm.weight"
EMBED = "model.embed_tokens.weight"
SAFETENSORS_CASES = {
    "truncated_in_the_data": (truncate(0.5), "lie outside the"),
    "truncated_in_the_header": (truncate(0.002), "larger than the file"),
    "truncated_to_4_bytes": (lambda p: p.write_bytes(b"\x10\0\0\0"), "truncated safetensors file"),
    "empty_file": (lambda p: p.write_bytes(b""), "truncated safetensors file (0 bytes)"),
    "header_length_past_the_end": (set_header_length(10**9), "header length 1000000000 is larger"),
    "header_length_2_64": (set_header_length(2**64 - 1), "is larger than the file"),
    "header_not_json": (replace_header(b"this is not json"), "header is not valid JSON"),
    "header_not_utf8": (replace_header(b"{\"\xff\xfe\": 1}"), "header is not valid JSON"),
    "header_a_list": (replace_header(b"[]"), "header is not a JSON object"),
    "header_deeply_nested": (replace_header(b"[" * 50_000 + b"]" * 50_000), "header is not valid JSON"),
    "header_huge_number": (replace_header(b"{\"x\": " + b"7" * 5000 + b"}"), "header is not valid JSON"),
    "entry_not_an_object": (header_edit(lambda h: h.update({NORM: 3})), "malformed header entry"),
    "offsets_past_the_end": (offsets(NORM, 0, 10**12), "lie outside the"),
    "offsets_reversed": (offsets(NORM, 256, 0), "lie outside the"),
    "offsets_negative": (offsets(NORM, -256, 0), "bad shape or offsets"),
    "offsets_wrong_length": (offsets(NORM, 0, 100), f"tensor {NORM} occupies 100 bytes"),
    "offsets_overlap": (header_edit(overlap), "overlap"),
    "data_gap": (header_edit(lambda h: h.pop("model.layers.0.input_layernorm.weight")),
                 "data bytes [1048576, 1048832) belong to no tensor"),
    "trailing_data": (lambda p: p.write_bytes(p.read_bytes() + b"\0" * 16),
                      "the last 16 data bytes belong to no tensor"),
    "metadata_not_strings": (header_edit(lambda h: h.update(__metadata__={"format": 1})),
                             "__metadata__ must map strings to strings"),
    "shape_negative": (header_edit(lambda h: h[NORM].update(shape=[-128])), "bad shape or offsets"),
    "shape_absurd": (header_edit(lambda h: h[NORM].update(shape=[2**64 - 1] * 100_000)),  # a 37 s product
                     f"tensor {NORM} occupies 256 bytes but F16 [18446744073709551615, "),
    "dtype_unknown": (header_edit(lambda h: h[NORM].update(dtype="F12")), "unknown dtype 'F12'"),
    "dtype_i32": (tensors_edit(retype(NORM, "I32")), f"tensor {NORM} has unsupported dtype I32"),
    "dtype_f8": (tensors_edit(retype(EMBED, "F8_E4M3")),
                 f"tensor {EMBED} has unsupported dtype F8_E4M3"),
    "shape_disagrees_with_config": (tensors_edit(reshape(NORM, [127])),
                                    f"tensor {NORM} has shape [127], config says [128]"),
    "tensor_missing": (tensors_edit(lambda t: t.pop("model.layers.1.self_attn.q_proj.weight")),
                       "missing tensor model.layers.1.self_attn.q_proj.weight [96, 128]"),
    "tensor_unexpected": (tensors_edit(lambda t: t.update({"model.layers.9.extra.weight": ["F16", [2], b"\0" * 4]})),
                          "unexpected tensor model.layers.9.extra.weight"),
}


@pytest.mark.parametrize("breaks, message", SAFETENSORS_CASES.values(), ids=SAFETENSORS_CASES.keys())
def test_broken_safetensors(checkpoint_copy, breaks, message):
    model_dir = checkpoint_copy(SINGLE)
    breaks(model_dir / "model.safetensors")
    line = assert_one_error_line(cli("generate", "-m", model_dir, "hi"), message)
    assert len(line) < 2000
    with pytest.raises(CheckpointError):
        ds2cli.load(model_dir)


def test_header_over_the_safetensors_limit(checkpoint_copy):
    """A header of 100 MB + 1 byte (valid JSON, padded) is refused before it is read."""
    model_dir = checkpoint_copy(SINGLE)
    path = model_dir / "model.safetensors"
    header, data = read_safetensors(path)
    head = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", checkpoint.MAX_HEADER_BYTES + 1) + head)
        f.seek(8 + checkpoint.MAX_HEADER_BYTES + 1)
        f.write(data)  # the padding is a hole of zero bytes: cheap on disk
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), "over the safetensors limit of 100000000 bytes")


def test_float32_tensor_retyped_as_int32(checkpoint_copy):
    """Same bytes, other dtype: a F32 tensor relabelled I32 is refused, not loaded as garbage."""
    model_dir = checkpoint_copy(F32)
    edit_header(model_dir / "model.safetensors", lambda h: h[NORM].update(dtype="I32"))
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), "unsupported dtype I32")


def test_problems_are_reported_together(checkpoint_copy):
    model_dir = checkpoint_copy(SINGLE)
    edit_tensors(model_dir / "model.safetensors",
                 lambda t: (t.pop(NORM), reshape(EMBED, [4095, 128])(t)))
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"),
                          ("2 problems", f"missing tensor {NORM}", f"tensor {EMBED} has shape"))


def test_no_weights_at_all(checkpoint_copy):
    model_dir = checkpoint_copy(SINGLE)
    (model_dir / "model.safetensors").unlink()
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), "no model.safetensors or")


def test_weights_file_is_a_directory(checkpoint_copy):
    model_dir = checkpoint_copy(SINGLE)
    (model_dir / "model.safetensors").unlink()
    (model_dir / "model.safetensors").mkdir()
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), "no model.safetensors or")


def shard(model_dir: Path, i: int) -> Path:
    return model_dir / f"model-{i:05d}-of-00010.safetensors"


def test_index_names_a_shard_that_does_not_exist(checkpoint_copy):
    model_dir = checkpoint_copy(SHARDED)
    shard(model_dir, 4).unlink()
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"),
                          "names shards that do not exist: model-00004-of-00010.safetensors")


@pytest.mark.parametrize("text, message", [
    ("{\"weight_map\": ", "is not a valid safetensors index"),
    ("{\"metadata\": {}}", "is not a valid safetensors index"),
    ("{\"weight_map\": [1]}", "is not a valid safetensors index"),
    ("{\"weight_map\": {\"a\": 1, \"b\": \"x\"}}", "is not a valid safetensors index"),
    ("[" * 100_000, "is not a valid safetensors index"),
    ("{\"weight_map\": {\"a\": " + "1" * 5000 + "}}", "is not a valid safetensors index"),
    ("{\"weight_map\": {\"a\": \"../../etc/passwd\"}}", "outside the model folder"),
], ids=["truncated", "no_weight_map", "list", "mixed_types", "deeply_nested", "huge_number", "escape"])
def test_broken_index(checkpoint_copy, text, message):
    model_dir = checkpoint_copy(SHARDED)
    (model_dir / checkpoint.INDEX_NAME).write_text(text)
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), message)


def test_two_shards_hold_the_same_tensor(checkpoint_copy):
    model_dir = checkpoint_copy(SHARDED)
    header, data = read_safetensors(shard(model_dir, 3))
    name = "model.layers.0.input_layernorm.weight"
    begin, end = header[name]["data_offsets"]
    copied = data[begin:end]
    entry = [header[name]["dtype"], header[name]["shape"], copied]
    edit_tensors(shard(model_dir, 4), lambda t: t.update({name: entry}))
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"),
                          (f"tensor {name} appears in both", "model-00003-of-00010", "model-00004-of-00010"))


def test_a_shard_truncated_after_the_headers_were_read(checkpoint_copy, monkeypatch):
    """The file changes between validation and loading: the data read fails as a CheckpointError."""
    model_dir = checkpoint_copy(SINGLE)
    validate = checkpoint.validate

    def validate_then_truncate(cfg, path):
        tensors = validate(cfg, path)
        truncate(0.5)(model_dir / "model.safetensors")
        return tensors
    monkeypatch.setattr(checkpoint, "validate", validate_then_truncate)
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), "model.safetensors")


# ---- NaN and Inf weights ----

@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_generate_stops_on_nonfinite_logits(checkpoint_copy, value):
    model_dir = checkpoint_copy(SINGLE)
    edit_tensors(model_dir / "model.safetensors", fill(value))
    assert_one_error_line(cli("generate", "-m", model_dir, "hi", "-n", "5"),
                          ("non-finite logits", "ds2 inspect --check"))


def test_chat_stops_on_nonfinite_logits(checkpoint_copy):
    model_dir = checkpoint_copy(SINGLE)
    edit_tensors(model_dir / "model.safetensors", fill(np.nan))
    assert_one_error_line(cli("chat", "-m", model_dir, input="hi\n"), "non-finite logits")


@pytest.mark.parametrize("value, count", [(np.nan, "128 NaN"), (-np.inf, "128 Inf")])
def test_inspect_check_lists_nonfinite_weights_as_problems(checkpoint_copy, value, count):
    model_dir = checkpoint_copy(SINGLE)
    edit_tensors(model_dir / "model.safetensors", fill(value))
    result = cli("inspect", "--check", "--json", model_dir)
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["check"]["nonfinite_tensors"] == 1 and report["warnings"] == [] and len(report["problems"]) == 1
    assert NORM in report["problems"][0] and count in report["problems"][0]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the checkpoint has 1 problem ") and count in lines[0]
    clean = cli("inspect", "--check", "--json", checkpoint_copy(TINY))
    assert clean.exit_code == 0 and clean.stderr == "" and json.loads(clean.stdout)["problems"] == []


# ---- the tokenizer ----

def test_tokenizer_json_missing(checkpoint_copy):
    model_dir = checkpoint_copy(SINGLE)
    (model_dir / "tokenizer.json").unlink()
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), "tokenizer.json not found")


@pytest.mark.parametrize("corrupt", [
    lambda raw: raw[:len(raw) // 2],
    lambda raw: b"\xff\xfe" + raw,
    lambda raw: b"{}",
    lambda raw: b"[" * 100_000,
], ids=["truncated", "not_utf8", "empty_object", "deeply_nested"])
def test_tokenizer_json_corrupt(checkpoint_copy, corrupt):
    model_dir = checkpoint_copy(SINGLE)
    path = model_dir / "tokenizer.json"
    path.write_bytes(corrupt(path.read_bytes()))
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), "is not a valid tokenizer.json")


@pytest.mark.parametrize("text", ["{\"bos_token\": ", "[" * 100_000, "{\"add_bos_token\": " + "1" * 5000 + "}"],
                         ids=["truncated", "deeply_nested", "huge_number"])
def test_tokenizer_config_corrupt(checkpoint_copy, text):
    model_dir = checkpoint_copy(SINGLE)
    (model_dir / "tokenizer_config.json").write_text(text)
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), "tokenizer_config.json")


def test_tokenizer_vocabulary_larger_than_the_model(checkpoint_copy):
    model_dir = checkpoint_copy(SINGLE)
    extra = {"id": 4096, "content": "<extra>", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
    edit_json(model_dir / "tokenizer.json", lambda d: d["added_tokens"].append(extra))
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"),
                          "the tokenizer has 4097 token ids but the model's vocab_size is 4096")


BROKEN_TEMPLATE = ("{{ bos_token }}\n{% for m in messages %}\n"
                   "{{ m['content'] | upper() + m.missing.deeper }}\n{% endfor %}")  # line 3 fails


def test_chat_template_that_fails_to_render_names_its_line(checkpoint_copy):
    model_dir = checkpoint_copy(TINY)
    edit_json(model_dir / "tokenizer_config.json", setter(chat_template=BROKEN_TEMPLATE))
    assert_one_error_line(cli("generate", "-m", model_dir, "--chat", "hi"), "chat template line 3")
    assert_one_error_line(cli("chat", "-m", model_dir, input="hi\n"), "chat template line 3")
    # plain completion does not render the template, so it still works
    assert cli("generate", "-m", model_dir, "hi", "-n", "2").exit_code == 0


def test_chat_template_raise_exception_is_an_error_line(checkpoint_copy):
    model_dir = checkpoint_copy(TINY)
    template = "{{ bos_token }}\n{{ raise_exception('Conversation roles must alternate') }}"
    edit_json(model_dir / "tokenizer_config.json", setter(chat_template=template))
    assert_one_error_line(cli("generate", "-m", model_dir, "--system", "be brief", "hi"),
                          "chat template line 2: Conversation roles must alternate")


def test_chat_template_syntax_error_names_its_line(checkpoint_copy):
    model_dir = checkpoint_copy(TINY)
    edit_json(model_dir / "tokenizer_config.json", setter(chat_template="{{ bos_token }}\n\n{% if %}"))
    assert_one_error_line(cli("generate", "-m", model_dir, "--chat", "hi"), "chat template line 3")


# ---- prompts and the context ----

def test_prompt_longer_than_the_context():
    result = cli("generate", "--ctx", "8", "to be or not to be, that is the question " * 4)
    assert_one_error_line(result, "more than the context of 8 tokens")


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"]])
@pytest.mark.parametrize("args, option, text", [
    (["--ctx", "4096"], "--ctx", "4096 is larger than the model's max_position_embeddings (1024)"),
    (["--top-p", "2"], "--top-p", "2.0 is not in the range 0<x<=1"),
    (["--top-p", "0"], "--top-p", "0.0 is not in the range 0<x<=1"),
    (["--temperature", "-1"], "--temperature", "-1.0 is not in the range x>=0"),
    (["--temp", "-1"], "--temperature", "-1.0 is not in the range x>=0"),
    (["--min-p", "5"], "--min-p", "5.0 is not in the range 0<=x<=1"),
    (["--top-k", "-3"], "--top-k", "-3 is not in the range x>=0"),
    (["--repetition-penalty", "0"], "--repetition-penalty", "0.0 is not in the range x>0"),
    (["--threads", "0"], "--threads", "0 is not in the range x>=1"),
])
def test_options_are_refused_before_any_weight_loads(no_loading, command, args, option, text):
    assert_usage_error(cli(*command, *args, input="hi\n"), (f"'{option}'", text))


def test_ctx_is_checked_against_the_model_named_by_ds2_model(no_loading, checkpoint_copy):
    model_dir = checkpoint_copy(SINGLE)
    limit = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    result = CliRunner(env={"DS2_MODEL": str(model_dir)}).invoke(main, ["generate", "hi", "--ctx", str(limit + 1)])
    assert_usage_error(result, f"max_position_embeddings ({limit})")


def test_prompt_file_not_utf8(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes("Caf\u00e9 cr\u00e8me".encode("latin-1"))
    line = assert_one_error_line(cli("generate", "--prompt-file", prompt, "-n", "2"), "--encoding")
    assert "not valid utf-8" in line and "byte 3" in line
    result = cli("generate", "--prompt-file", prompt, "-n", "2", "--encoding", "latin-1", "--temperature", "0")
    assert result.exit_code == 0 and result.stdout.strip() and result.stderr == ""


def test_stdin_not_utf8():
    assert_one_error_line(cli("generate", "-n", "2", input=b"\xff\xfe hello"), ("stdin", "--encoding"))
    assert cli("generate", "-n", "2", "--encoding", "cp1252", input=b"caf\xe9").exit_code == 0


def test_unknown_encoding_is_a_usage_error(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    assert_usage_error(cli("generate", "--prompt-file", prompt, "--encoding", "klingon"), "klingon")


def test_prompt_file_missing(tmp_path):
    assert_one_error_line(cli("generate", "--prompt-file", tmp_path / "nope.txt"), "cannot read prompt file")


@pytest.mark.parametrize("args, text", [
    (["-n", "0"], "--max-new-tokens"),
    (["--ctx", "0"], "--ctx"),
    (["--top-p", "half"], "--top-p"),
])
def test_bad_options_are_usage_errors(args, text):
    assert_usage_error(cli("generate", "hi", *args), text)


@pytest.mark.parametrize("args, text", [
    (["quantize"], "Missing argument 'SRC'"),
    (["quantize", "a"], "Missing argument 'DST'"),
    (["quantize", "a", "b"], "Missing option '--bits'"),
    (["quantize", "a", "b", "--bits", "3"], "'3' is not one of '8', '4'"),
    (["generate", "--temperature", "x"], "'x' is not a valid float"),
    (["generate", "hi", "--quantize", "3"], "'--quantize'"),
    (["chat", "extra"], "unexpected extra argument"),
    (["serve", "--port", "99999"], "'--port'"),
    (["serve", "--cors-origin", "foo"], "not an origin"),
    (["bench", "-r", "0"], "'--repeats'"),
    (["bench", "--formats", "x"], "expected formats among f32, 8, 4"),
    (["bench", "-p", "a"], "expected comma-separated whole numbers"),
    (["bench", "--quantize", "8", "--formats", "8"], "cannot be combined"),
    (["inspect", "a", "b"], "unexpected extra argument"),
    (["nosuch"], "No such command 'nosuch'"),
    (["--nosuch"], "No such option '--nosuch'"),
    *(([command, "--nosuch"], "No such option '--nosuch'")
      for command in ("generate", "chat", "serve", "quantize", "inspect", "bench")),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_usage_errors_of_every_command_are_one_line(no_loading, args, text):
    assert_usage_error(cli(*args), text)


@pytest.mark.parametrize("args", [["chat", "--session"], ["generate", "hi", "--stop"],
                                  ["quantize", "a", "b", "--bits"], ["bench", "-r"], ["serve", "--port"]])
def test_an_option_given_no_value_is_one_usage_line(no_loading, args):
    result = cli(*args)
    assert result.exit_code == 2 and result.stdout == "", result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "requires an argument" in lines[0]


@pytest.mark.parametrize("args", [["chat", "--session"], ["serve", "--port"]])
def test_an_option_given_no_value_names_the_commands_help(no_loading, args):
    """click's parser raises this error without a context; Ds2Group.invoke gives it the command's."""
    assert_usage_error(cli(*args), ("requires an argument", f"(see 'main {args[0]} --help')"))


def test_ds2_alone_shows_the_help():
    """The whole help, as click >= 8.2 shows it for a missing command: on stderr, exit code 2."""
    result = cli()
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("Usage: ") and "\nCommands:\n" in result.stderr
    assert "error:" not in result.stderr


def test_bad_sampling_values_from_generation_config_are_errors(checkpoint_copy):
    model_dir = checkpoint_copy(TINY)
    edit_json(model_dir / "generation_config.json", setter(top_p=1.5))
    assert_one_error_line(cli("generate", "-m", model_dir, "hi"), "top-p must be in (0, 1]")


def test_chat_load_of_a_broken_conversation(tmp_path):
    for text in ("[{\"role\": \"user\"", "[{\"role\": \"wizard\", \"content\": \"x\"}]", "[" * 100_000):
        (tmp_path / "conv.json").write_text(text)
        assert_one_error_line(cli("chat", "--load", tmp_path / "conv.json", input="/exit\n"), "conv.json")
    assert_one_error_line(cli("chat", "--load", tmp_path / "none.json", input="/exit\n"), "does not exist")


# ---- real processes: the error contract, interrupts and closed pipes ----

def ds2_process(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "ds2cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, **kwargs)


# `python -m ds2cli` whose model counts its decode steps (each feeds back a sampled token) into
# a file and, at one step, pauses: until a Ctrl-C ("ctrl-c", said on stderr first), or until
# the reader of its stdout has gone (a pipe's write end polls POLLERR once it has no reader)
PAUSING_DS2 = """
import os, runpy, select, sys, time
import ds2cli
step, until, count_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
del sys.argv[1:4]
forward, steps = ds2cli.Model.forward_batch, [0]

def spied_forward(self, batch, *args, **kwargs):
    if len(batch[0].ids) == 1:
        steps[0] += 1
        with open(count_file, "w") as f:
            f.write(str(steps[0]))
        if steps[0] == step and until == "ctrl-c":
            os.write(2, b"paused for ctrl-c\\n")
            for _ in range(600):     # short sleeps: a SIGINT landing before one begins is seen at
                time.sleep(0.1)      # the next, where one sleep(60) would sleep on through it
        elif steps[0] == step:
            poll = select.poll()
            poll.register(1, 0)
            poll.poll(60_000)
    return forward(self, batch, *args, **kwargs)

ds2cli.Model.forward_batch = spied_forward
runpy.run_module("ds2cli", run_name="__main__")
"""


def pausing_ds2_process(step: int, until: str, count_file: Path, *args):
    return subprocess.Popen([sys.executable, "-c", PAUSING_DS2, str(step), until, str(count_file),
                             *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.parametrize("breaks, message", [
    (lambda d: edit_tensors(d / "model.safetensors", fill(np.inf)), "non-finite logits"),
    (lambda d: edit_tensors(d / "model.safetensors", fill(np.nan)), "non-finite logits"),
    (lambda d: truncate(0.5)(d / "model.safetensors"), "lie outside the"),
    (lambda d: (d / "config.json").write_text("[" * 100_000), "nested too deeply"),
], ids=["inf_weights", "nan_weights", "truncated_weights", "nested_config"])
def test_error_contract_in_a_real_process(checkpoint_copy, breaks, message):
    """No numpy RuntimeWarning, no traceback: stderr is exactly one line, stdout is empty."""
    model_dir = checkpoint_copy(SINGLE)
    breaks(model_dir)
    out, err = ds2_process("generate", "-m", model_dir, "hi", "-n", "5").communicate(timeout=60)
    lines = err.decode().splitlines()
    assert out == b"" and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


@pytest.mark.slow
def test_closed_pipe_exits_quietly(checkpoint_copy, tmp_path):
    """`ds2 generate ... | head -c 10`: the reader leaves; ds2 stops without a traceback."""
    model_dir = without_eos(checkpoint_copy(TINY))
    steps = tmp_path / "steps"
    # ds2 waits at its 20th decode step (past 10 bytes of text) until the reader has left, so
    # that it cannot finish the 1000 tokens before the pipe breaks
    proc = pausing_ds2_process(20, "reader-gone", steps, "generate", "-m", model_dir, "ROMEO:", "-n", "1000",
                               "--temperature", "0.8", "--seed", "0")
    first = proc.stdout.read(10)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0
    assert len(first) == 10
    assert stderr == ""
    assert int(steps.read_text()) < 1000  # it stopped at the broken pipe, not after 1000 tokens


@pytest.mark.slow
@pytest.mark.parametrize("args, stdin", [
    (["chat", "--temperature", "1", "--seed", "1"], b"Tell me a long story.\nAnother one.\nAnd another.\n"),
    (["inspect"], b""),
], ids=["chat", "inspect"])
def test_closed_pipe_in_other_commands(args, stdin):
    """`ds2 chat < questions | head -c 5`, `ds2 inspect | head -c 5`: no traceback either."""
    proc = subprocess.Popen([sys.executable, "-m", "ds2cli", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(stdin)
    proc.stdin.close()
    assert len(proc.stdout.read(5)) == 5
    proc.stdout.close()
    assert proc.stderr.read() == b""
    assert proc.wait(timeout=60) == 0            # the same exit code as generate


@pytest.mark.slow
def test_sigint_during_generation_exits_130(checkpoint_copy):
    model_dir = without_eos(checkpoint_copy(TINY))
    proc = ds2_process("generate", "-m", model_dir, "ROMEO:", "-n", "1000", "--temperature", "0.8", "--seed", "0")
    first = proc.stdout.read(1)  # generation has started
    proc.send_signal(signal.SIGINT)
    rest, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert first and rest.endswith(b"\n")
    assert "Traceback" not in stderr.decode() and "KeyboardInterrupt" not in stderr.decode()


def test_sigint_while_loading_exits_130(checkpoint_copy, command_loads):
    """Ctrl-C before any output (while the model loads): exit 130, no traceback, no `Aborted!`."""
    def interrupted_load(*args, **kwargs):
        raise KeyboardInterrupt
    command_loads(interrupted_load)
    result = cli("generate", "hi")
    assert isinstance(result.exception, SystemExit) and result.exit_code == 130
    assert result.stdout == "" and "Traceback" not in result.stderr and "Aborted" not in result.stderr


# ---- chat: an interrupted reply loses nothing, saving is atomic ----

@pytest.fixture(scope="module")
def tiny_model():
    return ds2cli.load()


def greedy():
    return make_sampler(SamplingParams(temperature=0.0))


def test_interrupted_reply_keeps_the_conversation(tiny_model, tmp_path):
    session = ChatSession(tiny_model, capacity=512, system="You are ds2-tiny.")
    reply = session.reply("Who are you?", greedy(), 64)
    first = next(reply)
    assert first.text
    with pytest.raises(KeyboardInterrupt):
        reply.throw(KeyboardInterrupt)
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    assert session.messages[2]["content"] == first.text.strip()
    assert session.cached_ids == session.model.tokenizer.encode_chat(session.messages[:2])[:session.cache.length]

    answer = "".join(c.text for c in session.reply("What is 451 - 123?", greedy(), 32)).strip()
    assert answer == "451 - 123 = 328."
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]

    path = tmp_path / "conversation.json"
    session.save(path)
    assert read_messages(path) == session.messages
    assert json.loads(path.read_text(encoding="utf-8")) == session.messages
    assert os.listdir(tmp_path) == ["conversation.json"]


def test_reply_closed_before_any_text_keeps_the_user_turn(tiny_model):
    session = ChatSession(tiny_model, capacity=512)
    reply = session.reply("Hello", greedy(), 16)
    next(reply)
    reply.close()
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert "".join(c.text for c in session.reply("Count from 3 to 9.", greedy(), 32)).strip() == "3, 4, 5, 6, 7, 8, 9."


def test_failed_turn_leaves_no_dangling_user_message(tiny_model, monkeypatch):
    session = ChatSession(tiny_model, capacity=512)
    monkeypatch.setattr(tiny_model.tokenizer, "render_chat",
                        lambda *a, **k: (_ for _ in ()).throw(TokenizerError("chat template line 1: boom")))
    with pytest.raises(TokenizerError):
        list(session.reply("hi", greedy(), 8))
    assert session.messages == []


def test_chat_cli_reply_interrupted_then_saved(monkeypatch, tmp_path):
    """In the REPL, Ctrl-C during a reply keeps the conversation; /save then writes all of it."""
    real_reply = ChatSession.reply

    def interrupted_reply(self, text, *args, **kwargs):
        chunks = real_reply(self, text, *args, **kwargs)
        yield next(chunks)
        chunks.throw(KeyboardInterrupt)
    monkeypatch.setattr(ChatSession, "reply", interrupted_reply)
    path = tmp_path / "saved.json"
    result = cli("chat", "--temperature", "0", input=f"Who are you?\n/save {path}\n/exit\n")
    assert result.exit_code == 0, result.stderr
    assert "reply interrupted" in result.stderr and "Traceback" not in result.stderr
    saved = read_messages(path)
    assert [m["role"] for m in saved] == ["user", "assistant"] and saved[1]["content"]


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()],
                         ids=["disk_full", "ctrl_c"])
@pytest.mark.parametrize("stage", ["fsync", "replace"])
def test_write_atomic_never_leaves_a_partial_file(tmp_path, failing_disk, failure, stage):
    path = tmp_path / "conversation.json"
    path.write_text("[\"the old conversation\"]\n")
    failing_disk(stage, failure)
    with pytest.raises(type(failure)):
        write_atomic(path, "[\"the new conversation, half written\"]\n")
    assert path.read_text() == "[\"the old conversation\"]\n"
    assert os.listdir(tmp_path) == ["conversation.json"]


def test_save_failure_is_an_error_and_keeps_the_old_file(tiny_model, tmp_path, monkeypatch, failing_disk):
    session = ChatSession(tiny_model, capacity=64)
    session.load([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}])
    path = tmp_path / "conversation.json"
    path.write_text("[]\n")
    failing_disk("fsync", OSError(28, "No space left on device"))
    with pytest.raises(Ds2Error, match="No space left on device"):
        session.save(path)
    assert path.read_text() == "[]\n" and os.listdir(tmp_path) == ["conversation.json"]
    monkeypatch.undo()
    with pytest.raises(Ds2Error, match="cannot save"):
        session.save(tmp_path / "no" / "such" / "dir.json")
    session.save(path)
    assert read_messages(path) == session.messages


def test_chat_save_errors_do_not_end_the_chat(tmp_path):
    result = cli("chat", input=f"/save {tmp_path / 'missing' / 'c.json'}\n/save {tmp_path / 'ok.json'}\n")
    assert result.exit_code == 0
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error: cannot save the conversation") and "saved 0 messages" in lines[1]
    assert read_messages(tmp_path / "ok.json") == []


# ---- no traceback, whatever the bytes or the terminal ----

def ds2_run(*args, env=None, input=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "ds2cli", *args], capture_output=True, input=input,
                          env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.mark.slow
def test_prompt_and_system_arguments_that_are_not_utf8():
    """`ds2 generate $'caf\\xe9'`: one error line naming --encoding; with it, the bytes are read."""
    for args in ([b"caf\xe9"], [b"--chat", b"--system", b"caf\xe9", b"hi"]):
        p = ds2_run("generate", *args, "-n", "2")
        lines = p.stderr.decode().splitlines()
        assert p.returncode == 1 and p.stdout == b"" and len(lines) == 1, p.stderr
        assert lines[0].startswith("error: the ") and "not valid utf-8 (byte 3)" in lines[0] and "--encoding" in lines[0]
    p = ds2_run("generate", b"caf\xe9", "-n", "2", "--encoding", "latin-1", "--verbose-prompt")
    assert p.returncode == 0 and "<｜begin▁of▁sentence｜>café\n" in p.stderr.decode()


def test_chat_line_that_is_not_utf8_is_reported_and_skipped():
    r = cli("chat", "--temperature", "0", input=b"caf\xe9?\nWhat is 2 + 3?\n")
    assert r.exit_code == 0 and r.stdout == "2 + 3 = 5.\n"
    assert r.stderr.startswith("error: the message is not valid utf-8 (byte 3); it was not sent")


@pytest.mark.slow
def test_output_is_utf8_where_the_terminal_encoding_is_ascii(checkpoint_copy, tmp_path):
    """PYTHONIOENCODING=ascii: UTF-8 is written anyway, never a UnicodeEncodeError."""
    model_dir = checkpoint_copy(TINY).rename(tmp_path / "modèle-你好")
    p = ds2_run("inspect", str(model_dir), env={"PYTHONIOENCODING": "ascii"})
    assert p.returncode == 0 and f"checkpoint {model_dir}".encode() in p.stdout and p.stderr == b""
    p = ds2_run("generate", "--chat", "café ☕ What is 2 + 2?", "--temperature", "0", "--verbose-prompt",
                env={"PYTHONIOENCODING": "ascii"})
    assert p.returncode == 0 and "café ☕" in p.stderr.decode("utf-8") and b"Traceback" not in p.stderr
    p = ds2_run("chat", "--temperature", "0", input="café? What is 2 + 3?\n".encode(), env={"PYTHONIOENCODING": "ascii"})
    assert p.returncode == 0 and p.stdout.strip() and p.stderr == b""          # read as UTF-8 too
    p = ds2_run("generate", "--prompt-file", str(tmp_path / "naïve.txt"), env={"PYTHONIOENCODING": "ascii"})
    assert p.returncode == 1 and p.stderr.decode("utf-8").startswith("error: cannot read prompt file") \
        and "naïve.txt" in p.stderr.decode("utf-8")


@pytest.mark.slow
def test_json_interrupted_by_ctrl_c_is_one_valid_object(checkpoint_copy, tmp_path):
    model_dir = without_eos(checkpoint_copy(TINY))
    # ds2 pauses at its 20th decode step, 20 tokens generated, until the Ctrl-C
    proc = pausing_ds2_process(20, "ctrl-c", tmp_path / "steps", "generate", "-m", model_dir, "ROMEO:",
                               "-n", "1000", "--temperature", "0.8", "--seed", "0", "--json", "--verbose-prompt")
    for line in proc.stderr:                        # after the prompt's ids, generation
        if line == b"paused for ctrl-c\n":
            break
    else:
        raise AssertionError(f"ds2 ended before generating: {proc.communicate(timeout=60)}")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and b"Traceback" not in err
    report = json.loads(out)                    # exactly one object: json.loads refuses trailing data
    assert report["finish_reason"] == "interrupted"
    assert 0 < report["completion_tokens"] < 1000 and report["prompt_tokens"] == 6
    assert report["text"] and isinstance(report["timings"]["load_s"], float)


@pytest.mark.parametrize("args, what", [
    (["generate", "--prompt-file", "{}", "-n", "1"], "prompt file"),
    (["generate", "-f", "{}", "-n", "1"], "prompt file"),
    (["generate", "--chat-template", "{}", "hi", "-n", "1"], "chat template"),
    (["chat", "--load", "{}"], "conversation file"),
])
def test_a_directory_or_a_missing_file_as_an_input_file_exit_alike(args, what, no_loading, tmp_path):
    """A file option given a directory fails as one given a missing file does: exit 1, one line
    naming the file, found before any weight loads."""
    missing, directory = tmp_path / "missing.txt", tmp_path / "dir"
    directory.mkdir()
    for path, says in ((directory, f"{what} {directory} is a directory"), (missing, str(missing))):
        result = cli(*[str(path) if a == "{}" else a for a in args], input="")
        assert_one_error_line(result, (what, says), exit_code=1)
