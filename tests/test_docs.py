"""The manual cannot drift: the README stays a landing page, its quickstart is what .ci/run runs,
every link between the pages lands on a file and a heading that exist, and every example marked
as checked prints, on ds2-tiny, exactly what the page shows."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from documented_json import check_against_docs

from ds2cli.weights.loader import bundled_model_dir

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKED = "<!-- checked:"


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        m = re.match(r"#+ (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_the_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 400
    for heading in ("## Quickstart", "## Run a real model", "## Commands", "## Known limits"):
        assert heading in text


def test_the_quickstart_is_what_ci_runs():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    block = re.search(r"## Quickstart.*?```sh\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(block) == 2
    assert block[0] in ci and block[1] in ci


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_land_on_files_and_headings(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{page.name} links to {target}: no such heading"


def checked_examples():
    """($ command, expected stdout) for each `$ ds2 ...` line of a block marked as checked."""
    out = []
    for page in PAGES:
        for block in re.findall(re.escape(CHECKED) + r".*?-->\n```text\n(.*?)```", page.read_text(), re.S):
            command, expected = None, []
            for line in block.splitlines() + ["$ end"]:
                if line.startswith("$ "):
                    if command is not None:
                        out.append(pytest.param(command, "\n".join(expected), id=f"{page.name}: {command[:40]}"))
                    command, expected = line[2:], []
                else:
                    expected.append(line)
    return out


@pytest.mark.parametrize("command, expected", checked_examples())
def test_checked_examples_print_what_the_page_shows(command, expected):
    args = shlex.split(command)
    assert args[0] == "ds2"
    r = subprocess.run([sys.executable, "-m", "ds2cli", *args[1:]], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == expected


def ds2_json(*args) -> dict:
    r = subprocess.run([sys.executable, "-m", "ds2cli", *map(str, args), "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("args", [("generate", "ROMEO:", "-n", "4"), ("generate", "ROMEO:", "-n", "4", "--draft", "2")],
                         ids=["plain", "draft"])
def test_generate_json_is_what_the_page_says(args):
    check_against_docs("generate", ds2_json(*args))


def test_inspect_and_quantize_json_are_what_the_page_says(tmp_path):
    check_against_docs("inspect", ds2_json("inspect"))
    out = ds2_json("quantize", bundled_model_dir(), tmp_path / "q8", "--bits", "8")
    check_against_docs("quantize", out)
    assert out["path"] == str(tmp_path / "q8") and Path(out["path"]).is_absolute()
    # inspect of the copy: the same names for the same figures
    report = ds2_json("inspect", out["path"])
    assert report["path"] == out["path"]
    assert report["memory"]["float32_weight_bytes"] == out["float32_weight_bytes"] == 4 * report["params"]


def test_paths_in_json_are_absolute(tmp_path, monkeypatch):
    """A relative path given on the command line comes back absolute."""
    monkeypatch.chdir(bundled_model_dir().parent)
    r = subprocess.run([sys.executable, "-m", "ds2cli", "inspect", "ds2-tiny", "--json"], capture_output=True,
                       text=True, timeout=300)
    assert json.loads(r.stdout)["path"] == str(bundled_model_dir())
