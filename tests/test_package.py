"""The package as users install it: the bundled model travels as package data and is found
through the package, not the working directory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow      # left out of `pytest -m "not slow"` (docs/internals.md, Tests)

ROOT = Path(__file__).resolve().parents[1]


def test_bundled_model_found_through_the_package(tmp_path):
    """Build and install the package (not editable) into a target folder, then run it from an
    unrelated working directory with only that folder on the path."""
    target = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                            "--no-build-isolation", "--target", str(target), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "No module named" in build.stderr and "setuptools" in build.stderr:
        pytest.skip("setuptools is not installed here, so the package cannot be built offline")
    assert build.returncode == 0, build.stderr
    work = tmp_path / "elsewhere"
    work.mkdir()
    code = ("import ds2cli, json; from ds2cli.weights.source import bundled_model_dir; m = ds2cli.load(); "
            "print(json.dumps([str(bundled_model_dir()), m.config.hidden_size, ds2cli.__file__]))")
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    model_dir, hidden, module = json.loads(p.stdout)
    assert Path(module).is_relative_to(target) and Path(model_dir).is_relative_to(target)
    assert hidden == 256
    shipped = {f.name for f in Path(model_dir).iterdir()}
    assert {"README.md", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"} <= shipped
    assert (Path(module).parent / "server" / "static" / "chat.html").is_file()     # ds2 serve's chat page
    assert (Path(module).parent / "weights" / "calibration.txt").is_file()        # ds2 quantize's default text


def test_console_script_help_and_version():
    p = subprocess.run([sys.executable, "-m", "ds2cli", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and all(c in p.stdout for c in ("generate", "chat", "inspect"))
    p = subprocess.run([sys.executable, "-m", "ds2cli", "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("ds2, version ")


def test_packed_lines_keep_within_the_width_and_unpack_to_one_line():
    from ds2cli.wording import packed, unpacked
    parts = ["[load 0.05s", "prefill 19 tok, 2419.2 tok/s", "decode 16 tok, 381.8 tok/s", "cache 34/275 tok, 65.3 kB]"]
    text = packed(parts)
    assert text.splitlines() == ["[load 0.05s | prefill 19 tok, 2419.2 tok/s | decode 16 tok, 381.8 tok/s",
                                 "  | cache 34/275 tok, 65.3 kB]"]
    assert unpacked(text) == " | ".join(parts) and packed(["a", "b"]) == "a | b"
    assert all(len(line) <= 20 for line in packed(["x" * 10, "y" * 10, "z" * 15], width=20).splitlines())
