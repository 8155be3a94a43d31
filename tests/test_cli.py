"""The command line, driven with click's CliRunner and real subprocesses, on ds2-tiny."""

import json
import re
import subprocess
import sys

from click.testing import CliRunner

import ds2cli
from ds2cli.cli import main
from ds2cli.generate import stream_generate

STATS = re.compile(r"^\[load \d+\.\d\ds \| prefill (\d+) tok, [\d.]+ tok/s \| decode (\d+) tok, [\d.]+ tok/s"
                   r" \| cache (\d+)/(\d+) tok, (\d+) bytes\]$")


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


def test_chat_scripted_greedy_answers_and_prefills_only_new_tokens():
    script = "What is 17 + 25?\nCount from 4 to 8.\nWho are you?\n/exit\n"
    r = run("chat", "--temperature", "0", "--stats", input=script)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == [
        "17 + 25 = 42.",
        "4, 5, 6, 7, 8.",
        "I am ds2-tiny, a small DeepSeek-V2 model. I can add and subtract numbers, count, and babble like Shakespeare.",
    ]
    stats = [STATS.match(line) for line in r.stderr.splitlines()]
    assert all(stats) and len(stats) == 3
    prefilled = [int(m.group(1)) for m in stats]
    cached = [int(m.group(3)) for m in stats]
    # each later turn prefills only its own tokens: the eos the last reply ended with (sampled,
    # never fed) plus "User: ...\n\nAssistant:"; everything before stays in the cache
    model = ds2cli.load()
    tok = model.tokenizer
    turn = lambda q: len(tok.encode("User: " + q + "\n\nAssistant:", add_special_tokens=False))  # noqa: E731
    assert prefilled[1] == 1 + turn("Count from 4 to 8.")
    assert prefilled[2] == 1 + turn("Who are you?")
    for i in (1, 2):
        assert cached[i] == cached[i - 1] + prefilled[i] + int(stats[i].group(2)) - 1


def test_chat_commands_save_clear_and_load(tmp_path):
    saved = tmp_path / "conv.json"
    r = run("chat", "--temperature", "0", "--system", "Be brief.",
            input=f"What is 2 + 3?\n/save {saved}\n/clear\n/help\n/bogus\nWhat is 10 + 11?\n/quit\n")
    assert r.exit_code == 0
    assert r.stdout.splitlines() == ["2 + 3 = 5.", "10 + 11 = 21."]
    messages = json.loads(saved.read_text())
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "What is 2 + 3?"},
                        {"role": "assistant", "content": "2 + 3 = 5."}]
    assert "/save PATH" in r.stderr and "unknown or incomplete command '/bogus'" in r.stderr
    r = run("chat", "--temperature", "0", "--load", str(saved), input="What is 30 + 12?\n")
    assert r.exit_code == 0 and r.stdout.splitlines() == ["30 + 12 = 42."]


def test_chat_drops_oldest_turns_when_the_context_is_full():
    questions = [f"What is {a} + {b}?" for a, b in [(11, 22), (33, 44), (15, 16), (21, 30)]]
    r = run("chat", "--temperature", "0", "--ctx", "64", "-n", "16", "--system", "Hi.",
            input="\n".join(questions) + "\n")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == ["11 + 22 = 33.", "33 + 44 = 77.", "15 + 16 = 31.", "21 + 30 = 51."]
    assert "warning: context full: dropped the oldest turn" in r.stderr


def test_generate_json_fields():
    r = run("generate", "--chat", "What is 451 - 123?", "--temperature", "0", "--json")
    assert r.exit_code == 0
    out = json.loads(r.stdout)
    assert out["text"] == "451 - 123 = 328."
    assert out["finish_reason"] == "eos"
    assert out["prompt_tokens"] == 19 and out["generated_tokens"] == 16  # 15 text tokens + eos
    assert set(out["timings"]) == {"load_s", "prefill_tok_per_s", "decode_tok_per_s"}
    assert all(v > 0 for v in out["timings"].values())


def test_generate_length_and_stop():
    r = run("generate", "ROMEO:\n", "--temperature", "0", "-n", "5", "--json")
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "length" and out["generated_tokens"] == 5
    r = run("generate", "--chat", "Count from 3 to 9.", "--temperature", "0", "--stop", "6", "--json")
    out = json.loads(r.stdout)
    assert out["text"] == "3, 4, 5, " and out["finish_reason"] == "stop"
    r = run("generate", "--chat", "Count from 3 to 9.", "--temperature", "0", "--stop", ", 6,")
    assert r.stdout == "3, 4, 5\n"


def test_generate_seed_reproducible_and_stdin_prompt():
    args = ["generate", "-", "--temperature", "1.0", "--top-p", "0.9", "-n", "30"]
    a = run(*args, "--seed", "7", input="ROMEO:\n")
    b = run(*args, "--seed", "7", input="ROMEO:\n")
    c = run(*args, "--seed", "8", input="ROMEO:\n")
    assert a.exit_code == 0 and a.stdout == b.stdout and a.stdout != c.stdout
    d = run("generate", "--seed", "7", "--temperature", "1.0", "--top-p", "0.9", "-n", "30", input="ROMEO:\n")
    assert d.stdout == a.stdout


def test_generate_stats_line_on_stderr_only():
    r = run("generate", "--chat", "What is 2 + 2?", "--temperature", "0", "--stats")
    assert r.stdout == "2 + 2 = 4.\n"
    m = STATS.match(r.stderr.strip())
    prompt = ds2cli.load().tokenizer.encode_chat([{"role": "user", "content": "What is 2 + 2?"}])
    assert m and int(m.group(1)) == len(prompt) and int(m.group(3)) == len(prompt) + int(m.group(2)) - 1


def test_streaming_never_splits_a_character():
    """ds2-tiny's byte-level BPE spells non-ASCII byte by byte: force those tokens out of the
    generation loop and check every streamed chunk is whole text."""
    model = ds2cli.load()
    text = "café ☕ 你好 🚀!"
    target = model.tokenizer.encode(text, add_special_tokens=False)
    assert len(target) > len(text)  # characters really span several tokens
    script = iter(target + [1])
    chunks = list(stream_generate(model, [0], model.new_cache(64), lambda logits, history: next(script), 64))
    assert all("\ufffd" not in c.text for c in chunks)
    assert "".join(c.text for c in chunks) == text and chunks[-1].finish_reason == "eos"


def test_help_and_version():
    r = run("--help")
    assert r.exit_code == 0
    for command in ("generate", "chat", "inspect"):
        assert command in r.stdout
    r = run("--version")
    assert r.exit_code == 0 and ds2cli.__version__ in r.stdout


def test_model_from_environment_variable(tmp_path):
    r = CliRunner(env={"DS2_MODEL": str(tmp_path / "nowhere")}).invoke(main, ["generate", "hi"])
    assert r.exit_code == 1
    assert r.stderr.startswith("error: model directory") and r.stderr.count("\n") == 1


def test_real_subprocess_python_m_and_pipe():
    p = subprocess.run([sys.executable, "-m", "ds2cli", "generate", "--chat", "What is 40 + 2?",
                        "--temperature", "0"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "40 + 2 = 42.\n" and p.stderr == ""
