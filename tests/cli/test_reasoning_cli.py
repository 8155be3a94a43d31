"""Reasoning in `ds2 generate` and `ds2 chat`: the answer on stdout, the reasoning on stderr (or
hidden, or left in the reply with --reasoning-format none), both in --json, and kept in a saved
conversation without ever reaching the model's prompt again. ds2-tiny is made to write
`<think>...</think>answer` (tests/support/scripted.py), with a chat template in the manner of
DeepSeek-R1's (tests/data/r1_chat_template.jinja: its generation prompt opens `<think>`)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds2cli.cli.main import main
from ds2cli.generation.conversation import read_messages
from ds2cli.text.tokenizer import Tokenizer
from support.scripted import Script

pytestmark = pytest.mark.slow      # each command loads ds2-tiny

R1_TEMPLATE = Path(__file__).parents[1] / "data" / "r1_chat_template.jinja"
THOUGHT, ANSWER = "I add 2 and 3: 5.", "2 + 3 = 5."
R1_REPLY = f"{THOUGHT}\n</think>\n\n{ANSWER}"
V3_REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"


def ds2(*args, input=None):
    return CliRunner().invoke(main, [*map(str, args)], input=input)


@pytest.fixture
def prompts(monkeypatch):
    """Every prompt a chat template renders in this test."""
    seen, real = [], Tokenizer.render_chat

    def render_chat(self, *args, **kwargs):
        seen.append(real(self, *args, **kwargs))
        return seen[-1]
    monkeypatch.setattr(Tokenizer, "render_chat", render_chat)
    return seen


@pytest.mark.parametrize("template, reply", [(R1_TEMPLATE, R1_REPLY), (None, V3_REPLY)], ids=["r1", "ds2-tiny"])
def test_generate_prints_the_answer_on_stdout_and_the_reasoning_on_stderr(monkeypatch, template, reply):
    Script(reply).install(monkeypatch)
    chat = ["--chat-template", template] if template else ["--chat"]
    r = ds2("generate", *chat, "What is 2 + 3?", "--temperature", "0")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == ANSWER + "\n"
    assert r.stderr == THOUGHT + "\n"               # not a terminal: no dimming escapes
    r = ds2("generate", *chat, "What is 2 + 3?", "--temperature", "0", "--json")
    out = json.loads(r.stdout)
    assert (out["reasoning_content"], out["content"], out["text"]) == (THOUGHT, ANSWER, reply)
    assert out["finish_reason"] == "eos" and r.stderr == ""


def test_generate_hides_or_leaves_the_reasoning_as_asked(monkeypatch):
    Script(R1_REPLY).install(monkeypatch)
    base = ("generate", "--chat-template", R1_TEMPLATE, "What is 2 + 3?", "--temperature", "0")
    r = ds2(*base, "--hide-reasoning")
    assert (r.exit_code, r.stdout, r.stderr) == (0, ANSWER + "\n", "")
    r = ds2(*base, "--reasoning-format", "none")
    assert (r.exit_code, r.stdout, r.stderr) == (0, R1_REPLY + "\n", "")
    out = json.loads(ds2(*base, "--reasoning-format", "none", "--json").stdout)
    assert (out["reasoning_content"], out["content"], out["text"]) == (None, R1_REPLY, R1_REPLY)
    r = ds2(*base, "--reasoning-format", "none", "--hide-reasoning")
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.startswith("error: --hide-reasoning")
    # cut off while thinking: no answer on stdout, and --json says so
    out = json.loads(ds2(*base, "-n", "3", "--json").stdout)
    assert out["content"] == "" and THOUGHT.startswith(out["reasoning_content"]) and out["finish_reason"] == "length"


def test_generate_without_markers_is_unchanged():
    r = ds2("generate", "--chat", "What is 2 + 3?", "--temperature", "0", "--json")
    out = json.loads(r.stdout)
    assert (out["text"], out["content"], out["reasoning_content"]) == (ANSWER, ANSWER, None)


def test_chat_shows_reasoning_apart_keeps_it_saved_and_never_feeds_it_back(monkeypatch, tmp_path, prompts):
    Script(R1_REPLY).install(monkeypatch)
    saved = tmp_path / "c.json"
    r = ds2("chat", "--chat-template", R1_TEMPLATE, "--temperature", "0",
            input=f"What is 2 + 3?\nAnd again?\n/save {saved}\n")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == f"{ANSWER}\n{ANSWER}\n"
    assert r.stderr.splitlines() == [THOUGHT, THOUGHT, f"(saved 4 messages to {saved})"]
    messages = read_messages(saved)
    assert messages[1] == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    assert len(prompts) == 2 and prompts[1].startswith(prompts[0].removesuffix("<think>\n"))
    assert "I add" not in prompts[1] and f"<｜Assistant｜>{ANSWER}<｜end▁of▁sentence｜>" in prompts[1]
    # resumed: the reasoning stays in the file, and still out of the prompt
    prompts.clear()
    r = ds2("chat", "--chat-template", R1_TEMPLATE, "--temperature", "0", "--hide-reasoning", "--load", saved,
            input="Once more?\n")
    assert r.exit_code == 0 and r.stdout == ANSWER + "\n" and THOUGHT not in r.stderr
    assert len(prompts) == 1 and "I add" not in prompts[0]


def test_chat_with_a_template_that_does_not_strip_reasoning(monkeypatch, prompts):
    """ds2-tiny's own template knows nothing of <think>: ds2 leaves the reasoning out itself."""
    Script(V3_REPLY).install(monkeypatch)
    r = ds2("chat", "--temperature", "0", input="What is 2 + 3?\nAnd again?\n")
    assert r.exit_code == 0 and r.stdout == f"{ANSWER}\n{ANSWER}\n" and r.stderr == f"{THOUGHT}\n{THOUGHT}\n"
    assert "I add" not in prompts[1] and f"Assistant: {ANSWER}<｜end▁of▁sentence｜>" in prompts[1]
    r = ds2("chat", "--temperature", "0", "--reasoning-format", "none", input="What is 2 + 3?\n")
    assert r.stdout == V3_REPLY + "\n" and r.stderr == ""
