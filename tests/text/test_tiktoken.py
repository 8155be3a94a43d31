"""Moonlight / Kimi tiktoken tokenizers: ds2's converted BPE against tiktoken itself, the cache,
bad files, and a Moonlight-like checkpoint with no tokenizer.json through generate, chat, inspect."""

import base64
import json
import random
import shutil
import tracemalloc
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import tiktoken
import tiktoken.load
from click.testing import CliRunner

import ds2cli
from ds2cli.text import tiktoken_convert
from ds2cli.cli.main import main
from ds2cli.errors import TokenizerError
from ds2cli.text.tokenizer import Tokenizer
from support.make_moonlight_tokenizer import CROSSING_RANKS, FIXTURE, crossing_merges, ranks_from_bpe, tiktoken_model_text, tokenizer_config

REFERENCE_V3 = Path(__file__).parents[1] / "data" / "reference_v3"

# English, Chinese, Japanese, Korean, other scripts, code, emoji (ZWJ sequences, flags), whitespace
# runs of every kind, numbers, mixed case and contractions, combining marks, special tokens in text.
CORPUS = [
    "Hello, world! This is a TEST of MixedCase words, don't you'll we've I'M THEY'RE.",
    "你好，世界！DeepSeek-V2 🚀 café 中文English混合 汉字abc 北京市 Pascal 月之暗面发布了千亿参数模型。",
    "日本語のテキスト：ひらがな、カタカナ、漢字。東京タワーは333メートルです。",
    "안녕하세요 세계; Привет, МИР; Ωμέγα ΑΒΓ; مرحبا بالعالم; नमस्ते दुनिया; Ünïcödé ÀÉÎÕÜ ßẞ ǅǈǋ",
    "def f(x):\n    return x ** 2  # comment\n\n\tif x>=10: print(f'{x:08.3f}')\r\n}}\n",
    "emoji 👨‍👩‍👧‍👦 🏳️‍🌈 ✨🔥💯 flags 🇫🇷🇯🇵 keycap 1️⃣",
    "     lots    of\n\n\n   whitespace \t\t  \n   " + " " * 200 + "\n" * 20 + "\t" * 9,
    "a\u00a0b\u3000c\u2028d\u0085e\u200bf\u2009g  \u00a0 \u00a0\u00a0x",
    "1234567890 3.14159 1,000,000 -42 0x1F 1e-9 ١٢٣ ५६७ ½ ²³ Ⅻ",
    "CamelCaseXMLHttpRequest getHTTPResponseCode iPhone McDonald's O'NEIL'S 's 'S 'll 'LL 'Ve",
    "\u0301\u0308a\u0301 e\u0301 क्षि ̃ mixed漢字and한글andカナ123字456",
    "x" * 300 + "!" * 50 + "=" * 40 + "ab" * 100,
    "<|im_user|>user<|im_middle|>hi<|im_end|>[BOS]text[EOS]<|reserved_token_3900|> [EOT]",
]


# cl100k_base's split (tiktoken_ext/openai_public.py): what a converter without Moonshot's pattern would use.
CL100K_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""


def tiktoken_encoding(model_dir: Path) -> tiktoken.Encoding:
    """The reference, built the way tokenization_moonshot.py builds it."""
    ranks = tiktoken.load.load_tiktoken_bpe(str(model_dir / "tiktoken.model"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    named = {int(i): e["content"] for i, e in config["added_tokens_decoder"].items()}
    n = len(ranks)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    return tiktoken.Encoding(model_dir.name, pat_str=tiktoken_convert.MOONSHOT_PATTERN,
                             mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(autouse=True)
def no_tiktoken_cache(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")        # tiktoken reads local files directly


@pytest.fixture(scope="module")
def full_vocab(tmp_path_factory):
    """The full ~100k-rank tiktoken.model made from DeepSeek-V2's merges (and the fixture's
    crossing merges after them), with Moonlight's layout."""
    model_dir = tmp_path_factory.mktemp("moonlight-full")
    ranks = crossing_merges(ranks_from_bpe(), CROSSING_RANKS)
    (model_dir / "tiktoken.model").write_text(tiktoken_model_text(ranks))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(len(ranks))))
    return model_dir


def random_texts(seed: int, count: int) -> list[str]:
    """Strings drawn from ASCII, Latin, every BMP block, Hangul, emoji, astral Han and every kind
    of whitespace, with contractions and digits over-represented."""
    rng = random.Random(seed)
    pool = ([chr(c) for c in range(0x20, 0x250)] + list("\t\n\r\x0b\x0c\x85\xa0\u1680\u2000\u2028\u2029\u202f\u3000\u200d")
            + [chr(c) for c in rng.sample(range(0x250, 0xA000), 1600)] + [chr(c) for c in rng.sample(range(0xAC00, 0xD7A4), 100)]
            + [chr(c) for c in rng.sample(range(0x1F300, 0x1FAFF), 300)] + [chr(c) for c in rng.sample(range(0x20000, 0x2FA1F), 200)]
            + list("''sStTdDmMlLvVrReE0123456789     ") * 3)
    pool = [c for c in pool if unicodedata.category(c) not in ("Cs", "Cn")]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 60))) for _ in range(count)]


