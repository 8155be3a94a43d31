"""README.md's "Run a real model" section, run as the page gives it, on DeepSeek-V2-Lite-Chat.

The commands are read from the page (its ```sh block, then every `ds2 ...` and option span of the
prose after it, in order), so the test runs whatever the page says. What is real and what stands in:

- config.json is V2-Lite-Chat's as the Hub publishes it (V2_LITE_CHAT_CONFIG); the architecture
  fields are checked against bench's lite_config(27).
- The weights are V2-Lite-Chat's tensors, every name, shape and dtype, in its four bf16 shards,
  but each shard's data is a hole of a sparse file (zeros, no disk): headers, parameter counts and
  every memory verdict are the real model's, and no value is read.
- The tokenizer is DeepSeek-V2's published tokenizer.json and tokenizer_config.json (V2-Lite-Chat
  ships the same), chat template included. generation_config.json is not laid out.
- The memory available is DS2_MEMORY_AVAILABLE=24GB: a machine in the section's 16 to 32 GB; its
  disk has DISK_FREE bytes free (the machine running the test may have less: CI's tmp had 14 GB).
- `pip install` is not run (the extra it names is checked in pyproject.toml). `hf download` is run
  offline, so its arguments are parsed and it stops at the network; the download it would make is
  laid out by the test at its --local-dir and, as huggingface_hub lays it out, in a temporary
  Hugging Face cache (HF_HUB_CACHE) for the `-m org/name` commands.
- `ds2 quantize` runs up to its writer for real (arguments, the source checked against its config,
  the destination, free disk). The writer, quantize.write_all, is replaced by one that writes the
  files ds2's low-bit layout holds (qcheckpoint.expected's tensors) over holes: nothing is
  quantized, and that copy is what the following commands load.
- `ds2 chat` on the copy loads it (memory-mapped, so nothing is read) and leaves at /exit: it
  answers nothing, its weights being zeros. A command that would convert V2-Lite-Chat's 15.7B
  float weights as it loads (`--quantize 4`) stops where they start to load, after its memory
  check (loader.load_weights raises WeightsReached).
- There is no V2-Lite-sized GGUF here: the Q4_K_M fixture of tests/data/gguf stands in for
  `model.gguf` and the ollama blob.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds2cli.cli.bench import synthetic
from ds2cli.cli.main import main
from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights import checkpoint, loader, qcheckpoint, quantize
from ds2cli.weights.memory import gb

pytestmark = pytest.mark.slow      # left out of `pytest -m "not slow"` (docs/internals.md, Tests)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TOKENIZER = ROOT / "tests" / "data" / "tokenizers" / "deepseek-v2"
GGUF_FIXTURE = ROOT / "tests" / "data" / "gguf" / "kquant_256.Q4_K_M.gguf"
AVAILABLE = "24GB"
DISK_FREE = 200 * 10**9   # the reader's free disk: room for the section's 8- and 4-bit copies
COMMIT = "0123456789abcdef0123456789abcdef01234567"       # refs/main of the temporary Hub cache

# DeepSeek-V2-Lite-Chat's config.json, field for field as the Hub publishes it.
V2_LITE_CHAT_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                 "AutoModel": "modeling_deepseek.DeepseekV2Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}
SHARDS = 4                      # model-00001-of-000004.safetensors ... as published (8.7 GB, the last 5.6)


class WeightsReached(Exception):
    """Raised where V2-Lite-Chat's float weights would start to load: every check has passed."""


# ---- the page ----

def section() -> str:
    text = README.read_text(encoding="utf-8")
    found = re.search(r"^## Run a real model\n(.*?)(?=^## )", text, re.S | re.M)
    assert found, "README.md has no '## Run a real model' section"
    return found.group(1)


def block_lines() -> list[str]:
    found = re.search(r"```sh\n(.*?)```", section(), re.S)
    assert found, "the section has no ```sh block"
    return [line for line in found.group(1).splitlines() if line.strip()]


