"""The keys docs/cli.md's "JSON output" section gives each command's --json, for the tests that
hold every command's output to them (tests/test_docs.py; bench's in tests/cli/test_bench.py)."""

import re
from pathlib import Path

CLI_PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def documented_keys(command: str) -> dict[str, bool]:
    """{key: optional} from the table under "### `ds2 COMMAND --json`"; a nested key is dotted
    ("timings.load_s") and a row whose text starts "with `--...`" is optional."""
    page = CLI_PAGE.read_text()
    section = re.search(rf"### `ds2 {command} --json`\n(.*?)(?=\n#|\Z)", page, re.S)
    assert section, f"docs/cli.md has no JSON table for {command}"
    keys = {}
    for cells, what in re.findall(r"^\| (`.*?`) \| (.*?) \|$", section.group(1), re.M):
        for key in re.findall(r"`([\w.]+)`", cells):
            keys[key] = what.startswith("with `--")
    return keys


def check_against_docs(command: str, out: dict) -> None:
    """Every key of `out` is documented, and every documented key that is not optional is in
    `out`, at each level the page goes into."""
    keys = documented_keys(command)
    for prefix in {k.rpartition(".")[0] for k in keys}:
        obj = out
        for part in filter(None, prefix.split(".")):
            obj = obj[part]
        here = {k.rpartition(".")[2]: optional for k, optional in keys.items() if k.rpartition(".")[0] == prefix}
        assert set(obj) <= set(here), f"{command} --json {prefix or 'top level'}: undocumented {set(obj) - set(here)}"
        missing = {k for k, optional in here.items() if not optional} - set(obj)
        assert not missing, f"{command} --json {prefix or 'top level'}: documented but absent {missing}"
