"""docs/cluster.md's commands, run against the local cluster (support/ray_local.py): its `ray start`
lines use only options `ray start` has, and its `ds2` lines, with the page's head address
replaced by the local one and its model by the bundled ds2-tiny, succeed and print what the page
shows (the placement's lines, in the page's form)."""

import re
import shlex
from pathlib import Path

import pytest

from support.ray_local import ADDRESS, BIN

pytestmark = pytest.mark.slow

PAGE = Path(__file__).parents[2] / "docs" / "cluster.md"
PAGE_ADDRESS = "192.168.1.10:6379"
STAGE_LINE = re.compile(r"^  \S+ \([0-9a-f]{8}\): (layers \d+-\d+( \+ [a-z, ]+)?|no layers)"
                        r"(, experts \d+-\d+ of each MoE layer|, no experts)?, weights [\d.]+ [MG]B, cache [\d.]+ [MG]B "
                        r"at \d+ tokens, needs [\d.]+ [MG]B of [\d.]+ [MG]B, \d+ CPUs$")


def blocks() -> list[list[str]]:
    """The `$ ` lines of each block the page marks as checked here."""
    text, out = PAGE.read_text(), []
    for m in re.finditer(r"<!-- checked by tests/cluster/test_cluster_doc.py[^>]*-->\s*```text\n(.*?)```", text, re.S):
        out.append([line.strip()[2:] for line in m.group(1).splitlines() if line.strip().startswith("$ ")])
    return out


def test_the_page_marks_its_ray_and_ds2_commands():
    starts, *ds2 = blocks()
    assert all(c.startswith("ray start") for c in starts) and all(c.startswith("ds2 ") for b in ds2 for c in b)
    assert any("--ray-spread experts" in c for b in ds2 for c in b)


def test_the_ray_start_lines_use_options_ray_start_has(cluster):
    helped = cluster.run([str(BIN / "ray"), "start", "--help"], check=True).stdout
    for command in blocks()[0]:
        for option in (a.split("=")[0] for a in shlex.split(command) if a.startswith("--")):
            assert option in helped, f"`ray start` has no {option}"
    shown = PAGE.read_text()
    assert f"--address {PAGE_ADDRESS}" in shown


def test_the_ds2_lines_run_against_a_local_cluster_as_shown(cluster):
    for command in [c for b in blocks()[1:] for c in b]:
        args = shlex.split(command.replace(PAGE_ADDRESS, ADDRESS))[1:]
        if "-m" in args:                          # the page's model: the bundled one here
            i = args.index("-m")
            del args[i:i + 2]
        if "--ctx" in args:                       # ... which holds 1,024 positions
            args[args.index("--ctx") + 1] = "1024"
        r = cluster.ds2(*args, timeout=120, input="What is 451 - 123?\n" if args[0] == "chat" else None)
        assert r.returncode == 0, (command, r.stderr[-2000:])
        shown = r.stdout if args[0] == "inspect" else r.stderr
        lines = shown.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("placement of "))
        assert all(STAGE_LINE.match(line) for line in lines[at + 1:at + 3]), lines[at:at + 3]
        if "--ray-spread" in args:
            assert lines[at].endswith("by experts:") and all(" experts " in line for line in lines[at + 1:at + 3])
        if args[0] == "chat":
            assert r.stdout.strip() == "451 - 123 = 328."
    page_lines = ["  " + line.strip() for line in PAGE.read_text().splitlines() if line.strip().startswith("192.168.1.")
                  and "): " in line]
    assert len(page_lines) >= 4 and all(STAGE_LINE.match(line) for line in page_lines), page_lines