def page_steps() -> list[list[str]]:
    """The block's commands, then the prose's commands and option spans (`--bits 8`), in page order."""
    steps = [shlex.split(line, comments=True) for line in block_lines()]
    prose = re.sub(r"```.*?```", "", section(), flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        if span.startswith(("ds2 ", "-")):
            steps.append(shlex.split(span))
    return steps


def block_command(steps: list[list[str]], *head: str) -> list[str]:
    found = [s for s in steps if s[:len(head)] == list(head)]
    assert found, f"the section's block has no `{' '.join(head)}` command"
    return found[0]


def as_command(step: list[str], steps: list[list[str]]) -> list[str]:
    """An option span of the prose as the command it changes: `--bits N` another copy (the block's
    quantize, into its own directory), `--quantize N` no copy (chat on quantize's source), `-m X`
    the block's chat on another model."""
    if not step[0].startswith("-"):
        return step
    q = block_command(steps, "ds2", "quantize")
    option, value = step[0], step[1]
    if option == "--bits":
        bits = q[q.index("--bits") + 1]
        assert f"q{bits}" in q[3], f"cannot name the --bits {value} copy after {q[3]}"
        return [*q[:3], q[3].replace(f"q{bits}", f"q{value}"), "--bits", value]
    if option == "--quantize":
        return ["ds2", "chat", "-m", q[2], "--quantize", value]
    if option == "-m":
        return [*block_command(steps, "ds2", "chat")[:2], "-m", value]
    raise AssertionError(f"the section mentions `{' '.join(step)}`: teach this test what it runs")


def readme_figures() -> dict[str, str]:
    """The weights the page gives each form, in GB, as written (their precision is the page's)."""
    text = section()
    patterns = {"4-bit": r"--bits 4\s+#\s*([\d.]+) GB", "8-bit": r"`--bits 8`\s+makes an? ([\d.]+) GB copy",
                "float32": r"float32 checkpoint itself needs about ([\d.]+) GB"}
    figures = {}
    for form, pattern in patterns.items():
        found = re.search(pattern, text)
        assert found, f"the section no longer says the {form} size as /{pattern}/: update this test"
        figures[form] = found.group(1)
    return figures


def rounds_to(written: str, n_bytes: int) -> bool:
    decimals = len(written.partition(".")[2])
    return float(written) == round(n_bytes / 1e9, decimals)


# ---- the files: safetensors headers over holes ----

def write_sparse(path: Path, tensors: list[tuple[str, tuple, str]]) -> int:
    """A safetensors file of `tensors` (name, shape, dtype) whose data is a hole: zeros, no disk."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in tensors:
        n = math.prod(shape) * checkpoint.DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    if os.stat(path).st_blocks * 512 > len(raw) + (1 << 20):
        pytest.skip(f"the file system of {path.parent} does not keep sparse files")
    return 8 + len(raw) + offset


def write_v2_lite_chat(out: Path) -> None:
    """What `hf download deepseek-ai/DeepSeek-V2-Lite-Chat` puts in `out`, its values left out."""
    shapes = checkpoint.expected_shapes(DeepseekV2Config.from_dict(V2_LITE_CHAT_CONFIG))
    total = 2 * sum(math.prod(s) for s in shapes.values())
    shards = synthetic.plan_shards(shapes, -(-total // SHARDS))
    weight_map = {}
    out.mkdir(parents=True)
    for k, names in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):06d}.safetensors"
        write_sparse(out / file, [(name, shapes[name], "BF16") for name in names])
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / checkpoint.INDEX_NAME).write_text(json.dumps(index, indent=2), encoding="utf-8")
    (out / "config.json").write_text(json.dumps(V2_LITE_CHAT_CONFIG, indent=2), encoding="utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER / name, out / name)


def write_hub_cache(cache: Path, repo: str, files: Path) -> Path:
    """huggingface_hub's layout of repo@main: blobs, refs/main naming the commit, and the
    snapshot's files as links to the blobs (hard links here: the same holes, no copies)."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / COMMIT
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    snapshot.mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT, encoding="utf-8")
    for path in files.iterdir():
        blob = root / "blobs" / hashlib.sha256(path.name.encode()).hexdigest()
        os.link(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def write_headers_only(src, out, raw, cfg, qc, tensors, progress, *rest, **options) -> int:
    """quantize.write_all's stand-in: the files it writes (a shard a layer, then the top one; the
    index; the source's other files; config.json last), every tensor ds2's low-bit layout holds
    (qcheckpoint.expected) over a hole. Returns the bytes written, as write_all does."""
    n = cfg.num_hidden_layers + 1
    shards: dict[int, list] = {}
    for name, shape, dtype in qcheckpoint.expected(cfg, qc):
        k = int(name.split(".")[2]) + 1 if name.startswith("model.layers.") else n
        shards.setdefault(k, []).append((name, shape, dtype))
    weight_map, total = {}, 0
    for k, entries in sorted(shards.items()):
        total += write_sparse(out / quantize.shard_name(k, n), entries)
        weight_map.update((name, quantize.shard_name(k, n)) for name, _, _ in entries)
    index = {"metadata": {"total_size": total, "format": "ds2"}, "weight_map": weight_map}
    (out / checkpoint.INDEX_NAME).write_text(json.dumps(index, indent=2), encoding="utf-8")
    for path in src.iterdir():
        if path.is_file() and path.name not in ("config.json", checkpoint.INDEX_NAME) \
                and not path.name.endswith(quantize.SKIPPED_SUFFIXES) and not path.name.startswith("."):
            shutil.copy2(path, out / path.name)
    config = {**raw, "quantization_config": qc.to_json()}
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return total


# ---- a reader's machine ----

class Machine:
    """A home directory, a Hugging Face cache and a working directory in tmp; 24 GB of memory."""

    def __init__(self, tmp: Path, monkeypatch):
        self.home, self.cache, self.cwd = tmp / "home", tmp / "hf-cache", tmp / "work"
        for path in (self.home, self.cache, self.cwd):
            path.mkdir()
        self.env = {"HOME": str(self.home), "HF_HUB_CACHE": str(self.cache), "HF_HOME": str(tmp / "hf-home"),
                    "HF_HUB_OFFLINE": "1", "DS2_MEMORY_AVAILABLE": AVAILABLE, "DS2_HELPERS": "0",
                    "DS2_MODEL": None, "DS2_TRACEBACK": "1"}   # WeightsReached reaches the runner as itself
        self.float_dirs: set[Path] = set()
        self.reached: list[tuple[Path, object]] = []
        real_load_weights = loader.load_weights

        def load_weights(model_dir, cfg, progress=None, qc=None, *rest, **named):
            if Path(model_dir).resolve() in self.float_dirs:
                self.reached.append((Path(model_dir), qc))
                raise WeightsReached(model_dir)
            return real_load_weights(model_dir, cfg, progress, qc, *rest, **named)
        monkeypatch.setattr(loader, "load_weights", load_weights)
        monkeypatch.setattr(quantize, "write_all", write_headers_only)
        real_disk_usage = shutil.disk_usage

        def disk_usage(path):
            usage = real_disk_usage(path)
            return type(usage)(usage.total, usage.used, DISK_FREE)
        monkeypatch.setattr(shutil, "disk_usage", disk_usage)
        monkeypatch.chdir(self.cwd)

    def path(self, arg: str) -> str:
        """As the shell would expand `~`; an ellipsis placeholder (`sha256-...`) filled in."""
        if arg == "~" or arg.startswith("~/"):
            arg = str(self.home) + arg[1:]
        if arg.endswith("..."):
            arg = arg[:-3] + hashlib.sha256(GGUF_FIXTURE.read_bytes()).hexdigest()
        return arg

    def download(self, repo: str, local_dir: Path) -> None:
        write_v2_lite_chat(local_dir)
        snapshot = write_hub_cache(self.cache, repo, local_dir)
        self.float_dirs |= {local_dir.resolve(), snapshot.resolve()}

    def ds2(self, args: list[str], input: str | None = None):
        """`ds2 ARGS...` in this process (args[0] is "ds2")."""
        return CliRunner().invoke(main, [self.path(a) for a in args[1:]], input=input, env=self.env)


@pytest.fixture
def machine(tmp_path, monkeypatch):
    return Machine(tmp_path, monkeypatch)


def hf_download_accepts(args: list[str], machine: Machine) -> None:
    """The page's `hf download` line, offline: its arguments parse (a usage error exits 2) and it
    stops at the network. Skipped when this environment has no `hf` command."""
    hf = Path(sys.executable).parent / "hf"
    if not hf.exists():
        return
    env = {**os.environ, **{k: v for k, v in machine.env.items() if v is not None},
           "HF_HUB_CACHE": str(machine.home / "empty-hf-cache")}
    r = subprocess.run([str(hf), *[machine.path(a) for a in args[1:]]], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "offline" in r.stderr, (r.returncode, r.stderr)


def pip_extra_exists(args: list[str]) -> None:
    extra = re.fullmatch(r"\.\[(\w+)\]", args[-1])
    assert args[:2] == ["pip", "install"] and extra, args
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("huggingface_hub") for d in extras[extra.group(1)])


def run_ds2(command: list[str], machine: Machine):
    """Run one ds2 command of the page; a chat says /exit (it never answers: the weights are zeros)."""
    model = command[command.index("-m") + 1] if "-m" in command else None
    if model and (model.endswith(".gguf") or "/blobs/sha256-" in model):   # a file the reader brings
        target = Path(machine.path(model))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(GGUF_FIXTURE, target)
    r = machine.ds2(command, input="/exit\n" if command[1] == "chat" else None)
    assert r.exit_code == 0 or isinstance(r.exception, WeightsReached), \
        f"`{shlex.join(command)}` exited {r.exit_code}: {r.stderr or r.exception!r}"
    return r


def option(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


# ---- the tests ----

def test_the_config_is_v2_lite_chat_s_and_bench_has_its_architecture():
    bench = synthetic.lite_config(27)
    # bench's copy ships ds2-tiny's tokenizer, hence ds2-tiny's special ids; the rest is V2-Lite's
    assert {k: v for k, v in bench.items() if k not in ("bos_token_id", "eos_token_id")}.items() \
        <= V2_LITE_CHAT_CONFIG.items()
    tokenizer_config = json.loads((TOKENIZER / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "Assistant:" in tokenizer_config["chat_template"]       # V2-Chat's template, not ds2-tiny's


def test_the_section_runs_in_page_order(machine):
    """Every command accepted, one after the other: the copies quantize makes are what chat loads,
    their sizes are the page's, and a chat that converts the float weights as it loads gets past
    its memory check on 24 GB in the form it asked for."""
    steps, figures, ran = page_steps(), readme_figures(), []
    for step in steps:
        command = as_command(step, steps)
        if command[0] == "pip":
            pip_extra_exists(command)
        elif command[:2] == ["hf", "download"]:
            hf_download_accepts(command, machine)
            machine.download(command[2], Path(machine.path(option(command, "--local-dir"))))
        else:
            assert command[0] == "ds2", f"the section's block runs `{shlex.join(command)}`: teach this test"
            reached = len(machine.reached)
            r = run_ds2(command, machine)
            bits = option(command, "--bits")
            if command[1] == "quantize":     # the copy's size as the page gives it
                assert f": {figures[bits + '-bit']} GB ({bits}-bit" in r.stderr, (figures, r.stderr)
            if option(command, "--quantize"):
                (_, qc), = machine.reached[reached:]
                assert isinstance(r.exception, WeightsReached) and qc.bits == int(option(command, "--quantize"))
            ran.append(command[1])
    assert {"quantize", "chat", "inspect"} <= set(ran)


@pytest.fixture
def downloaded(machine):
    """The page's download done: (the machine, its --local-dir, the Hub id)."""
    hf = block_command(page_steps(), "hf", "download")
    local_dir = Path(machine.path(option(hf, "--local-dir")))
    machine.download(hf[2], local_dir)
    return machine, local_dir, hf[2]


def test_inspect_gives_the_page_s_sizes_and_the_verdicts_of_24_gb(downloaded):
    machine, local_dir, repo = downloaded
    figures = readme_figures()
    for where in (str(local_dir), repo):
        r = machine.ds2(["ds2", "inspect", where, "--json"])
        assert r.exit_code == 0, r.stderr
        report = json.loads(r.stdout)
        # the active figure beside it is DeepSeek's own count (ds2's counts lm_head: 2.45B)
        params = re.search(r"\(([\d.]+)B parameters", section())
        assert params and float(params.group(1)) == round(report["params"] / 1e9, 1), report["params"]
        forms = {f["format"]: f for f in report["memory"]["formats"]}
        assert {form: rounds_to(figures[form], forms[form]["weight_bytes"]) for form in figures} \
            == dict.fromkeys(figures, True), {form: gb(f["weight_bytes"]) for form, f in forms.items()}
        assert {form: f["fits"] for form, f in forms.items()} == {"float32": False, "8-bit": True, "4-bit": True}
    r = machine.ds2(["ds2", "inspect", str(local_dir)])
    assert r.exit_code == 0 and "does NOT fit now" in r.stdout and "(fits now)" in r.stdout, r.stdout


def test_the_float_checkpoint_is_refused_on_24_gb_in_one_line_that_says_quantize(downloaded):
    machine, local_dir, repo = downloaded
    for where in (str(local_dir), repo):
        r = machine.ds2(["ds2", "chat", "-m", where], input="/exit\n")
        lines = r.stderr.splitlines()
        assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        assert "as float32 (weights 62.8 GB" in lines[0] and "but 24.0 GB is available" in lines[0]
        assert "ds2 quantize" in lines[0] and "--bits 4 makes a 9.5 GB copy that fits" in lines[0]
    assert machine.reached == []       # refused before a weight was read
