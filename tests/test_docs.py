"""The manual cannot drift: the README stays a landing page, its quickstart is what .ci/run runs,
every link between the pages lands on a file and a heading that exist, and every example that
prints output is checked or says why not (docs/cluster.md's, against a local cluster, by
tests/cluster/test_cluster_doc.py).

An example block is marked by an HTML comment on the line before its fence:

    <!-- checked: tests/test_docs.py runs these commands and compares stdout and stderr; timings vary -->

Each `$ ` line is run by bash (`ds2` is `python -m ds2cli` of this tree, the working directory the
repository's root, HOME a fresh directory shown as /home/me, and `/tmp/` a fresh directory shown as
/tmp/), in page order, and what it prints is compared with the lines under it:

- which stream: `compares stdout` (the default), `compares stderr`, or `compares stdout and
  stderr` (one pipe, as a terminal shows them);
- what varies by machine (`...; timings vary`): only the figures in those positions are masked.
  `timings`: a number before `s` or ` tok/s` (`0.05s`, `381.8 tok/s`), the cores of `--stats`
  (`cores 1.9 prefill, 1.6 decode (of 2)`), a JSON key ending in `_s` (and a reply's
  `created`), a /metrics value in seconds or per second; `the memory available`: the figure of inspect's
  `available now` row and of the memory check's `but 22.9 GB is available`; `dates`: an HTTP
  Date header;
- `...` stands for what the page leaves out: a line of its own for any lines, within a line or a
  JSON string for any text, a JSON member or item for any others (the output of a `--json`
  command is compared as JSON, floats within 1e-4);
- `on SETUP` lays out files the commands name (SETUPS below);
- a command exits 0, or 1 when its last line is an `error:`.

`<!-- not checked: WHY -->` marks an example that is not: bench's table, one machine's figures,
whose rows and footnotes are held to bench's renderer instead. The server's examples are
tests/test_docs_server.py's."""

import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.documented_json import check_against_docs
from rich.console import Console

from ds2cli.cli.bench import probes as bench_probes
from ds2cli.cli.bench import report as bench_report
from ds2cli.cli.bench.command import bench as bench_command
from ds2cli.weights.source import bundled_model_dir

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DATA = ROOT / "tests" / "data"
SHOWN_HOME, SHOWN_TMP = "/home/me", "/tmp/"
# what would make ds2 print otherwise than a reader sees in a pipe: a terminal width, forced colour, a model
UNSET = {"COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "CLICOLOR_FORCE", "DS2_MODEL"}


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


# ---- the pages' example blocks ----

@dataclass
class Block:
    page: Path
    line: int                   # where its fence opens, 1-based
    marker: str                 # the HTML comment on the line before ("" when none)
    lang: str
    lines: list[str]            # its content, dedented to the fence

    @property
    def name(self) -> str:
        return f"{self.page.name}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, with the comment on the line before it (indented blocks of a
    list item included)."""
    text = page.read_text(encoding="utf-8")
    fence = re.compile(r"^( *)(<!--[^\n]*-->\n\1)?```(\w*)\n(.*?)^\1```$", re.S | re.M)
    out = []
    for m in fence.finditer(text):
        indent, marker = m.group(1), (m.group(2) or "").strip()
        line = text.count("\n", 0, m.start()) + 1 + bool(marker)
        lines = [s[len(indent):] if s.startswith(indent) else s for s in m.group(4).splitlines()]
        out.append(Block(page, line, marker, m.group(3), lines))
    return out


def commands(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(command, the lines it prints) for each `$ ` line; a command whose quotes are still open,
    or whose line ends in a backslash, goes on over the next lines."""
    out, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("$ "):         # before the first command
            i += 1
            continue
        command = lines[i][2:]
        while command.endswith("\\") or not complete(command):
            i += 1
            command = command[:-1] + lines[i].lstrip() if command.endswith("\\") else command + "\n" + lines[i]
        i += 1
        printed = []
        while i < len(lines) and not lines[i].startswith("$ "):
            printed.append(lines[i])
            i += 1
        out.append((command, printed))
    return out


def complete(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
        return True
    except ValueError:                  # a quote still open: the argument goes on over the next line
        return False


def example_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang in ("text", "console", "sh")
            and any(line.startswith("$ ") for line in b.lines)]


