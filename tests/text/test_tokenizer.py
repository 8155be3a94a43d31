"""ds2cli.text.tokenizer against DeepSeek's real tokenizer files (V2, V2.5) and the bundled ds2-tiny's.

The files live in tests/data/tokenizers/ (copies of ../shared), so these tests run offline.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from ds2cli.errors import TokenizerError
from ds2cli.text.tokenizer import FALLBACK_CHAT_TEMPLATE, Tokenizer
from ds2cli.text.tokenizer import byte_level_alphabet

DATA = Path(__file__).parents[1] / "data" / "tokenizers"
V2_DIR, V25_DIR, TINY_DIR = DATA / "deepseek-v2", DATA / "deepseek-v2.5", DATA / "ds2-tiny"

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
ROCKET_TEXT = "你好，世界！DeepSeek-V2 🚀 café"
ROCKET_IDS = [84313, 19304, 4997, 2160, 32221, 64468, 12, 53, 17, 12356, 95300, 26506, 587]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]
V2_CONVERSATION = f"{BOS}Be brief.\n\nUser: Hi\n\nAssistant: Hello!{EOS}User: 2+2?\n\nAssistant:"

# Pieces of real text in several scripts; some span several tokens or several code points.
TEXT_PIECES = ["a", "Hello", " world", " ", "  ", "\n", "\n\n", "\t", "42", "3.14", "é", "café", "ñ",
               "Ünïcödé", "Ж", "Ω", "你", "好", "世界", "，", "。", "日本語", "カタカナ", "한국어",
               "🚀", "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "∑", "—", "«»", "\u00a0"]
texts = st.lists(st.sampled_from(TEXT_PIECES), max_size=30).map("".join)


@pytest.fixture(scope="module")
def v2():
    return Tokenizer.load(V2_DIR)


@pytest.fixture(scope="module")
def v25():
    return Tokenizer.load(V25_DIR)


@pytest.fixture(scope="module")
def tiny():
    return Tokenizer.load(TINY_DIR)


def make_model_dir(tmp_path, source_dir, config=None, tokenizer_text=None):
    """A model directory holding `source_dir`'s tokenizer.json (or `tokenizer_text`) and `config`."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    if tokenizer_text is None:
        shutil.copy(source_dir / "tokenizer.json", model_dir / "tokenizer.json")
    else:
        (model_dir / "tokenizer.json").write_text(tokenizer_text)
    if config is not None:
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return model_dir


def v2_config(**changes):
    """DeepSeek-V2's tokenizer_config.json with `changes` applied; a value of ... removes the key."""
    config = json.loads((V2_DIR / "tokenizer_config.json").read_text())
    config.update(changes)
    return {k: v for k, v in config.items() if v is not ...}


def stream(tokenizer, ids, special=True):
    """A stream decoder's pieces and flush; with `special`, which `decode` equals (specials kept)."""
    decoder = tokenizer.stream_decoder(special)
    pieces = [decoder.push(i) for i in ids]
    return pieces, decoder.flush()


def test_a_stream_leaves_special_tokens_out_unless_asked(v25):
    """bos, eos and <|EOT|> are special in V2.5's tokenizer and add no text to a stream; its
    tool-call and FIM tokens are not, and stay (the server parses tool calls from the text)."""
    eos, eot = v25.encode("<｜end▁of▁sentence｜>", add_special_tokens=False), v25.encode("<|EOT|>", add_special_tokens=False)
    calls = v25.encode("<｜tool▁calls▁begin｜><｜fim▁hole｜>", add_special_tokens=False)
    ids = v25.encode("Hi", add_special_tokens=False) + eos + eot + calls + v25.encode(" there", add_special_tokens=False)
    assert set(eos + eot) <= v25.special_ids and not set(calls) & v25.special_ids
    pieces, rest = stream(v25, ids, special=False)
    assert "".join(pieces) + rest == "Hi<｜tool▁calls▁begin｜><｜fim▁hole｜> there"
    decoder = v25.stream_decoder(special=True)
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == v25.decode(ids)


