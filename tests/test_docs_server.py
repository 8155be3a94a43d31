"""docs/server.md's examples, run: the page's blocks marked `<!-- checked: tests/test_docs_server.py
... -->` are read in page order. Each `$ ds2 serve ARGS` starts that server on ds2-tiny (a
subprocess on a free port, which the outputs show as the page's port; `-m coder-like` is
tests/support/coder_like.py's model), and the `$ curl` requests
and Python client examples after it, up to the next `$ ds2 serve`, go to it in page order: a
request body, headers and method are the page's curl command's, and the reply is compared with the
lines under it (JSON as JSON, with `...` for what the page leaves out; see tests/test_docs.py).
What varies is not compared: the random hex of ids, `created`, timings (in the log and /metrics),
the Date header. A `$ ds2 serve` with lines under it shows the start of its log (stderr)."""

import contextlib
import http.client
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from support.coder_like import write_coder_like
from test_docs import ROOT, blocks, commands, json_mismatch, loads_abridged, text_matches

pytestmark = pytest.mark.slow      # left out of `pytest -m "not slow"` (docs/internals.md, Tests)

PAGE = ROOT / "docs" / "server.md"
MARK = "test_docs_server.py"
VARIES = ["timings", "dates"]
# files a page's server command names, made from the repository's
FILES = {"v25.jinja": lambda: json.loads((ROOT / "tests" / "data" / "tokenizers" / "deepseek-v2.5" /
                                          "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"],
         "r1.jinja": lambda: (ROOT / "tests" / "data" / "r1_chat_template.jinja").read_text(encoding="utf-8")}
# model directories a page's server command names (-m DIR), made in the server's working directory
MODELS = {"coder-like": write_coder_like}


@dataclass
class Session:
    """One `ds2 serve` of the page and what the page sends it."""
    args: list[str]
    log: list[str]                                  # the start of its log, as the page shows it
    steps: list[tuple[str, str, list[str]]] = field(default_factory=list)   # (curl | python, text, expected)

    @property
    def shown_port(self) -> int:
        for kind, text, _ in self.steps:
            found = re.search(r"//127\.0\.0\.1:(\d+)/", text) if kind in ("curl", "python") else None
            if found:
                return int(found.group(1))
        raise AssertionError(f"ds2 serve {shlex.join(self.args)}: no request names its port")


def sessions() -> list[Session]:
    out, page = [], blocks(PAGE)
    for k, block in enumerate(page):
        if MARK not in block.marker:
            continue
        if block.lang == "python":                  # what it prints is the block after it
            out[-1].steps.append(("python", "\n".join(block.lines), page[k + 1].lines))
            continue
        for command, printed in commands(block.lines):
            args = shlex.split(command, comments=True)
            if args[:2] == ["ds2", "serve"]:
                out.append(Session([a for a in args[2:] if a != "&"], printed))
            else:
                assert args[0] == "curl", f"{block.name}: teach this test to run `{command}`"
                out[-1].steps.append(("curl", command, printed))
    return out


def test_every_example_of_the_page_is_checked():
    """A block of the page with a `$ ` line, or a Python client, is this test's."""
    for block in blocks(PAGE):
        if block.lang == "python" or any(line.startswith("$ ") for line in block.lines):
            assert MARK in block.marker, f"{block.name} is not marked as checked by {MARK}"


# ---- a server and a client as the page runs them ----

@contextlib.contextmanager
def serving(args: list[str], cwd: Path):
    """`ds2 serve ARGS` on a free port; yields (port, the log so far: its first line), and at the
    end stops it with SIGTERM and adds the rest of its log."""
    if "--port" in args:
        at = args.index("--port")
        args = args[:at] + args[at + 2:]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "ds2cli", "serve", *args, "--port", "0"], cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        log = [proc.stderr.readline().rstrip("\n")]
        found = re.search(r"http://127\.0\.0\.1:(\d+)", log[0])
        assert found, f"ds2 serve {shlex.join(args)} said {log[0]!r}"
        yield int(found.group(1)), log
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)       # then read through the text buffer: a start entry of several lines is in it
        log += proc.stderr.read().splitlines()
        assert proc.returncode == 0, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def curl(command: str, port: int) -> str:
    """What `curl` prints for the page's command (-s, -i, -X, -H, -d; a `| grep -v PATTERN` after)."""
    first, *piped = split_pipeline(command)
    method, headers, data, url, include = None, {}, None, None, False
    words = iter(first[1:])
    for word in words:
        if word in ("-s", "-si", "-i"):
            include |= "i" in word
        elif word == "-X":
            method = next(words)
        elif word == "-H":
            name, _, value = next(words).partition(": ")
            headers[name] = value
        elif word == "-d":
            data = next(words)
        else:
            assert url is None and word.startswith("http://"), f"curl {word!r}: teach this test"
            url = urlsplit(word)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(method or ("POST" if data is not None else "GET"), url.path, body=data, headers=headers)
    r = conn.getresponse()
    body = r.read().decode()
    conn.close()
    out = body
    if include:
        out = "\n".join([f"HTTP/1.1 {r.status} {r.reason}", *(f"{k}: {v}" for k, v in r.getheaders()), "", body])
    for step in piped:
        assert step[:2] == ["grep", "-v"], f"| {shlex.join(step)}: teach this test"
        out = "\n".join(line for line in out.splitlines() if not re.search(step[2], line))
    return out


def split_pipeline(command: str) -> list[list[str]]:
    words, out = shlex.split(command), [[]]
    for word in words:
        if word == "|":
            out.append([])
        else:
            out[-1].append(word)
    return out


def run_python(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(PAGE), "exec"), {})
    return out.getvalue()


def compare(where: str, printed: str, expected: list[str]) -> None:
    if expected and expected[0].startswith("{"):
        found = json_mismatch(loads_abridged("\n".join(expected)), json.loads(printed))
        assert found is None, f"{where} answered\n{printed}\n{found}"
    else:
        assert text_matches(printed, expected, VARIES), f"{where} printed\n{printed}\nthe page shows\n" + "\n".join(expected)


@pytest.mark.parametrize("session", sessions(), ids=lambda s: "ds2 serve " + shlex.join(s.args))
def test_the_page_s_requests_get_the_page_s_replies(session, tmp_path):
    if any("response_format" in text or '"tool_choice": "required"' in text for _, text, _ in session.steps):
        pytest.importorskip("llguidance")       # constrained output: pip install 'ds2cli[grammar]'
    for name, make in FILES.items():
        if name in session.args:
            (tmp_path / name).write_text(make(), encoding="utf-8")
    for name, make in MODELS.items():
        if name in session.args:
            make(tmp_path / name)
    shown = session.shown_port
    with serving(session.args, tmp_path) as (port, log):
        for kind, text, expected in session.steps:
            if kind == "curl":
                printed = curl(text.replace(f":{shown}/", f":{port}/"), port)
            else:
                pytest.importorskip("openai")
                printed = run_python(text.replace(f"127.0.0.1:{shown}/", f"127.0.0.1:{port}/"))
            compare(f"`{text[:70]}...`", printed.replace(f":{port}", f":{shown}"), expected)
    log = [line.replace(f":{port}", f":{shown}") for line in log]
    assert max(map(len, log)) <= 80, log        # the start entry and the request lines, in 80 columns
    compare(f"ds2 serve {shlex.join(session.args)}", "\n".join(log[:len(session.log)]), session.log)