def assert_same_ids(tok: Tokenizer, enc: tiktoken.Encoding, texts):
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == enc.encode(text, allowed_special="all"), repr(text)
        assert tok.decode(ids) == text == enc.decode(ids)


# ---- the converted tokenizer equals tiktoken ----

def test_fixture_encodes_to_tiktokens_ids():
    tok = Tokenizer.load(FIXTURE)
    enc = tiktoken_encoding(FIXTURE)
    assert tok.vocab_size == enc.n_vocab == 4096
    assert_same_ids(tok, enc, CORPUS + random_texts(1, 500))


@pytest.mark.slow
def test_full_vocabulary_encodes_to_tiktokens_ids(full_vocab):
    tok = Tokenizer.load(full_vocab)
    enc = tiktoken_encoding(full_vocab)
    assert tok.vocab_size == enc.n_vocab
    assert_same_ids(tok, enc, CORPUS + random_texts(2, 3000))
    # without special tokens in text, tiktoken's encode_ordinary: the specials are plain text
    text = CORPUS[-1]
    assert tok.encode(text, add_special_tokens=False) != enc.encode_ordinary(text)


@pytest.mark.slow
def test_the_corpus_tells_moonshots_pattern_from_others(full_vocab):
    """The id check has power: the same ranks split with cl100k's pattern, or with the Han
    exclusion (`&&[^\\p{Han}]`) dropped as an engine without class intersection would, differ."""
    ranks = tiktoken.load.load_tiktoken_bpe(str(full_vocab / "tiktoken.model"))
    ours = tiktoken_encoding(full_vocab)
    without_intersection = tiktoken_convert.MOONSHOT_PATTERN.replace("&&[^\\p{Han}]", "")
    for pattern in (CL100K_PATTERN, without_intersection):
        other = tiktoken.Encoding("other", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        assert any(other.encode_ordinary(t) != ours.encode_ordinary(t) for t in CORPUS)


def test_merges_are_replayed_from_ranks():
    """A token's merge is the pair tiktoken's loop over its bytes ends with; a token that loop never
    reaches has none (only a whole piece equal to it gives it)."""
    ranks = {bytes([b]): b for b in range(256)}
    for token in (b"ab", b"bc", b"abc", b"xyz"):
        ranks[token] = len(ranks)
    assert tiktoken_convert.merge_pair(ranks, b"abc") == (b"ab", b"c")   # ab (256) before bc (257)
    assert tiktoken_convert.merge_pair(ranks, b"xyz") is None            # neither xy nor yz is a token
    # a file need not be learned in order: "pqr" ranks before its part "qr", yet tiktoken forms it from (p, qr)
    for token in (b"pqr", b"qr"):
        ranks[token] = len(ranks)
    assert tiktoken_convert.merge_pair(ranks, b"pqr") == (b"p", b"qr")
    backend = tiktoken_convert.build(ranks, {})
    enc = tiktoken.Encoding("t", pat_str=tiktoken_convert.MOONSHOT_PATTERN, mergeable_ranks=ranks, special_tokens={})
    for text in ("abc", "xyz", "xyzabc", "abcd", "zabc", "bcab", "pqrs", "opqr", "qrpqr"):
        assert backend.encode(text).ids == enc.encode_ordinary(text), text


# ---- special tokens, chat, eos ----

def test_special_tokens_fill_the_reserved_range_as_moonshots_code_does():
    tok = Tokenizer.load(FIXTURE)
    n = 3840
    assert tok.bos_token == "[BOS]" and tok.bos_token_id == n
    assert tok.eos_token_ids == (n + 1,)
    assert [tok.encode(t, add_special_tokens=False) for t in ("<|im_end|>", "<|im_middle|>", f"<|reserved_token_{n + 5}|>")] \
        == [[n + 2], [n + 17], [n + 5]]
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)   # no add_bos_token: no bos