def test_every_example_that_prints_is_checked_or_says_why_not():
    """A block of `$ ` commands with output under them is marked checked (here, or by
    tests/test_docs_server.py) or `not checked: WHY`."""
    unmarked = [b.name for b in example_blocks()
                if any(printed for _, printed in commands(b.lines))
                and not b.marker.startswith(("<!-- checked", "<!-- not checked: "))]
    assert not unmarked, f"examples that print output but are neither checked nor say why: {unmarked}"


def cli_blocks() -> list[Block]:
    return [b for b in example_blocks() if b.marker.startswith("<!-- checked")
            and "test_docs_server" not in b.marker and "test_cluster_doc" not in b.marker]


# ---- what varies, and how an output is compared ----

NUMBER = r"\d+(?:\.\d+)?"
FIGURE = rf"{NUMBER} [kMGT]?B"
# a kind of figure that varies by machine -> its positions (group "v"), and what may stand there
VARYING = {
    "timings": [(re.compile(rf"(?P<v>{NUMBER})(?=s\b| tok/s\b)"), NUMBER),
                # --stats' cores: cores 1.9 prefill, 1.6 decode (of 1-2)
                (re.compile(rf"(?:cores |, )(?P<v>{NUMBER})(?= prefill\b| decode \(of )"), NUMBER),
                (re.compile(r"\(of (?P<v>\d+(?:-\d+)?)\)"), r"\d+(?:-\d+)?"),
                # /metrics: ds2_decode_seconds_total 0.35, ds2_last_decode_tokens_per_second 14.7
                (re.compile(r"_second(?:s_total)? (?P<v>[\d.e+-]+)$"), r"[\d.e+-]+")],
    "dates": [(re.compile(r"^Date: (?P<v>.+)$"), ".+")],
    "the memory available": [(re.compile(rf"available now +│ (?P<v>{FIGURE} *)│"), f"{FIGURE} *"),
                             (re.compile(rf"but (?P<v>{FIGURE}) is available"), FIGURE)],
}
ELLIPSIS = "\u2026"             # a JSON member or item the page left out


def line_pattern(line: str, varies: list[str]) -> str:
    """The regex of an expected line: `...` any text, the varying figures any figure, the rest as written."""
    spans = [(m.start(), m.end(), ".*?") for m in re.finditer(re.escape("..."), line)]
    for kind in varies:
        for pattern, stands in VARYING[kind]:
            spans += [(m.start("v"), m.end("v"), stands) for m in pattern.finditer(line)]
    out, at = [], 0
    for start, end, stands in sorted(spans):
        if start >= at:
            out += [re.escape(line[at:start]), stands]
            at = end
    return "".join(out) + re.escape(line[at:])


def text_matches(actual: str, expected: list[str], varies: list[str]) -> bool:
    """Line by line, trailing spaces and blank lines aside; a line `...` stands for any lines."""
    def lines(text_lines):
        out = [s.rstrip() for s in text_lines]
        while out and not out[-1]:
            out.pop()
        return out
    pattern = "".join(r"(?:[^\n]*\n)*?" if line == "..." else line_pattern(line, varies) + "\n"
                      for line in lines(expected))
    return re.fullmatch(pattern, "".join(s + "\n" for s in lines(actual.splitlines()))) is not None


def loads_abridged(text: str):
    """JSON as a page prints it, where `...` outside a string stands for members or items left out."""
    out, stack, in_string, i = [], [], False, 0
    while i < len(text):
        c = text[i]
        if in_string:
            out.append(text[i:i + 2] if c == "\\" else c)
            in_string = c != '"'
            i += 2 if c == "\\" else 1
            continue
        if text.startswith("...", i):
            out.append(f'"{ELLIPSIS}": null' if stack[-1] == "{" else f'"{ELLIPSIS}"')
            i += 3
            continue
        if c in "[{":
            stack.append(c)
        elif c in "]}":
            stack.pop()
        in_string = c == '"'
        out.append(c)
        i += 1
    return json.loads("".join(out))


def varies_by_machine(key: str, expected, actual) -> bool:
    """A timing (`load_s`, `decode_tok_per_s`), a reply's `created` time: any number will do."""
    number = isinstance(actual, (int, float)) and not isinstance(actual, bool)
    return number and (key.endswith("_s") or key == "created")


