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


STARTS = """import sys
sys.argv = {argv!r}
from ds2cli.cli.main import main
try:
    main()
except SystemExit:
    pass
print("ml_dtypes imported:", any(m.split(".")[0] == "ml_dtypes" for m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["ds2", "--help"], ["ds2", "generate", "--chat", "What is 2 + 2?", "--temp", "0"]])
def test_ml_dtypes_is_imported_only_where_a_format_needs_it(argv):
    """ds2 --help, and a whole run on ds2-tiny (a bfloat16 checkpoint, read as uint16 bits and
    widened), never import ml_dtypes; its import was most of every start."""
    r = subprocess.run([sys.executable, "-c", STARTS.format(argv=argv)], capture_output=True, text=True, timeout=120)
    assert r.stderr.splitlines()[-1] == "ml_dtypes imported: False", r.stderr

