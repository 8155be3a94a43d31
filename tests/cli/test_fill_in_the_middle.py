"""`ds2 generate --suffix` / `--suffix-file`: fill-in-the-middle from the command line, on a small
random model around DeepSeek's V2.5 tokenizer (its FIM tokens); ds2-tiny, which has none, is an
`error:` naming them before any weight loads."""

import json

import pytest
from click.testing import CliRunner

import ds2cli
from ds2cli.cli.main import main
from ds2cli.generation.generate import stream_generate
from ds2cli.generation.sampling import SamplingParams, make_sampler
from ds2cli.text import fim
from support.coder_like import write_coder_like

PREFIX, SUFFIX = "def area(r):\n    ", "\n    return a\n"
MISSING = "<｜fim▁begin｜>, <｜fim▁hole｜>, <｜fim▁end｜> missing"


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


@pytest.fixture(scope="module")
def coder_dir(tmp_path_factory):
    return write_coder_like(tmp_path_factory.mktemp("coder-like"))


@pytest.fixture(scope="module")
def coder(coder_dir):
    return ds2cli.load(str(coder_dir))


def fill_ids(model, prefix=PREFIX, suffix=SUFFIX):
    tok = model.tokenizer
    return fim.fim_ids(tok, fim.FimTokens.of(tok), prefix, suffix)


@pytest.mark.slow
def test_suffix_generates_the_greedy_middle_of_the_documented_prompt(coder_dir, coder):
    r = run("generate", "-m", str(coder_dir), "--suffix", SUFFIX, "--temperature", "0", "-n", "6", "--json",
            "--verbose-prompt", PREFIX)
    assert r.exit_code == 0, r.stderr
    ids = fill_ids(coder)
    assert f"token ids: {' '.join(map(str, ids))}" in r.stderr.splitlines()
    assert f"<｜begin▁of▁sentence｜><｜fim▁begin｜>{PREFIX}<｜fim▁hole｜>{SUFFIX}<｜fim▁end｜>" in r.stderr
    chunks = list(stream_generate(coder, ids, coder.new_cache(len(ids) + 6), make_sampler(SamplingParams(temperature=0)),
                                  6, eos_ids=(*coder.eos_token_ids, *fim.FimTokens.of(coder.tokenizer).ends)))
    out = json.loads(r.stdout)
    assert out["text"] == "".join(c.text for c in chunks) and out["prompt_tokens"] == len(ids)
    assert out["completion_tokens"] == chunks[-1].generated_tokens


@pytest.mark.slow
def test_suffix_file_is_the_same_as_suffix_and_an_empty_prefix_is_a_fill(coder_dir, tmp_path):
    (tmp_path / "after.py").write_text(SUFFIX, encoding="utf-8")
    common = ["generate", "-m", str(coder_dir), "--temperature", "0", "-n", "4", "--json"]
    by_option = run(*common, "--suffix", SUFFIX, PREFIX)
    by_file = run(*common, "--suffix-file", str(tmp_path / "after.py"), PREFIX)
    assert by_option.exit_code == by_file.exit_code == 0
    assert json.loads(by_option.stdout) == {**json.loads(by_file.stdout), "timings": json.loads(by_option.stdout)["timings"]}
    empty = run(*common, "--suffix", SUFFIX, "")
    assert empty.exit_code == 0, empty.stderr
    assert json.loads(empty.stdout)["prompt_tokens"] == len(fill_ids(ds2cli.load(str(coder_dir)), "", SUFFIX))


@pytest.mark.slow
@pytest.mark.parametrize("token", ["<｜fim▁end｜>", "<｜fim▁begin｜>", "<｜end▁of▁sentence｜>"])
def test_the_fill_ends_at_a_fim_token_or_eos_unwritten(coder_dir, coder, command_samples, token):
    """A sampler that writes three greedy tokens and then `token`: the text is the three, ended by eos."""
    end = coder.tokenizer.added_token_id(token)

    def sampler_for(model, opts, real):
        sample, calls = real(model, opts), []

        def then_end(logits, history):
            calls.append(1)
            return end if len(calls) == 4 else sample(logits, history)
        return then_end
    command_samples(sampler_for)
    r = run("generate", "-m", str(coder_dir), "--suffix", SUFFIX, "--temperature", "0", "-n", "10", "--json", PREFIX)
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    ids = fill_ids(coder)
    three = list(stream_generate(coder, ids, coder.new_cache(len(ids) + 3), make_sampler(SamplingParams(temperature=0)),
                                 3, eos_ids=()))
    assert out["finish_reason"] == "eos" and out["completion_tokens"] == 4
    assert out["text"] == "".join(c.text for c in three) and token not in out["text"]


def test_a_model_without_fim_tokens_is_an_error_naming_them_before_loading(no_loading):
    r = run("generate", "--suffix", ")", "print(")
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [f"error: ds2-tiny's tokenizer has no fill-in-the-middle tokens: {MISSING} "
                                     f"(FIM needs a DeepSeek-Coder model, such as DeepSeek-Coder-V2-Lite)"]


@pytest.mark.parametrize("args,message", [
    (["--suffix", "a", "--suffix-file", "b.py"], "give the suffix with --suffix or --suffix-file, not both"),
    (["--suffix", "a", "--chat"], "--suffix fills in the middle of raw text: it cannot be combined with --chat"),
    (["--suffix-file", "b.py", "--system", "Be brief."], "--suffix-file fills in the middle of raw text"),
    (["--suffix", "a", "--from-bos"], "--suffix needs no --from-bos"),
])
def test_options_that_cannot_go_with_a_fill_are_usage_errors(no_loading, args, message):
    r = run("generate", *args, "x")
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith(f"error: {message}") and r.stderr.rstrip().endswith("generate --help')")


@pytest.mark.slow
def test_a_suffix_file_is_measured_against_max_prompt_bytes_before_it_is_read(coder_dir, tmp_path, no_loading):
    (tmp_path / "big.py").write_text("x" * 2000, encoding="utf-8")
    r = run("generate", "-m", str(coder_dir), "--suffix-file", str(tmp_path / "big.py"), "--max-prompt-bytes", "1000",
            "a")
    assert r.exit_code == 1 and "suffix file" in r.stderr and "--max-prompt-bytes" in r.stderr
    missing = run("generate", "-m", str(coder_dir), "--suffix-file", str(tmp_path / "none.py"), "a")
    assert missing.exit_code == 1 and missing.stderr.startswith("error: ") and "none.py" in missing.stderr