def json_mismatch(expected, actual, where: str = "") -> str | None:
    """Where `actual` differs from the page's abridged JSON, or None. An `id` string is compared
    without its hex digits (`chatcmpl-...`, `call_...` are drawn at random)."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{where or 'the top'}: {actual!r} where the page has an object"
        keys = [k for k in expected if k != ELLIPSIS]
        if ELLIPSIS not in expected and set(actual) != set(keys):
            return f"{where or 'the top'}: keys {sorted(actual)}, the page's {sorted(keys)}"
        for key in keys:
            if key not in actual:
                return f"{where}.{key}: missing"
            if varies_by_machine(key, expected[key], actual[key]):
                continue
            if key == "id" and isinstance(expected[key], str) and isinstance(actual[key], str):
                if re.sub("[0-9a-f]{8,}", "", expected[key]) != re.sub("[0-9a-f]{8,}", "", actual[key]):
                    return f"{where}.id: {actual[key]!r}, the page's {expected[key]!r}"
                continue
            found = json_mismatch(expected[key], actual[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(expected, list):
        if not isinstance(actual, list):
            return f"{where}: {actual!r} where the page has a list"
        if ELLIPSIS in expected:            # [first, ..., last]: the items between left out
            head = expected.index(ELLIPSIS)
            tail = expected[head + 1:]
            if len(actual) < head + len(tail):
                return f"{where}: {len(actual)} items, fewer than the page shows"
            pairs = list(zip(expected[:head], actual)) + list(zip(tail, actual[len(actual) - len(tail):]))
        elif len(actual) != len(expected):
            return f"{where}: {len(actual)} items, the page's {len(expected)}"
        else:
            pairs = list(zip(expected, actual))
        for k, (e, a) in enumerate(pairs):
            found = json_mismatch(e, a, f"{where}[{k}]")
            if found:
                return found
        return None
    if isinstance(expected, str) and isinstance(actual, str) and "..." in expected:
        pattern = ".*?".join(map(re.escape, expected.split("...")))
        return None if re.fullmatch(pattern, actual, re.S) else f"{where}: {actual!r}, the page's {expected!r}"
    numbers = [isinstance(x, (int, float)) and not isinstance(x, bool) for x in (expected, actual)]
    if all(numbers) and (isinstance(expected, float) or isinstance(actual, float)):
        same = math.isclose(expected, actual, rel_tol=1e-4, abs_tol=1e-6)
    else:
        same = type(expected) is type(actual) and expected == actual
    return None if same else f"{where}: {actual!r}, the page's {expected!r}"


# ---- running a block ----

def v2_lite_chat_headers(home: Path) -> dict:
    """~/models/DeepSeek-V2-Lite-Chat as tests/test_readme_commands.py lays it out: the real
    config, tokenizer and tensor headers over sparse holes, and 24 GB of memory."""
    from test_readme_commands import AVAILABLE, write_v2_lite_chat
    write_v2_lite_chat(home / "models" / "DeepSeek-V2-Lite-Chat")
    return {"DS2_MEMORY_AVAILABLE": AVAILABLE}


def moonlight_like(home: Path) -> dict:
    """~/models/moonlight-like: reference_v3/moonlight_like with the committed Moonlight-like
    tokenizer files in place of its tokenizer.json, and Moonlight's special ids in config.json
    and generation_config.json (as tests/text/test_tiktoken.py's moonlight_checkpoint)."""
    out = Path(shutil.copytree(DATA / "reference_v3" / "moonlight_like", home / "models" / "moonlight-like",
                               ignore=shutil.ignore_patterns("ref.npz", "tokenizer.json", "tokenizer_config.json")))
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(DATA / "tokenizers" / "moonlight-like" / name, out)
    for name, eos in (("config.json", 3841), ("generation_config.json", [3841, 3842])):
        cfg = json.loads((out / name).read_text())
        (out / name).write_text(json.dumps({**cfg, "bos_token_id": 3840, "eos_token_id": eos}))
    return {}


def coder_like(home: Path) -> dict:
    """~/models/coder-like: tests/support/coder_like.py's random model around DeepSeek-V2.5's
    tokenizer, whose FIM tokens docs/cli.md's fill-in-the-middle example uses."""
    from support.coder_like import write_coder_like
    write_coder_like(home / "models" / "coder-like")
    return {}


SETUPS = {"V2-Lite-Chat's headers": v2_lite_chat_headers, "the moonlight-like checkpoint": moonlight_like,
          "the coder-like checkpoint": coder_like}


@dataclass
class Checking:
    stream: str                 # "stdout", "stderr" or "stdout and stderr"
    varies: list[str]
    setups: list[str]


def checking(marker: str) -> Checking:
    stream = re.search(r"compares (stdout and stderr|stdout|stderr)", marker)
    varying = re.search(r";([^;]*?) var(?:y|ies)\b", marker)
    varies = [k for k in VARYING if varying and k in varying.group(1)]
    if varying:
        assert varies, f"{marker}: which figures vary? {list(VARYING)}"
    return Checking(stream.group(1) if stream else "stdout", varies, [s for s in SETUPS if f"on {s}" in marker])


def run_example(command: str, cwd: Path, env: dict, stream: str) -> subprocess.CompletedProcess:
    script = 'ds2() { "$DS2_PYTHON" -m ds2cli "$@"; }\n' + command
    both = stream == "stdout and stderr"
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if both else subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                          timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("block", cli_blocks(), ids=lambda b: b.name)
def test_checked_examples_print_what_the_page_shows(block, tmp_path):
    how = checking(block.marker)
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env.update(HOME=str(home), DS2_PYTHON=sys.executable, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    for setup in how.setups:
        env.update(SETUPS[setup](home))
    for command, expected in commands(block.lines):
        r = run_example(command.replace(SHOWN_TMP, f"{tmp}/"), ROOT, env, how.stream)
        printed = r.stdout if how.stream != "stderr" else r.stderr
        printed = printed.replace(f"{tmp}/", SHOWN_TMP).replace(str(home), SHOWN_HOME)
        fails = bool(expected) and expected[-1].startswith("error: ")
        assert r.returncode == (1 if fails else 0), f"`{command}` exited {r.returncode}: {r.stderr or r.stdout}"
        if "--json" in shlex.split(command, comments=True):
            found = json_mismatch(loads_abridged("\n".join(expected)), json.loads(printed))
            assert found is None, f"{block.name}: `{command}` printed\n{printed}\n{found}"
        else:
            assert text_matches(printed, expected, how.varies), \
                f"{block.name}: `{command}` printed\n{printed}\nthe page shows\n" + "\n".join(expected)


def test_the_masks_hide_only_the_varying_figures():
    stats = ("[load 0.05s | prefill 19 tok, 2419.2 tok/s | decode 16 tok, 381.8 tok/s | cores 1.9 prefill, "
             "1.6 decode (of 2) | cache 34/275 tok, 65.3 kB]")
    other = ("[load 1.5s | prefill 19 tok, 30.0 tok/s | decode 16 tok, 7 tok/s | cores 0.6 prefill, 1.0 decode "
             "(of 1-2) | cache 34/275 tok, 65.3 kB]")
    assert text_matches(other, [stats], ["timings"]) and not text_matches(other, [stats], [])
    assert not text_matches(other.replace("19 tok", "18 tok"), [stats], ["timings"])
    assert not text_matches(other.replace("65.3", "65.4"), [stats], ["timings"])
    assert text_matches("a\nb\nc\nd", ["a", "...", "d"], []) and not text_matches("a\nb", ["a", "...", "d"], [])
    page = loads_abridged('{..., "xs": [1, ..., 9], "id": "chatcmpl-0123456789abcdef", "t": "x..."}')
    assert json_mismatch(page, {"a": 0, "xs": [1, 2, 9], "id": "chatcmpl-fedcba9876543210", "t": "xyz"}) is None
    assert json_mismatch(page, {"xs": [1, 2, 8], "id": "chatcmpl-fedcba9876543210", "t": "xyz"})
    assert json_mismatch(loads_abridged('{"load_s": 0.05, "n": 3}'), {"load_s": 0.09, "n": 3}) is None
    assert json_mismatch(loads_abridged('{"load_s": 0.05, "n": 3}'), {"load_s": 0.09, "n": 4})


# ---- bench: one machine's figures, in the layout bench prints today ----

def bench_block() -> tuple[Block, str, list[str]]:
    found = [(b, *commands(b.lines)[0]) for b in example_blocks() if commands(b.lines)[0][0].startswith("ds2 bench")]
    assert len(found) == 1, "docs/cli.md shows one ds2 bench table"
    return found[0]


def report_like(params: dict) -> dict:
    """A report of the shape bench makes for these options; its figures are beside the point."""
    s = {"median": 2.0, "min": 1.0, "max": 3.0}
    beside = {"matvec_gb_per_s": s, "gemm_gflop_per_s": s}
    cores = {"threads": 2, "given": {"median": 2, "min": 1, "max": 2}, "busy": 1.8}
    return {
        "model": {"path": str(params["model_dir"]), "num_hidden_layers": 4, "params": 2.25e9, "weight_bytes": 2.59e9,
                  "format": f"{params['quantize']}-bit" if params["quantize"] else "float32"},
        "machine": {"cpus_usable": 2, "cpu_count": 2, "numpy": "2.4.6",
                    "blas": [{"user_api": "blas", "internal_api": "openblas", "version": "0.3.31", "num_threads": 2}]},
        "probes": {"matvec": {"gb_per_s": s, "shape": [8192, 8192]},
                   "gemm": {name: {"gflop_per_s": s, "shape": shape} for name, shape in bench_probes.SIZES.gemm_shapes},
                   "ceiling": {"cores": 2, "g_weights_per_s": dict.fromkeys(bench_probes.BYTES_PER_VALUE, 1.5)}},
        "load_s": s,
        "prefill": [{"tokens": t, "tok_per_s": s, "gflop_per_s": s, "probes": beside, "gemm_ratio": 0.5,
                     "weight_gb_per_s": 0.5, "matvec_ratio": 0.05, "cores": cores} for t in params["prompt_lengths"]],
        "decode": [{"context": c, "tok_per_s": s, "bytes_per_token": 6e8, "gb_per_s": 1.2, "matvec_ratio": 0.1,
                    "probes": beside, "ceiling_tok_per_s": 12.0, "ceiling_share": 0.15, "cores": cores}
                   for c in params["contexts"]],
        "passes": [{"tokens": k, "context": min(params["contexts"]), "pass_s": s,
                    "step_ratio": {"median": 1.5, "min": 1.4, "max": 1.6}, "weight_bytes": 8e8,
                    "routed_experts_per_layer": 11.3, "cores": cores} for k in params["passes"]],
        "memory": {"peak_rss_bytes": 3.7e9, "rss_ratio": 1.42, "weight_bytes": 2.59e9, "cache_bytes": 9.5e6},
    }


def table_parts(lines: list[str]) -> dict:
    """A bench table's header, row names and footnotes (what follows the machine line)."""
    lines = [s.rstrip() for s in lines]
    rule = next(i for i, s in enumerate(lines) if s.startswith("─"))
    machine = next(i for i, s in enumerate(lines) if re.match(r"\d+ of \d+ CPUs, numpy ", s))
    return {"header": re.split(r"\s{2,}", lines[rule - 1]),
            "rows": [re.split(r"\s{2,}", s)[0] for s in lines[rule + 1:machine]],
            "footnotes": [s for s in lines[machine + 1:] if s]}


def test_the_bench_table_has_the_rows_and_footnotes_bench_prints_today():
    block, command, shown = bench_block()
    assert block.marker.startswith("<!-- not checked: ") and "one machine's" in block.marker
    params = bench_command.make_context("bench", shlex.split(command)[2:]).params
    out = io.StringIO()
    bench_report.render(report_like(params), Console(file=out, width=80, color_system=None))
    assert table_parts(shown) == table_parts(out.getvalue().splitlines())


# ---- the JSON outputs against the page's tables of keys ----

def ds2_json(*args) -> dict:
    r = subprocess.run([sys.executable, "-m", "ds2cli", *map(str, args), "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("args", [("generate", "ROMEO:", "-n", "4"), ("generate", "ROMEO:", "-n", "4", "--draft", "2")],
                         ids=["plain", "draft"])
def test_generate_json_is_what_the_page_says(args):
    check_against_docs("generate", ds2_json(*args))


@pytest.mark.slow
def test_inspect_and_quantize_json_are_what_the_page_says(tmp_path):
    check_against_docs("inspect", ds2_json("inspect"))
    out = ds2_json("quantize", bundled_model_dir(), tmp_path / "q8", "--bits", "8")
    check_against_docs("quantize", out)
    assert out["path"] == str(tmp_path / "q8") and Path(out["path"]).is_absolute()
    # inspect of the copy: the same names for the same figures
    report = ds2_json("inspect", out["path"])
    assert report["path"] == out["path"]
    assert report["memory"]["float32_weight_bytes"] == out["float32_weight_bytes"] == 4 * report["params"]


@pytest.mark.slow
def test_paths_in_json_are_absolute(tmp_path, monkeypatch):
    """A relative path given on the command line comes back absolute."""
    monkeypatch.chdir(bundled_model_dir().parent)
    r = subprocess.run([sys.executable, "-m", "ds2cli", "inspect", "ds2-tiny", "--json"], capture_output=True,
                       text=True, timeout=300)
    assert json.loads(r.stdout)["path"] == str(bundled_model_dir())