def test_chat_template_renders_and_encodes_like_tiktoken():
    tok = Tokenizer.load(FIXTURE)
    messages = [{"role": "user", "content": "你好 Moonlight"}, {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": "2+2?"}]
    prompt = tok.render_chat(messages)
    assert prompt.startswith("<|im_system|>system<|im_middle|>") and prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    assert tok.encode_chat(messages) == tiktoken_encoding(FIXTURE).encode(prompt, allowed_special="all")


def test_eos_ids_merge_config_generation_config_and_tokenizer(moonlight_checkpoint):
    model = ds2cli.load(moonlight_checkpoint)
    assert model.tokenizer.eos_token_ids == (3841,)
    assert set(model.eos_token_ids) == {3841, 3842}     # [EOS] from config.json, <|im_end|> from generation_config


# ---- the cache ----

def test_conversion_is_cached_by_content_outside_the_model_dir(tmp_path, monkeypatch):
    model_dir = Path(shutil.copytree(FIXTURE, tmp_path / "model"))
    cache = tmp_path / "cache"
    monkeypatch.setenv("DS2_TOKENIZER_CACHE", str(cache))
    first = Tokenizer.load(model_dir).encode("Hello 世界")
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"
    assert sorted(p.name for p in model_dir.iterdir()) == ["tiktoken.model", "tokenizer_config.json"]
    assert Tokenizer.load(model_dir).encode("Hello 世界") == first
    merged = Tokenizer.load(model_dir).encode("世界", add_special_tokens=False)
    # read from the cache, not converted again: with the entry's merges taken out, 世界 is its 6 bytes
    entry = json.loads(files[0].read_text(encoding="utf-8"))
    entry["model"]["merges"] = []
    files[0].write_text(json.dumps(entry), encoding="utf-8")
    assert len(Tokenizer.load(model_dir).encode("世界", add_special_tokens=False)) == 6 > len(merged)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["3850"] = {"content": "<|new|>"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.load(model_dir).encode("<|new|>", add_special_tokens=False) == [3850]
    assert len(list(cache.iterdir())) == 2                              # another input, another key


def test_default_cache_is_ds2s_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("DS2_TOKENIZER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tiktoken_convert.cache_dir() == tmp_path / "ds2" / "tokenizers"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tiktoken_convert.cache_dir() == tmp_path / "home" / ".cache" / "ds2" / "tokenizers"


def test_an_unwritable_cache_converts_in_memory(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("DS2_TOKENIZER_CACHE", str(blocked / "cache"))    # under a file: mkdir fails
    assert Tokenizer.load(FIXTURE).encode("abc", add_special_tokens=False) == \
        tiktoken_encoding(FIXTURE).encode("abc")


# ---- malformed files ----

GOOD = "IQ== 0\nIg== 1\n"


@pytest.mark.parametrize("text, says", [
    ("IQ== 0\n@@notbase64@@ 1\n", "line 2: '@@notbase64@@' is not valid base64"),
    ("IQ== 0\nIg== 0\n", "line 2: rank 0 is already used on line 1"),
    ("IQ== 0\nIQ== 1\n", "line 2: token b'!' already has rank 0"),
    ("IQ== 0\nIg== 2\n", "rank 1 is missing (after line 1)"),
    ("IQ== 0\nIg==\n", "line 2: expected 'base64-token rank', got 1 fields"),
    ("IQ== 0\nIg== -1\n", "line 2: rank '-1' is not a non-negative integer"),
    (GOOD, "single bytes are not tokens"),
    ("", "holds no tokens"),
])
def test_malformed_tiktoken_model_is_one_error_naming_the_line(tmp_path, text, says):
    (tmp_path / "tiktoken.model").write_text(text)
    with pytest.raises(TokenizerError, match=None) as e:
        Tokenizer.load(tmp_path)
    assert says in str(e.value) and str(tmp_path / "tiktoken.model") in str(e.value)


def test_a_special_token_inside_the_base_ranks_is_refused(tmp_path):
    shutil.copy(FIXTURE / "tiktoken.model", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"7": {"content": "[BOS]"}}}))
    with pytest.raises(TokenizerError, match="has id 7, inside tiktoken.model's 3840 ranks"):
        Tokenizer.load(tmp_path)


# ---- a Moonlight-like checkpoint end to end ----

@pytest.fixture
def moonlight_checkpoint(tmp_path):
    """reference_v3/moonlight_like (deepseek_v3, 4096 embedding rows) with Moonlight's tokenizer
    files in place of tokenizer.json: ids as Moonlight's config.json / generation_config.json give them."""
    model_dir = Path(shutil.copytree(REFERENCE_V3 / "moonlight_like", tmp_path / "moonlight",
                                     ignore=shutil.ignore_patterns("ref.npz", "tokenizer.json", "tokenizer_config.json")))
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, model_dir)
    for name, eos in (("config.json", 3841), ("generation_config.json", [3841, 3842])):
        cfg = json.loads((model_dir / name).read_text())
        cfg.update(bos_token_id=3840, eos_token_id=eos)
        (model_dir / name).write_text(json.dumps(cfg))
    return model_dir


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def test_generate_and_chat_run_without_tokenizer_json(moonlight_checkpoint):
    prompt = "月之暗面 Moonlight"
    r = run("generate", "-m", moonlight_checkpoint, "-n", "5", "--temperature", "0", "--json", prompt)
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] == len(tiktoken_encoding(moonlight_checkpoint).encode(prompt)) and out["completion_tokens"] >= 1
    r = run("generate", "-m", moonlight_checkpoint, "-n", "3", "--temperature", "0", "--chat", "你好", "--verbose-prompt")
    assert r.exit_code == 0, r.stderr
    assert "<|im_user|>user<|im_middle|>你好<|im_end|><|im_assistant|>assistant<|im_middle|>" in r.stderr
    r = run("chat", "-m", moonlight_checkpoint, "-n", "4", "--temperature", "0", "--stats", input="你好\nhello\n/exit\n")
    assert r.exit_code == 0, r.stderr
    assert sum(line.startswith("[prefill") for line in r.stderr.splitlines()) == 2      # two turns answered
    assert not (moonlight_checkpoint / "tokenizer.json").exists()


