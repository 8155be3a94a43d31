"""Every command's --help speaks with one voice: it exits 0 and fits 80 columns, every option
has help text, a default is said one way, `(default: X)` at the end of the option's text (never
click's `[default: X]`, never "Default:" in the middle), an environment variable as click's
`[env var: X]`, and the pages that document the commands name every option a command has and
none it lacks."""

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ds2cli.cli.chat_loop import CHAT_HELP
from ds2cli.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 80
COMMANDS = sorted(main.commands)

# Where each command's options are documented: the page that must name every one of them, and
# the part of it that is the command's own (a heading's section, or one list item), which must
# name no option the command lacks.
DOCS = {"generate": ("docs/cli.md", "### ds2 generate"),
        "chat": ("docs/cli.md", "### ds2 chat"),
        "inspect": ("docs/cli.md", "### ds2 inspect"),
        "bench": ("docs/cli.md", "### ds2 bench"),
        "serve": ("docs/server.md", "- Options, in the order"),
        "quantize": ("docs/quantization.md", "- `ds2 quantize SRC DST")}
# an option as the pages write it: `-n`, `--max-new-tokens`, `-m/--model`
OPTION_NAME = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")
UNSET = getattr(click.core, "UNSET", None)     # click >= 8.3's "no default"; None before


def command(name: str) -> click.Command:
    return main.get_command(click.Context(main), name)


def options(name: str) -> list[click.Option]:
    return [p for p in command(name).params if isinstance(p, click.Option)]


def help_of(*args: str) -> str:
    result = CliRunner(env={"COLUMNS": str(WIDTH)}).invoke(main, [*args, "--help"], terminal_width=WIDTH)
    assert result.exit_code == 0 and result.stderr == "", result.output
    return result.stdout


def section(page: str, start: str) -> str:
    """The part of a page that starts at `start`: a heading's, up to the next heading of its
    level or above; a list item's, up to the next item, heading or blank line."""
    text = (ROOT / page).read_text(encoding="utf-8")
    begin = text.index(start)
    if start.startswith("#"):
        level = len(start.split(" ")[0])
        end = re.compile(r"^#{1,%d} " % level, re.M).search(text, begin + len(start))
    else:
        end = re.compile(r"^(- |#|$)", re.M).search(text, text.index("\n", begin) + 1)
    return text[begin:end.start() if end else len(text)]


@pytest.mark.parametrize("args", [[], *([c] for c in COMMANDS)], ids=["ds2", *COMMANDS])
def test_help_exits_0_and_fits_80_columns(args):
    text = help_of(*args)
    # chat's epilog is the REPL's /help text (chat_loop.CHAT_HELP), held to the width below
    ours = [line for line in text.splitlines() if line.strip() not in CHAT_HELP]
    too_wide = [line for line in ours if len(line) > WIDTH]
    assert not too_wide, "\n".join(too_wide)


def test_chat_epilog_fits_80_columns():
    too_wide = [line for line in help_of("chat").splitlines() if len(line) > WIDTH]
    assert not too_wide, "\n".join(too_wide)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_has_help(name):
    assert command(name).help
    for option in options(name):
        assert option.help and option.help.strip(), option.opts


@pytest.mark.parametrize("name", COMMANDS)
def test_defaults_are_said_one_way(name):
    text = help_of(name)
    assert "[default:" not in text and "Default:" not in text
    for option in options(name):
        said = option.help
        assert not option.show_default, f"{option.opts}: say the default as (default: X) in the text"
        # "default" only as "(default: X)", once, at the end of the text
        assert said.lower().count("default") == said.count("(default: ") <= 1, said
        if "(default: " in said:
            assert said.rstrip(".").endswith(")"), said
        given = option.default
        if not option.is_flag and not option.multiple and given not in (None, UNSET):
            assert f"(default: {given}" in said, f"{option.opts} defaults to {given!r}; its help says {said!r}"
        if option.envvar:
            assert option.show_envvar, f"{option.opts}: show {option.envvar} as [env var: ...]"


@pytest.mark.parametrize("name", COMMANDS)
def test_the_model_comes_first_and_json_last(name):
    names = [option.name for option in options(name) if option.name != "help"]
    if "model_dir" in names:
        assert names[0] == "model_dir", names
    if "as_json" in names:
        assert names[-1] == "as_json", names


@pytest.mark.parametrize("name", COMMANDS)
def test_the_docs_name_every_option(name):
    page, _ = DOCS[name]
    named = set(OPTION_NAME.findall((ROOT / page).read_text(encoding="utf-8")))
    for option in options(name):
        if option.name != "help":
            assert named & set(option.opts), f"{page} does not name {'/'.join(option.opts)} of ds2 {name}"


@pytest.mark.parametrize("name", COMMANDS)
def test_the_docs_name_no_option_a_command_lacks(name):
    page, start = DOCS[name]
    has = {opt for option in options(name) for opt in option.opts + option.secondary_opts} | {"-h", "--help"}
    text = section(page, start)
    # the lines of a shell example name their own programs' options (curl -s, llm -m)
    prose = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(("$", "-H ", "-d ")))
    lacks = sorted(set(OPTION_NAME.findall(prose)) - has)
    assert not lacks, f"{page} ({start!r}) names {lacks}, which ds2 {name} does not take"
