"""text/reasoning.py: the prompt's state, the split of a reply into reasoning and answer (whole,
and streamed with the markers cut at every place a stream may cut them), and earlier turns'
reasoning kept from templates that do not handle it."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ds2cli.text.reasoning import (THINK_CLOSE, THINK_OPEN, ReasoningSplitter, Split, opens_reasoning, split,
                                   without_reasoning)

R1_PROMPT_TAIL = "<｜User｜>What is 2 + 3?<｜Assistant｜><think>\n"


def oracle(text: str, opened: bool) -> tuple[str | None, str]:
    """The split written plainly on the whole text: an opening marker only at the start, the
    first closing marker ends the reasoning, whitespace around the reasoning dropped."""
    head = text.lstrip()
    marked = head.startswith(THINK_OPEN)
    if not (marked or opened):
        return None, text
    body = head[len(THINK_OPEN):] if marked else text
    reasoning, closed, answer = body.partition(THINK_CLOSE)
    had = marked or bool(closed) or bool(reasoning.strip())
    return (reasoning.strip() if had else None), answer.lstrip()


def streamed(pieces: list[str], opened: bool) -> tuple[list[Split], Split]:
    """Each piece's output, and all of it joined (the flush included)."""
    splitter = ReasoningSplitter(opened)
    outs = [splitter.feed(p) for p in pieces] + [splitter.flush()]
    whole = Split()
    for out in outs:
        whole += out
    return outs, whole


def cut(text: str, at: list[int]) -> list[str]:
    bounds = [0, *sorted(set(at)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_whole_replies():
    assert split("<think>\nI add 2 and 3.\n</think>\n\n2 + 3 = 5.") == ("I add 2 and 3.", "2 + 3 = 5.")
    # R1: the prompt opened <think>, the reply has only the closing marker
    assert split("I add 2 and 3.\n</think>\n\n2 + 3 = 5.", opened=True) == ("I add 2 and 3.", "2 + 3 = 5.")
    # one it writes anyway is dropped
    assert split("<think>\nI add.\n</think>5", opened=True) == ("I add.", "5")
    # no markers: the reply is the answer, unchanged (leading whitespace included)
    assert split("  2 + 3 = 5.\n") == (None, "  2 + 3 = 5.\n")
    # a marker later than the start is text
    assert split("Use <think> tags.") == (None, "Use <think> tags.")
    assert split("a</think>b") == (None, "a</think>b")
    # cut off while thinking: all reasoning, no answer
    assert split("I add 2 and", opened=True) == ("I add 2 and", "")
    assert split("<think>I add 2 and </th") == ("I add 2 and </th", "")
    # only the first closing marker ends the reasoning
    assert split("<think>a</think>b</think>c") == ("a", "b</think>c")
    # an empty reasoning is still reasoning; an empty reply of an opened prompt is none
    assert split("<think></think>5") == ("", "5")
    assert split("", opened=True) == (None, "")


def test_the_prompt_says_whether_reasoning_is_open():
    assert opens_reasoning(R1_PROMPT_TAIL)
    assert opens_reasoning("Assistant: <think>")
    assert not opens_reasoning("<｜Assistant｜></think>")                # V3.1's non-thinking prompt
    assert not opens_reasoning("<｜User｜>Why <think> tags?<｜Assistant｜>")
    assert not opens_reasoning("<think>a</think>b<｜Assistant｜>")
    assert not opens_reasoning("User: hi\n\nAssistant:")


def test_markers_cut_at_every_boundary():
    """Every way of cutting a reply into three pieces gives the same split, and nothing shown is
    taken back: each piece's reasoning and content extend what came before (a partial marker
    shown as text would not be part of the final text)."""
    for opened, reply in [(False, "<think>\nab\n</think>\n\ncd"), (True, "ab </think> cd"),
                          (False, " <thx"), (True, "<think>a</think>")]:
        expected = oracle(reply, opened)
        for i, j in itertools.combinations_with_replacement(range(len(reply) + 1), 2):
            outs, whole = streamed(cut(reply, [i, j]), opened)
            assert (whole.reasoning, whole.content) == (expected[0] or "", expected[1]), (reply, i, j)
            assert all(THINK_OPEN not in o.content and THINK_CLOSE not in o.reasoning for o in outs)


PARTS = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "</thi", "think>", "k>", ">", "\n", " ", "a",
                         "b c", "5.", "/"])


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(PARTS, max_size=14), cuts=st.lists(st.integers(0, 60), max_size=8), opened=st.booleans())
def test_any_stream_gives_the_whole_text_split(parts, cuts, opened):
    text = "".join(parts)
    outs, whole = streamed(cut(text, [c for c in cuts if c <= len(text)]), opened)
    reasoning, content = oracle(text, opened)
    assert (whole.reasoning, whole.content) == (reasoning or "", content)
    assert split(text, opened) == (reasoning, content)
    shown = Split()
    for out in outs:                       # a prefix of the final split at every step
        shown += out
        assert reasoning is not None or not shown.reasoning
        assert (reasoning or "").startswith(shown.reasoning) and content.startswith(shown.content)


def test_earlier_reasoning_reaches_only_templates_that_handle_it():
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "<think>\nI add.\n</think>\n\n5", "reasoning_content": "I add."},
                {"role": "user", "content": "Why <think>?"}]
    plain = without_reasoning(messages, "{{ message['content'] }}")
    assert plain == [messages[0], {"role": "assistant", "content": "5"}, messages[2]]
    assert messages[1]["reasoning_content"] == "I add."          # the caller's list is not changed
    r1_like = without_reasoning(messages, "{% set c = message['content'].split('</think>')[-1] %}")
    assert r1_like[1] == {"role": "assistant", "content": "<think>\nI add.\n</think>\n\n5"}
    reads = without_reasoning(messages, "{{ message['reasoning_content'] }}{{ message['content'] }}")
    assert reads[1] == {"role": "assistant", "content": "5", "reasoning_content": "I add."}