def test_inspect_says_the_tokenizer_is_converted_from_tiktoken(moonlight_checkpoint):
    r = run("inspect", "-m", moonlight_checkpoint, "--json")
    assert r.exit_code == 0, r.stderr
    tok = json.loads(r.stdout)["tokenizer"]
    assert tok["kind"] == "tiktoken.model (converted)" and tok["vocab_size"] == 4096
    assert tok["bos_token_id"] == 3840 and tok["eos_token_id"] == 3841
    r = run("inspect", "-m", moonlight_checkpoint)
    assert r.exit_code == 0 and "tiktoken.model (converted)" in r.stdout


def test_generate_on_a_malformed_tiktoken_model_prints_one_error_line(moonlight_checkpoint):
    lines = (moonlight_checkpoint / "tiktoken.model").read_text().splitlines()
    lines[99] = "not-base64! 99"
    (moonlight_checkpoint / "tiktoken.model").write_text("\n".join(lines) + "\n")
    r = run("generate", "-m", moonlight_checkpoint, "hi")
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [f"error: {moonlight_checkpoint / 'tiktoken.model'} line 100: "
                                     f"'not-base64!' is not valid base64"]


def test_a_tokenizer_json_beside_tiktoken_model_is_what_loads(moonlight_checkpoint, monkeypatch, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REFERENCE_V3 / "moonlight_like" / name, moonlight_checkpoint)
    monkeypatch.setenv("DS2_TOKENIZER_CACHE", str(tmp_path / "cache"))
    tok = Tokenizer.load(moonlight_checkpoint)
    assert tok.vocab_size == 4096 and tok.encode("<|im_end|>", add_special_tokens=False) != [3842]
    assert not (tmp_path / "cache").exists()                           # never converted