def raises_one_line(match, fn, *args, **kwargs):
    with pytest.raises(TokenizerError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


# ---- special tokens and bos ----
def test_v2_tokenizer_json_lacks_bos_so_encode_prepends_exactly_one(v2):
    assert v2.encode("hi") == [100000, 4824]
    assert v2.encode("hi", add_special_tokens=False) == [4824]
    assert v2.encode("") == [100000]
    assert v2.encode(BOS + "hi") == [100000, 4824]          # a literal bos in the text is not doubled
    assert v2.encode(BOS + "hi", add_special_tokens=False) == [100000, 4824]


def test_tiny_post_processor_adds_bos_and_encode_does_not_double_it(tiny):
    assert tiny.encode("hi") == [0, 74, 75]
    assert tiny.encode("hi", add_special_tokens=False) == [74, 75]
    assert tiny.encode(BOS + "hi") == [0, 74, 75]            # the raw tokenizer gives [0, 0, 74, 75]


def test_added_token_objects_and_plain_strings_are_read(v2, v25, tiny):
    assert (v2.bos_token, v2.eos_token) == (BOS, EOS)        # AddedToken objects in the config
    assert (v2.bos_token_id, v2.eos_token_ids, v2.vocab_size) == (100000, (100001,), 100002)
    assert (v25.bos_token_id, v25.eos_token_ids, v25.vocab_size) == (100000, (100001,), 100018)
    assert (tiny.bos_token, tiny.eos_token) == (BOS, EOS)    # plain strings in the config
    assert (tiny.bos_token_id, tiny.eos_token_ids, tiny.vocab_size) == (0, (1,), 4096)


def test_missing_config_takes_deepseek_names_and_trusts_tokenizer_json(tmp_path):
    tok = Tokenizer.load(make_model_dir(tmp_path, V2_DIR))
    assert (tok.bos_token_id, tok.eos_token_ids, tok.chat_template) == (100000, (100001,), None)
    assert tok.encode("hi") == [4824]                        # no add_bos_token: tokenizer.json decides
    assert tok.render_chat(CONVERSATION) == V2_CONVERSATION  # fallback template


def test_add_bos_token_false_leaves_ids_alone(tmp_path):
    tok = Tokenizer.load(make_model_dir(tmp_path, V2_DIR, v2_config(add_bos_token=False)))
    assert tok.encode("hi") == [4824]


def test_special_token_absent_from_vocab_is_refused(tmp_path):
    model_dir = make_model_dir(tmp_path, V2_DIR, v2_config(bos_token="<s>"))
    raises_one_line(r"bos_token '<s>' is not in tokenizer.json", Tokenizer.load, model_dir)


def test_special_token_of_wrong_type_is_refused(tmp_path):
    model_dir = make_model_dir(tmp_path, V2_DIR, v2_config(eos_token=7))
    raises_one_line("eos_token must be a string or an AddedToken", Tokenizer.load, model_dir)


# ---- decode and streaming ----
def test_rocket_example_token_values(v2):
    ids = v2.encode(ROCKET_TEXT, add_special_tokens=False)
    assert ids == ROCKET_IDS
    assert [v2.token_text(i) for i in ids[9:11]] == [" \ufffd", "\ufffd\ufffd"]  # the split emoji
    assert v2.decode(ids) == ROCKET_TEXT
    assert v2.decode(np.array(ids, dtype=np.int64)) == ROCKET_TEXT


def test_decode_skips_nothing(v2):
    assert v2.decode([100000, 4824, 100001]) == f"{BOS}hi{EOS}"


def test_rocket_streams_without_replacement_characters(v2):
    pieces, rest = stream(v2, v2.encode(ROCKET_TEXT))
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[10:12] == [" ", "🚀"]           # the space at once, the emoji once it is whole
    assert "".join(pieces) + rest == BOS + ROCKET_TEXT
    assert rest == ""


def test_flush_returns_incomplete_bytes_at_the_end(v2):
    pieces, rest = stream(v2, ROCKET_IDS[:10])
    assert "".join(pieces) == "你好，世界！DeepSeek-V2 "
    assert rest == "\ufffd"


@pytest.mark.parametrize("name", ["v2", "tiny"])
@settings(max_examples=150, deadline=None, derandomize=True)
@given(text=texts)
def test_stream_concatenation_equals_decode(name, text, request):
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode(text) + [tokenizer.eos_token_ids[0]]
    pieces, rest = stream(tokenizer, ids)
    assert "".join(pieces) + rest == tokenizer.decode(ids) == tokenizer.bos_token + text + EOS
    assert all("\ufffd" not in p for p in pieces)


def test_stream_work_is_constant_per_token(tiny, monkeypatch):
    # ds2-tiny splits CJK and emoji into single bytes: the hardest case for holding back. The
    # byte-level path never re-decodes a window: one incremental UTF-8 step per token.
    ids = tiny.encode("你好 🚀 café\n" * 200)
    expected = tiny.decode(ids)
    monkeypatch.setattr(tiny, "decode", lambda window: pytest.fail("the byte-level stream re-decoded"))
    pieces, rest = stream(tiny, ids)
    assert "".join(pieces) + rest == expected


def test_stream_does_not_hold_bytes_that_never_complete(v2):
    # Byte-level BPE spells byte 0xF0 (the lead byte of a 4-byte character) as "ð".
    lead_byte = v2_byte_tokens()[0xF0]
    pieces, rest = stream(v2, [lead_byte] * 24)
    assert pieces[0] == "" and pieces[1:] == ["\ufffd"] * 23  # each is invalid once the next comes
    assert rest == "\ufffd"


def v2_byte_tokens() -> dict[int, int]:
    """byte -> id of DeepSeek-V2's single-byte tokens (all but the 13 bytes UTF-8 never uses)."""
    backend = tokenizers.Tokenizer.from_file(str(V2_DIR / "tokenizer.json"))
    ids = {b: backend.token_to_id(c) for c, b in byte_level_alphabet().items()}
    return {b: i for b, i in ids.items() if i is not None}


V2_HIGH_BYTES = sorted(b for b in v2_byte_tokens() if b >= 0x80)


def assert_streams_like_decode(tokenizer, ids):
    """After every id, the streamed text equals decode() of the ids so far whenever that decode
    does not end in an unfinished character, and is always a prefix of the final decode."""
    decoder, streamed = tokenizer.stream_decoder(special=True), ""      # decode() keeps special tokens
    final = tokenizer.decode(ids)
    for k, token in enumerate(ids, 1):
        streamed += decoder.push(token)
        assert final.startswith(streamed)
        so_far = tokenizer.decode(ids[:k])
        if not so_far.endswith("\ufffd"):
            assert streamed == so_far
    assert streamed + decoder.flush() == final


def test_eight_incomplete_byte_tokens_then_a_real_character(v2):
    """A run of lead bytes that never complete, then a whole emoji: the emoji must come out."""
    byte = v2_byte_tokens_cached()
    for n in range(1, 13):
        ids = [byte[0xF0]] * n + [byte[b] for b in "🚀".encode()] + [byte[0xE4]] * 3 + [byte[b] for b in "你".encode()]
        assert v2.decode(ids) == "\ufffd" * n + "🚀" + "\ufffd" * 3 + "你"
        assert_streams_like_decode(v2, ids)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.one_of(st.sampled_from(V2_HIGH_BYTES).map(lambda b: ("byte", b)),  # incomplete
                          st.sampled_from(V2_HIGH_BYTES).map(lambda b: ("byte", b)),
                          st.integers(0, 0x7F).map(lambda b: ("byte", b)),
                          st.sampled_from(TEXT_PIECES).map(lambda t: ("text", t)),
                          st.integers(0, 100_001).map(lambda i: ("id", i))),
                min_size=1, max_size=40))
