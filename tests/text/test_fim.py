"""text/fim.py on DeepSeek's V2.5 tokenizer (which holds DeepSeek-Coder's FIM tokens) and on
ds2-tiny's (which holds none): the tokens found by their text, the prompt token for token in the
documented layout, the repository files' layout and limits."""

import json
import shutil
from pathlib import Path

import pytest

from ds2cli.text import fim
from ds2cli.text.tokenizer import Tokenizer
from ds2cli.weights.source import bundled_model_dir

V25_DIR = Path(__file__).parents[1] / "data" / "tokenizers" / "deepseek-v2.5"
PREFIX, SUFFIX = "def area(r):\n    ", "\n    return a\n"


@pytest.fixture(scope="module")
def v25():
    return Tokenizer.load(V25_DIR)


def added_ids(directory: Path) -> dict[str, int]:
    """tokenizer.json's added tokens, read apart from the tokenizer: text -> id."""
    spec = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    return {t["content"]: t["id"] for t in spec["added_tokens"]}


@pytest.mark.slow
def test_the_fim_tokens_are_found_by_their_exact_text(v25):
    ids = added_ids(V25_DIR)
    tokens = fim.FimTokens.of(v25)
    assert (tokens.begin, tokens.hole, tokens.end) == (ids["<｜fim▁begin｜>"], ids["<｜fim▁hole｜>"], ids["<｜fim▁end｜>"])
    assert set(tokens.ends) == {tokens.begin, tokens.hole, tokens.end}
    assert v25.eos_token_ids[0] not in tokens.ends      # eos ends a fill by its own right


def test_the_prompt_is_bos_begin_prefix_hole_suffix_end_token_for_token(v25):
    tokens = fim.FimTokens.of(v25)
    ids = fim.fim_ids(v25, tokens, PREFIX, SUFFIX)
    assert ids == [v25.bos_token_id, tokens.begin, *v25.encode(PREFIX, add_special_tokens=False), tokens.hole,
                   *v25.encode(SUFFIX, add_special_tokens=False), tokens.end]
    assert v25.decode(ids) == f"<｜begin▁of▁sentence｜><｜fim▁begin｜>{PREFIX}<｜fim▁hole｜>{SUFFIX}<｜fim▁end｜>"
    # DeepSeek-Coder's README writes the frame as text, which its tokenizer (add_bos_token) encodes the same
    assert ids == v25.encode(f"<｜fim▁begin｜>{PREFIX}<｜fim▁hole｜>{SUFFIX}<｜fim▁end｜>")


def test_an_empty_prefix_and_suffix_leave_the_frame(v25):
    tokens = fim.FimTokens.of(v25)
    assert fim.fim_ids(v25, tokens, "", "") == [v25.bos_token_id, tokens.begin, tokens.hole, tokens.end]


def test_repository_files_come_first_in_the_prefix_each_under_a_path_comment(v25):
    tokens = fim.FimTokens.of(v25)
    files = [("utils.py", "def load():\n    return 1\n"), ("model.py", "class M:\n    pass")]
    context = "# utils.py\ndef load():\n    return 1\n\n\n# model.py\nclass M:\n    pass\n\n\n"
    assert fim.repository_text(files) == context       # a text without a final newline gets one
    assert fim.repository_text([("", "x = 1")]) == "x = 1\n\n\n"    # a file without a path: no `#` line
    ids = fim.fim_ids(v25, tokens, PREFIX, SUFFIX, files)
    assert ids == [v25.bos_token_id, tokens.begin, *v25.encode(context + PREFIX, add_special_tokens=False),
                   tokens.hole, *v25.encode(SUFFIX, add_special_tokens=False), tokens.end]
    assert v25.decode(ids) == f"<｜begin▁of▁sentence｜><｜fim▁begin｜>{context}{PREFIX}<｜fim▁hole｜>{SUFFIX}<｜fim▁end｜>"


def test_a_tokenizer_without_fim_tokens_is_an_error_naming_them():
    with pytest.raises(fim.FimUnavailable) as e:
        fim.FimTokens.of(Tokenizer.load(bundled_model_dir()), "ds2-tiny")
    assert str(e.value).startswith("ds2-tiny's tokenizer has no fill-in-the-middle tokens: "
                                   "<｜fim▁begin｜>, <｜fim▁hole｜>, <｜fim▁end｜> missing")


@pytest.mark.slow
def test_only_the_missing_token_is_named(tmp_path):
    spec = json.loads((V25_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    for token in spec["added_tokens"]:
        if token["content"] == "<｜fim▁hole｜>":
            token["content"] = "<｜fim▁gap｜>"          # a tokenizer that spells one differently
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    shutil.copy(V25_DIR / "tokenizer_config.json", tmp_path)
    with pytest.raises(fim.FimUnavailable, match="fill-in-the-middle tokens: <｜fim▁hole｜> missing"):
        fim.FimTokens.of(Tokenizer.load(tmp_path), "gap")


def test_repository_files_are_bounded_before_they_are_read():
    class Endless(list):                   # a count past the limit is refused before any file is looked at
        def __iter__(self):
            raise AssertionError("looped over")
    with pytest.raises(fim.RepositoryError, match=f"more than the limit of {fim.MAX_FILES}"):
        fim.check_files(Endless([("a", "")] * (fim.MAX_FILES + 1)))
    half = "x" * (fim.MAX_FILE_BYTES // 2)
    with pytest.raises(fim.RepositoryError, match=f"limit of {fim.MAX_FILE_BYTES} bytes .at file 2"):
        fim.check_files([("a", half), ("b", half[:-10]), ("c", "y" * 20), ("d", "z")])
    fim.check_files([("a", half), ("b", half[:-10])])
    for path in ("a\nb", "x" * (fim.MAX_PATH_CHARS + 1)):
        with pytest.raises(fim.RepositoryError, match="file 0's path must be one line"):
            fim.repository_text([(path, "")])
