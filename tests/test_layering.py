"""The layout is the map: packages import only the packages below them (in the order ds2cli's
__init__ lists them), and inside a package a module imports only the modules its package's
__init__ lists before it. Every import counts, those inside functions included."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "ds2cli"


def modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the ds2cli modules it imports (`from pkg import mod` resolved to the module)."""
    graph = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ds2cli"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("ds2cli"))
            elif isinstance(node, ast.ImportFrom) and node.level:
                pytest.fail(f"{name} uses a relative import; ds2 imports absolutely")
        graph[name] = found - {name}
    return graph


def listed(package: str) -> list[str]:
    """The names a package's __init__ docstring lists bottom-up, one per line after 'Bottom-up:'
    (or, for ds2cli itself, the packages and base modules in its layer list)."""
    doc = ast.get_docstring(ast.parse((ROOT.parent / package.replace(".", "/") / "__init__.py").read_text()))
    assert doc and ("Bottom-up:" in doc or package == "ds2cli"), f"{package}'s __init__ lists no order"
    if package == "ds2cli":
        names = []
        for line in doc.split("bottom-up")[1].splitlines()[1:]:
            m = re.match(r"\s+([a-z_, ]+?)\s{2,}", line)
            if m:
                names += [n.strip() for n in m.group(1).split(",")]
        return names
    return [m.group(1) for line in doc.split("Bottom-up:")[1].splitlines()
            if (m := re.match(r"\s+([a-z_][a-z_0-9]*)/?\s", line + " "))]


def violations() -> list[str]:
    mods = modules()
    bad = []
    for importer, targets in imports(mods).items():
        a = importer.split(".")
        if len(a) == 1 or a[1] == "__main__":
            continue                      # ds2cli's lazy __init__ and the entry point stand outside
        for target in targets:
            b = target.split(".")
            if len(b) == 1:
                continue                  # ds2cli's __init__ (__version__): lazy, it imports nothing
            i = 1
            while i < min(len(a), len(b)) and a[i] == b[i]:
                i += 1
            if i >= len(a) or i >= len(b):
                continue                  # a package's __init__ and its own modules
            package = ".".join(a[:i])
            order = listed(package)
            for n in (a[i], b[i]):
                if n not in order:
                    bad.append(f"{package}.{n} is not listed in {package}'s __init__")
            if a[i] in order and b[i] in order and order.index(b[i]) >= order.index(a[i]):
                bad.append(f"{importer} imports {target}, which {package}'s __init__ lists above it")
    return sorted(set(bad))


@pytest.mark.slow
def test_imports_run_downward():
    assert violations() == []


@pytest.mark.slow
def test_the_math_knows_no_formats_or_processes():
    """model/ imports nothing above the base modules: no execution (parallel), no formats, files
    or text; and asks for no module by name at run time (importlib, __import__), so no alias
    hides one. Where work runs is its executor's, how a weight is stored its format's."""
    graph = imports(modules())
    base = {"ds2cli.errors", "ds2cli.json_files", "ds2cli.wording"}
    for module, path in modules().items():
        if not module.startswith("ds2cli.model"):
            continue
        outside = {t for t in graph[module] if not t.startswith("ds2cli.model") and t not in base}
        assert not outside, f"{module} imports {outside}"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
                {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not names & {"import_module", "__import__"}, f"{module} imports by name"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(a.name.startswith("ds2cli.model") or not a.name.startswith("ds2cli")
                           for a in node.names), f"{module}: import {[a.name for a in node.names]}"


def test_the_math_reads_no_weight_layout():
    """attention and moe meet weights through their interface (linear.py): no format class, no
    string-keyed layer dicts."""
    for name in ("attention", "moe", "transformer"):
        tree = ast.parse((ROOT / "model" / f"{name}.py").read_text())
        keys = [n.slice.value for n in ast.walk(tree) if isinstance(n, ast.Subscript)
                and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)]
        assert not keys, f"model/{name}.py indexes by name: {keys}"
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not used & {"QuantMatrix", "Dense", "Q8", "Q4", "Q8b", "BFloat16"}


def test_no_module_of_the_model_or_weights_is_over_500_lines():
    for module, path in modules().items():
        if module.startswith(("ds2cli.model", "ds2cli.weights")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            assert lines <= 500, f"{module} has {lines} lines"


def test_every_module_is_on_the_map():
    """docs/internals.md names every module of the package, so the map cannot drift from the tree."""
    text = (ROOT.parent / "docs" / "internals.md").read_text()
    for name in modules():
        parts = name.split(".")
        if len(parts) == 1 or parts[-1] == "__main__" or parts[-2:-1] == ["bench"]:
            continue
        if name.endswith(("ds2cli.execution", "ds2cli.model", "ds2cli.text", "ds2cli.weights", "ds2cli.cluster",
                          "ds2cli.generation", "ds2cli.server", "ds2cli.cli", "ds2cli.cli.bench",
                          "ds2cli.weights.gguf")):
            continue
        shown = "/".join(parts[2:]) if parts[1] == "weights" and len(parts) > 3 else parts[-1]
        assert f"`{shown}`" in text, f"docs/internals.md does not name {name}"