def test_random_byte_token_sequences_stream_like_decode(v2, parts):
    byte = v2_byte_tokens_cached()
    ids = []
    for kind, value in parts:
        if kind == "byte":
            ids.append(byte[value])
        elif kind == "text":
            ids += v2.encode(value, add_special_tokens=False)
        else:
            ids.append(value)
    assert_streams_like_decode(v2, ids)


def test_two_thousand_random_byte_sequences_stream_like_decode(v2):
    """The issue's measurement: 2000 random sequences of mostly non-ASCII single-byte tokens."""
    byte, rng = v2_byte_tokens_cached(), np.random.default_rng(0)
    for _ in range(2000):
        values = rng.choice(V2_HIGH_BYTES, size=rng.integers(1, 16))
        values[rng.random(len(values)) < 0.1] = 0x41
        assert_streams_like_decode(v2, [byte[int(b)] for b in values])


_BYTE_TOKENS: dict[int, int] = {}


def v2_byte_tokens_cached() -> dict[int, int]:
    if not _BYTE_TOKENS:
        _BYTE_TOKENS.update(v2_byte_tokens())
    return _BYTE_TOKENS


# ---- chat templates ----
def test_v2_chat_template_renders_exactly(v2):
    assert v2.render_chat(CONVERSATION) == V2_CONVERSATION
    assert v2.render_chat(CONVERSATION, add_generation_prompt=False) == V2_CONVERSATION[:-len("Assistant:")]
    assert v2.encode_chat(CONVERSATION[1:2]) == [100000, 5726, 25, 11598, 185, 185, 77398, 25]