@pytest.mark.slow
def test_streaming_the_converted_tokenizer_never_splits_a_character(full_vocab):
    tok = Tokenizer.load(full_vocab)
    text = "月之暗面 🚀👨‍👩‍👧 café<|im_end|>ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.token_text(i) for i in ids)              # some character spans tokens
    stream = tok.stream_decoder(special=True)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    stream = tok.stream_decoder()          # <|im_end|> is special: generated text leaves it out
    assert "".join([stream.push(i) for i in ids] + [stream.flush()]) == text.replace("<|im_end|>", "")


# ---- inputs at a bounded cost ----

@pytest.mark.parametrize("text, says", [
    ("IQ== " + "9" * 5000 + "\n", "has more digits than any vocabulary needs"),
    (base64.b64encode(b"x" * 40_000).decode() + " 0\n", "a token of 40000 bytes"),
])
def test_lines_beyond_any_vocabulary_are_refused_by_their_length(tmp_path, text, says):
    (tmp_path / "tiktoken.model").write_text(text)
    with pytest.raises(TokenizerError) as e:
        Tokenizer.load(tmp_path)
    assert says in str(e.value) and "line 1" in str(e.value)


@pytest.mark.parametrize("key, says", [("²", "ASCII digits"), ("1" + "0" * 11, "beyond the 256 ids reserved")])
def test_added_token_ids_are_bounded_by_the_reserved_range(tmp_path, key, says):
    shutil.copy(FIXTURE / "tiktoken.model", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {key: {"content": "<|x|>"}}}))
    tracemalloc.start()
    try:
        with pytest.raises(TokenizerError, match=says):
            Tokenizer.load(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 << 20              # no list of every id up to 10^11


class CountingRanks(dict):
    lookups = 0

    def get(self, key, default=None):
        CountingRanks.lookups += 1
        return super().get(key, default)


def naive_merge_pair(ranks, token):
    """tiktoken's own loop, rescanning every pair at each merge (what ds2 did before the heap)."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            return None
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 and parts[0] + parts[1] in ranks else None


@settings(max_examples=200, deadline=None)
@given(vocab=st.lists(st.text(alphabet="ab", min_size=2, max_size=6), max_size=30, unique=True),
       token=st.text(alphabet="ab", min_size=2, max_size=12))
def test_the_heap_merges_as_tiktokens_loop_does(vocab, token):
    ranks = {b"a": 0, b"b": 1}
    for piece in [*vocab, token]:
        ranks.setdefault(piece.encode(), len(ranks))
    assert tiktoken_convert.merge_pair(ranks, token.encode()) == naive_merge_pair(ranks, token.encode())


def test_merge_recovery_is_not_quadratic_in_the_tokens_length():
    """Every run of a's up to 4,096 is a token: the naive loop rescans all pairs at each of the
    4,095 merges (millions of lookups); the heap looks up a few pairs a merge."""
    token = b"a" * 4096
    ranks = CountingRanks({token[:k]: k - 1 for k in range(1, len(token) + 1)})
    CountingRanks.lookups = 0
    got = tiktoken_convert.merge_pair(ranks, token)
    assert CountingRanks.lookups <= 3 * len(token)
    assert got is not None and got[0] + got[1] == token


def test_a_corrupt_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DS2_TOKENIZER_CACHE", str(cache))
    want = Tokenizer.load(FIXTURE).encode("Hello 世界")
    (entry,) = cache.iterdir()
    entry.write_bytes(entry.read_bytes()[:1000])                 # truncated by a full disk, say
    assert Tokenizer.load(FIXTURE).encode("Hello 世界") == want
    assert json.loads(entry.read_text())["model"]["type"] == "BPE"   # written whole again
