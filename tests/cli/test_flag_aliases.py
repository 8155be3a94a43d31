"""llama-cli's and mlx-lm's spellings of the options whose meaning is the same: each gives what its
ds2 name gives (greedy text compared), on every command that has the option."""

import pytest
from click.testing import CliRunner

from ds2cli.cli.main import main


def run(*args, input=None):
    r = CliRunner().invoke(main, list(map(str, args)), input=input)
    assert r.exit_code == 0, r.output
    return r.stdout


@pytest.mark.parametrize("alias, name, value", [
    ("-c", "--ctx", 64), ("--ctx-size", "--ctx", 64),
    ("--n-predict", "--max-new-tokens", 5), ("--max-tokens", "--max-new-tokens", 5),
    ("-s", "--seed", 7), ("-t", "--threads", 1)])
def test_generate_takes_llama_cli_and_mlx_lm_spellings(alias, name, value):
    args = ["generate", "ROMEO:", "--temperature", "0.8", "--max-new-tokens", "6", "--seed", "3"]
    i = args.index(name) if name in args else None
    if i is not None:
        del args[i:i + 2]
    assert run(*args, alias, value) == run(*args, name, value)


@pytest.mark.slow
def test_a_prompt_file_by_its_llama_cli_names(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("What is 2 + 2?")
    want = run("generate", "--prompt-file", prompt, "--chat", "--temperature", "0")
    assert run("generate", "-f", prompt, "--chat", "--temperature", "0") == want
    assert run("generate", "--file", prompt, "--chat", "--temperature", "0") == want


def test_chat_takes_them_too():
    want = run("chat", "--temperature", "0", "--max-new-tokens", "4", "--ctx", "128", input="What is 2 + 2?\n")
    assert run("chat", "--temperature", "0", "-n", "4", "-c", "128", input="What is 2 + 2?\n") == want
    assert run("chat", "--temperature", "0", "--n-predict", "4", "--ctx-size", "128",
               input="What is 2 + 2?\n") == want


def test_serve_and_bench_list_them():
    serve = CliRunner().invoke(main, ["serve", "--help"]).stdout
    assert "-c, --ctx, --ctx-size" in serve and "-t, --threads" in serve and "-s, --seed" in serve
    assert "--n-predict" in serve and "--max-tokens" in serve
    bench = CliRunner().invoke(main, ["bench", "--help"]).stdout
    assert "-t, --threads" in bench and "-p, --prompt-lengths" in bench