def test_tiny_chat_writes_a_single_bos(tiny):
    assert tiny.render_chat(CONVERSATION) == V2_CONVERSATION
    assert tiny.encode_chat(CONVERSATION[1:2]) == [0, 302, 28, 941, 201, 201, 304, 28]


def test_v25_template_with_namespace_renders(v25):
    assert v25.render_chat(CONVERSATION) == (
        f"{BOS}Be brief.<｜User｜>Hi<｜Assistant｜>Hello!{EOS}<｜User｜>2+2?<｜Assistant｜>")
    assert v25.render_chat(CONVERSATION, add_generation_prompt=False).endswith("<｜User｜>2+2?")
    assert v25.encode_chat(CONVERSATION[1:2]) == [100000, 100006, 11007, 100007]


def test_v25_template_renders_tool_calls(v25):
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [{"role": "user", "content": "Add."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "1"}]
    assert v25.render_chat(messages) == (
        f"{BOS}<｜User｜>Add.<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
        '<｜tool▁sep｜>add\n```json\n{"a": 1}\n```<｜tool▁call▁end｜>'
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>1<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")


def test_fallback_template_equals_deepseek_v2_chat(tmp_path, v2):
    assert FALLBACK_CHAT_TEMPLATE == v2.chat_template
    tok = Tokenizer.load(make_model_dir(tmp_path, V2_DIR, v2_config(chat_template=...)))
    assert tok.chat_template is None
    assert tok.render_chat(CONVERSATION) == v2.render_chat(CONVERSATION)
    assert tok.encode_chat(CONVERSATION) == v2.encode_chat(CONVERSATION)


def test_template_list_uses_default(tmp_path):
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]
    tok = Tokenizer.load(make_model_dir(tmp_path, V2_DIR, v2_config(chat_template=templates)))
    assert tok.render_chat([]) == f"D{BOS}"


def test_template_list_without_default_is_refused(tmp_path):
    model_dir = make_model_dir(tmp_path, V2_DIR, v2_config(chat_template=[{"name": "rag", "template": "R"}]))
    raises_one_line(r"no 'default' entry \(it has \['rag'\]\)", Tokenizer.load, model_dir)


def test_template_syntax_error_names_the_line(tmp_path):
    template = "{{ bos_token }}\n{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"
    model_dir = make_model_dir(tmp_path, V2_DIR, v2_config(chat_template=template))
    raises_one_line("^chat template line 3: ", Tokenizer.load, model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("template, messages, match", [
    ("{{ bos_token }}\n{% if messages[0]['role'] != 'user' %}\n{{ raise_exception('Must start with\\nuser') }}"
     "\n{% endif %}", [{"role": "system", "content": "x"}], "^chat template line 3: Must start with user$"),
    ("{% for m in messages %}\n\n{{ m['content'] + '!' }}\n{% endfor %}", [{"role": "user", "content": None}],
     "^chat template line 3: unsupported operand"),
    ("x\n{{ messages.__class__.__name__ }}", [], "^chat template line 2: access to attribute '__class__'"),
])
def test_template_runtime_error_names_the_line(tmp_path, template, messages, match):
    tok = Tokenizer.load(make_model_dir(tmp_path, V2_DIR, v2_config(chat_template=template)))
    raises_one_line(match, tok.render_chat, messages)


@pytest.mark.slow
def test_tojson_keeps_unicode_and_html(tmp_path):
    template = "{{ messages[0] | tojson }}"
    tok = Tokenizer.load(make_model_dir(tmp_path, V2_DIR, v2_config(chat_template=template)))
    assert tok.render_chat([{"role": "user", "content": "<b>你好</b>"}]) == (
        '{"role": "user", "content": "<b>你好</b>"}')


# ---- broken files and the vocab check ----
def test_missing_tokenizer_json(tmp_path):
    raises_one_line("tokenizer.json not found", Tokenizer.load, tmp_path)


@pytest.mark.parametrize("text", ["{not json", '{"version": "1.0"}', ""])
def test_corrupt_tokenizer_json(tmp_path, text):
    model_dir = make_model_dir(tmp_path, V2_DIR, tokenizer_text=text)
    raises_one_line("is not a valid tokenizer.json", Tokenizer.load, model_dir)


@pytest.mark.parametrize("text", ["{oops", "[1, 2]", b"\xff\xfe"])
def test_unreadable_tokenizer_config(tmp_path, text):
    model_dir = make_model_dir(tmp_path, TINY_DIR)
    config = model_dir / "tokenizer_config.json"
    config.write_bytes(text) if isinstance(text, bytes) else config.write_text(text)
    raises_one_line("tokenizer_config.json", Tokenizer.load, model_dir)


@pytest.mark.slow
def test_vocab_size_check():
    assert Tokenizer.load(V2_DIR, vocab_size=102400).vocab_size == 100002   # padded embedding: fine
    Tokenizer.load(V2_DIR, vocab_size=100002)
    raises_one_line("100002 token ids but the model's vocab_size is 100001", Tokenizer.load, V2_DIR,
                    vocab_size=100001)
    raises_one_line("4096 token ids but the model's vocab_size is 4095", Tokenizer.load, TINY_DIR,
                    vocab_size=4095)


@pytest.mark.parametrize("messages", ["hello", b"hello", {"role": "user", "content": "hi"}, ["hello"],
                                      [{"content": "hi"}], None])
def test_encode_chat_refuses_what_is_not_a_list_of_messages(v2, messages):
    raises_one_line("chat message", v2.encode_chat, messages)
    raises_one_line("chat message", v2.render_chat, messages)


def test_set_chat_template_replaces_the_checkpoint_template(tmp_path):
    tok = Tokenizer.load(TINY_DIR)
    before = tok.render_chat([{"role": "user", "content": "hi"}])
    tok.set_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<user>hi" != before
    raises_one_line("chat template line 1", tok.set_chat_template, "{% for %}")
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<user>hi"   # the old one stays


@pytest.mark.parametrize("name", ["v2", "v25", "tiny"])
def test_encode_gives_the_backends_own_ids(name, request):
    tok = request.getfixturevalue(name)
    text = V2_CONVERSATION + ROCKET_TEXT + "".join(TEXT_PIECES) * 50 + BOS + "  \n\t x"
    for special in (True, False):
        assert tok._ids(text, special) == tok._backend.encode(text, add_special_tokens=special).ids
    assert tok.encode(text, add_special_tokens=False) == tok._backend.encode(text, add_special_tokens=False).ids


@pytest.mark.slow
def test_a_long_encode_lets_the_other_threads_run(v2):
    """The server tokenizes on a request's thread: the others (the scheduler's passes) go on.
    Another thread takes 1,000 turns (each gives the GIL away) before the encode of a long
    prompt returns; an encode holding the GIL throughout would let it take about one."""
    import threading
    import time
    text = "What is 12 + 30? Twelve and thirty make forty-two.\n" * 20_000        # 1 MB
    started, done, turns = threading.Event(), threading.Event(), []

    def other():
        started.wait()
        while not done.is_set() and len(turns) < 1000:
            turns.append(1)
            time.sleep(0)                  # gives up the GIL: the encoding thread may take it
    thread = threading.Thread(target=other)
    thread.start()
    started.set()
    ids = v2.encode(text)
    done.set()
    thread.join()
    assert len(turns) == 1000
    assert ids == [v2.bos_token_id] + v2._backend.encode(text).ids
